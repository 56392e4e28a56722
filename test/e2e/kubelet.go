package e2e

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
)

// KubeletDevicePluginDir is the device-plugin directory the kubelet hard-codes (it ignores
// --root-dir for it): plugins register through its kubelet.sock and put their sockets there.
const KubeletDevicePluginDir = "/var/lib/kubelet/device-plugins"

// Kubelet is a real kubelet (v1.37, built by test/tools/install-k8s.sh) running host-network pods
// on a private containerd, configured as ../shared/recipes/one-node-cluster found works on this kind
// of machine: cgroup v1 (failCgroupV1: false), cgroupfs, no QoS cgroups, a serving certificate from
// the control plane's CA, and ports picked free. Its root dir is private; only the device-plugin
// directory and /var/log/containers are host paths it hard-codes (StartKubelet creates them and
// its cleanup removes what it created).
type Kubelet struct {
	*Process
	Node    string
	RootDir string
	Config  string
	// PodResourcesSocket is the kubelet's PodResources API (<root-dir>/pod-resources/kubelet.sock).
	PodResourcesSocket string
	Port, HealthzPort  int

	cp *ControlPlane
}

// StartKubelet writes the kubelet's configuration, starts it against ctr and cp, waits until its
// Node is Ready and removes the node.kubernetes.io/not-ready taint (no node-lifecycle controller
// runs to do that). The kubelet is one of cp's processes: the control plane's cleanup stops it.
// The caller must hold the host's kubelet paths (lockKubeletHost) for as long as it runs.
func StartKubelet(t *testing.T, cp *ControlPlane, ctr *Containerd, node string) *Kubelet {
	t.Helper()
	return startKubelet(t, cp, ctr, node, "kubelet")
}

// startKubelet is StartKubelet with the kubelet's process (and log) named name and more flags
// (extra); it runs in ctr's mount namespace, where a multi-node cluster gives each node its own
// device-plugin directory.
func startKubelet(t *testing.T, cp *ControlPlane, ctr *Containerd, node, name string, extra ...string) *Kubelet {
	t.Helper()
	k := &Kubelet{Node: node, RootDir: filepath.Join(ctr.Base, "kubelet"), cp: cp,
		Port: freePort(t), HealthzPort: freePort(t)}
	k.PodResourcesSocket = filepath.Join(k.RootDir, "pod-resources", "kubelet.sock")
	for _, d := range []string{k.RootDir, filepath.Join(ctr.Base, "pod-logs")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// Without any CNI network configuration containerd reports NetworkReady=false and the Node
	// stays NotReady; host-network pods never invoke CNI, so a placeholder is enough (containerd
	// watches the directory).
	cni := `{"cniVersion": "1.0.0", "name": "hostnet-only", "plugins": [{"type": "loopback"}]}` + "\n"
	if err := os.WriteFile(filepath.Join(ctr.Base, "cni", "net.d", "10-hostnet-only.conflist"), []byte(cni), 0o644); err != nil {
		t.Fatal(err)
	}
	crt, key, err := cp.PKI.Issue("kubelet-serving-"+node, CertSpec{CommonName: node, Hosts: []string{"127.0.0.1", "localhost", node}})
	if err != nil {
		t.Fatal(err)
	}
	kc := cp.KubeletKubeconfig(t, node)
	k.Config = filepath.Join(ctr.Base, "kubelet-config.yaml")
	if err := os.WriteFile(k.Config, []byte(k.config(ctr, crt, key)), 0o644); err != nil {
		t.Fatal(err)
	}
	// kubectl logs/exec: the kubelet authorizes the API server's client certificate (CN
	// kube-apiserver-kubelet-client) with a SubjectAccessReview on nodes/proxy.
	k.bindAPIServerKubeletClient(t)
	argv := inMountNS(t, ctr.MountNS, tool(t, "kubelet"),
		append([]string{"--config=" + k.Config, "--kubeconfig=" + kc, "--root-dir=" + k.RootDir, "--hostname-override=" + node, "-v=2"}, extra...)...)
	k.Process = cp.StartProcess(t, name, argv[0], argv[1:]...)
	k.WaitReady(t)
	return k
}

func (k *Kubelet) config(ctr *Containerd, crt, key string) string {
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# cgroup v1 host: 1.34 defaults to false, 1.35+ to true
failCgroupV1: false
# containerd's runc runs with SystemdCgroup = false
cgroupDriver: cgroupfs
# no kubepods/* hierarchy on the host
cgroupsPerQOS: false
enforceNodeAllocatable: []
containerRuntimeEndpoint: unix://%[1]s
imageServiceEndpoint: unix://%[1]s
address: 127.0.0.1
port: %[2]d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %[3]d
tlsCertFile: %[4]s
tlsPrivateKeyFile: %[5]s
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: %[6]s}
authorization: {mode: Webhook}
failSwapOn: false
resolvConf: /etc/resolv.conf
registerNode: true
podLogsDir: %[7]s
# device-plugin capacity shows up on the Node quickly
nodeStatusUpdateFrequency: 2s
syncFrequency: 5s
serializeImagePulls: false
evictionHard: {memory.available: "100Mi", nodefs.available: "1%%", imagefs.available: "1%%", nodefs.inodesFree: "1%%"}
# never collect the locally imported images: there is no registry to pull them again from
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
`, ctr.Socket, k.Port, k.HealthzPort, crt, key, k.cp.PKI.CACert, filepath.Join(ctr.Base, "pod-logs"))
}

func (k *Kubelet) bindAPIServerKubeletClient(t *testing.T) {
	t.Helper()
	crb := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "tessera-e2e:apiserver-kubelet-client"},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "system:kubelet-api-admin"},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: "kube-apiserver-kubelet-client"}},
	}
	_, err := k.cp.Client.RbacV1().ClusterRoleBindings().Create(context.Background(), crb, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("create ClusterRoleBinding for kubectl exec/logs: %v", err)
	}
}

// Healthz reports whether the kubelet's /healthz answers ok.
func (k *Kubelet) Healthz() bool {
	c := &http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get("http://127.0.0.1:" + strconv.Itoa(k.HealthzPort) + "/healthz")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// WaitReady waits for the kubelet's /healthz and its Node to be Ready, then removes the not-ready
// taint that node admission put on the new Node.
func (k *Kubelet) WaitReady(t testing.TB) {
	t.Helper()
	ctx := context.Background()
	var last string
	err := waitFor(2*time.Minute, 200*time.Millisecond, func() (bool, error) {
		if !k.Running() {
			return false, fmt.Errorf("kubelet exited")
		}
		if !k.Healthz() {
			return false, fmt.Errorf("kubelet /healthz not ok")
		}
		n, err := k.cp.Client.CoreV1().Nodes().Get(ctx, k.Node, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, c := range n.Status.Conditions {
			if c.Type == corev1.NodeReady {
				last = fmt.Sprintf("Ready=%s %s: %s", c.Status, c.Reason, c.Message)
				return c.Status == corev1.ConditionTrue, fmt.Errorf("node %s %s", k.Node, last)
			}
		}
		return false, fmt.Errorf("node %s has no Ready condition", k.Node)
	})
	if err != nil {
		t.Fatalf("kubelet did not get node %s Ready: %v\n%s", k.Node, err, k.LogTail(40))
	}
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		n, err := k.cp.Client.CoreV1().Nodes().Get(ctx, k.Node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		var keep []corev1.Taint
		for _, tn := range n.Spec.Taints {
			if tn.Key != corev1.TaintNodeNotReady {
				keep = append(keep, tn)
			}
		}
		if len(keep) == len(n.Spec.Taints) {
			return nil
		}
		n.Spec.Taints = keep
		_, err = k.cp.Client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatalf("remove the not-ready taint from %s: %v", k.Node, err)
	}
}

// Restart stops the kubelet gracefully and starts it again; it waits for the Node to be Ready.
// Like any kubelet start, this deletes every socket in the device-plugin directory.
func (k *Kubelet) Restart(t testing.TB) {
	t.Helper()
	k.Stop(t)
	k.Start(t)
	k.WaitReady(t)
}

// kubeletHost holds the host paths a kubelet hard-codes while a cluster runs: only one kubelet
// per machine can own /var/lib/kubelet/device-plugins (every kubelet start deletes the sockets in
// it), so clusters of concurrent test runs take turns.
type kubeletHost struct {
	lock    *os.File
	created []string // host directories this run created, removed at release
}

// lockKubeletHost waits (up to timeout) for the host-wide lock and creates the kubelet's
// hard-coded host directories that are missing. The lock is a flock on /var/lib (always there, so
// nothing is left behind); the kernel drops it if the test binary dies.
func lockKubeletHost(t testing.TB, timeout time.Duration) *kubeletHost {
	t.Helper()
	f, err := os.Open("/var/lib")
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(timeout)
	logged := false
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			f.Close()
			t.Fatalf("another cluster holds the kubelet host paths (flock /var/lib) for more than %s", timeout)
		}
		if !logged {
			t.Logf("waiting for another cluster run to release the kubelet host paths")
			logged = true
		}
		time.Sleep(500 * time.Millisecond)
	}
	h := &kubeletHost{lock: f}
	// A socket nobody owns is a leftover of a killed run; a live kubelet.sock is a kubelet that
	// is not ours (a real node's, or a run that does not take the lock).
	if conn, err := net.DialTimeout("unix", filepath.Join(KubeletDevicePluginDir, "kubelet.sock"), time.Second); err == nil {
		conn.Close()
		h.release()
		t.Fatalf("a kubelet outside this test serves %s/kubelet.sock; refusing to run a second one", KubeletDevicePluginDir)
	}
	for _, d := range []string{"/var/lib/kubelet", KubeletDevicePluginDir, "/var/log/containers"} {
		if _, err := os.Stat(d); os.IsNotExist(err) {
			if err := os.MkdirAll(d, 0o755); err != nil {
				h.release()
				t.Fatal(err)
			}
			h.created = append(h.created, d)
		}
	}
	return h
}

// release removes the host directories this run created (newest first) and drops the lock.
func (h *kubeletHost) release() []error {
	var errs []error
	for i := len(h.created) - 1; i >= 0; i-- {
		if err := os.RemoveAll(h.created[i]); err != nil {
			errs = append(errs, err)
		}
	}
	h.created = nil
	if h.lock != nil {
		syscall.Flock(int(h.lock.Fd()), syscall.LOCK_UN)
		h.lock.Close()
		h.lock = nil
	}
	return errs
}
