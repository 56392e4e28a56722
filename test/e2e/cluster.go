package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// Cluster is a one-node Kubernetes cluster with Tessera on the simulated 8-GPU node, every part
// real except the GPUs: containerd 2.2 (NRI + CDI), etcd, kube-apiserver, kube-scheduler wired to
// tessera-extender (filter, prioritize, bind), a kubelet v1.37 running host-network pods on that
// containerd, and tessera-node (device plugins, CDI specs, NRI plugin) on `--backend=sim`.
// Everything lives under private directories and is torn down by the test's cleanup, which leaves
// nothing running or mounted.
type Cluster struct {
	// Node is the kubelet's node name. It is "localhost" by default: the API server reaches the
	// kubelet (kubectl exec/logs) by the node's Hostname address, and the kubelet listens on
	// loopback only (it refuses a loopback --node-ip), so the name must resolve to 127.0.0.1.
	Node string
	// Dir is the cluster's private directory (containerd's base; the kubelet, the agent's state
	// and data, and libvcuda.so live below it). The control plane has its own, CP.Dir.
	Dir string

	Ctr     *Containerd
	CP      *ControlPlane
	Kubelet *Kubelet

	// Agent is tessera-node; AgentAddr serves its /metrics and /healthz; its ledger is
	// AgentDataDir/ledger.json.
	Agent        *Process
	AgentAddr    string
	AgentDataDir string
	// Extender is tessera-extender, serving the scheduler at ExtenderAddr.
	Extender     *Process
	ExtenderAddr string
	// Kubeconfig is an admin kubeconfig (kubectl --kubeconfig, KUBECONFIG).
	Kubeconfig string
	// Inventory is what the agent published on the Node when the cluster came up.
	Inventory *api.NodeInventory

	host *kubeletHost
	dra  bool
	// description is the simulated node tessera-node runs (--node-description; "" the default).
	description string
	// agentArgs are more tessera-node flags (a multi-node cluster's faster heartbeat).
	agentArgs []string
	// simStateDir is where this host reaches the simulated node's state (its faults directory):
	// <Dir>/sim for a host-process agent; the chart's <runDir>/sim in the node's mount namespace
	// for a multi-node cluster's agent pod.
	simStateDir string
	// agentPod, when set, finds the node's tessera-node pod (installed by the chart; Agent is nil
	// then): its name and its container log files.
	agentPod func(t testing.TB) (name string, logs []string)
}

// ClusterOptions tunes StartCluster; the zero value is the standard cluster.
type ClusterOptions struct {
	// Node is the node name (default "localhost"; see Cluster.Node).
	Node string
	// Policy is the extender's default placement policy (default api.PolicyTessera).
	Policy string
	// LockTimeout bounds the wait for another cluster on this machine to finish (default 15 min):
	// the kubelet's device-plugin directory is a host path, so clusters take turns.
	LockTimeout time.Duration
	// DRA runs tessera-node with its DRA kubelet plugin (--dra), the controller manager (for
	// ResourceClaimTemplates) and the chart's DRA RBAC and DeviceClasses (dra_harness.go).
	DRA bool
	// Bare brings up containerd, the control plane with kube-controller-manager (Deployments,
	// DaemonSets, ServiceAccount tokens) and the kubelet only: no kube-scheduler, tessera-node or
	// tessera-extender, which the test installs itself (TestHelmInstall). Agent and Extender stay nil.
	Bare bool
}

// Resources the simulated node advertises when nothing is allocated: 6 GPUs usable whole or
// shared (GPU 6 is an mdev parent, GPU 7 is in MIG mode) and 10 shares per usable GPU.
const (
	SimWholeGPUs = 6
	SimShares    = 60
)

// StartCluster brings the cluster up and waits until the Node is Ready, tessera-node has registered
// its device plugins (the Node's allocatable shows them), published its inventory and connected to
// containerd through NRI, and tessera-extender serves.
func StartCluster(t *testing.T, opts ClusterOptions) *Cluster {
	t.Helper()
	if opts.Node == "" {
		opts.Node = "localhost"
	}
	if opts.Policy == "" {
		opts.Policy = api.PolicyTessera
	}
	if opts.LockTimeout == 0 {
		opts.LockTimeout = 15 * time.Minute
	}
	t0 := time.Now()
	step := func(what string) { t.Logf("cluster: %s (%.1fs)", what, time.Since(t0).Seconds()) }
	c := &Cluster{Node: opts.Node, dra: opts.DRA}
	if opts.DRA {
		// TestDRA/Health waits one quiet health-check interval for a GPU to recover (the chart's
		// default is 30 s).
		c.agentArgs = []string{"--health-check-interval=5s"}
	}
	// Cleanups run last-registered first: the cluster's own teardown, then the control plane's
	// (it stops every process it started), then containerd's, then the host paths are released.
	c.host = lockKubeletHost(t, opts.LockTimeout)
	t.Cleanup(func() {
		for _, err := range c.host.release() {
			t.Errorf("release kubelet host paths: %v", err)
		}
	})
	// Build tessera's commands while containerd and the control plane start.
	built := make(chan struct{})
	go func() { defer close(built); tesseraBinary(&quietTB{TB: t}, "tessera-node") }()
	c.Ctr = StartContainerd(t)
	c.Dir = c.Ctr.Base
	step("containerd up")
	if opts.Bare {
		c.CP = StartControlPlane(t, ControlPlaneOptions{NoScheduler: true, ControllerManager: true})
		c.Kubeconfig = c.CP.Kubeconfig
		t.Cleanup(func() { c.teardown(t) })
		step("control plane up")
		c.Kubelet = StartKubelet(t, c.CP, c.Ctr, c.Node)
		step("kubelet up, node Ready")
		<-built
		return c
	}
	c.ExtenderAddr = fmt.Sprintf("127.0.0.1:%d", freePort(t))
	c.CP = StartControlPlane(t, ControlPlaneOptions{Extender: chartExtender(t, "http://"+c.ExtenderAddr), ControllerManager: opts.DRA})
	c.Kubeconfig = c.CP.Kubeconfig
	t.Cleanup(func() { c.teardown(t) })
	step("control plane up")
	<-built
	tesseraBinary(t, "tessera-node") // fails the test here, on its goroutine, if the build failed
	driver := BuildSimDriver(t)
	c.startExtender(t, opts.Policy)
	step("tessera-extender up")
	c.Kubelet = StartKubelet(t, c.CP, c.Ctr, c.Node)
	step("kubelet up, node Ready")
	c.startAgent(t, driver)
	c.WaitAgentReady(t)
	c.WaitAllocatable(t, map[string]int64{api.ResourceGPU: SimWholeGPUs, api.ResourceShare: SimShares})
	step("tessera-node up, device plugins registered")
	return c
}

func (c *Cluster) startExtender(t *testing.T, policy string) {
	t.Helper()
	// A fixed identity lets a restarted extender take its leader Lease back at once instead of
	// waiting for it to expire (a Deployment's new pod would wait).
	c.Extender = startExtenderReplica(t, c.CP, policy, 5*time.Minute, "tessera-extender", "--listen", c.ExtenderAddr, "--identity", "tessera-extender-e2e")
	c.WaitExtender(t)
}

// startExtenderReplica starts tessera-extender as process name with the e2e extender
// configuration for policy and inventoryMaxAge maxAge, plus args (--listen, --identity, replica flags).
func startExtenderReplica(t testing.TB, cp *ControlPlane, policy string, maxAge time.Duration, name string, args ...string) *Process {
	t.Helper()
	kc := cp.MintKubeconfig(t, "tessera-extender", CertSpec{CommonName: "tessera-extender", Organizations: []string{"system:masters"}})
	cfg := filepath.Join(cp.Dir, "extender-config.yaml")
	// inventoryMaxAge (the chart's is 5m): pods place only while the agent's heartbeat is fresh;
	// the pods here are the default scheduler's, which calls the extender.
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf("apiVersion: %s\nkind: %s\npolicy: %s\nreservationTTL: 30s\ninventoryMaxAge: %s\nschedulerNames: [default-scheduler]\n",
		api.Version, configv1.KindExtenderConfig, policy, maxAge)), 0o644); err != nil {
		t.Fatal(err)
	}
	return cp.StartProcess(t, name, tesseraBinary(t, "tessera-extender"), append([]string{"--kubeconfig", kc, "--config", cfg}, args...)...)
}

// WaitExtender waits until tessera-extender answers /healthz.
func (c *Cluster) WaitExtender(t testing.TB) {
	t.Helper()
	c.Extender.WaitHealthy(t, "http://"+c.ExtenderAddr+"/healthz", time.Minute)
}

// agentNamespace is where the chart's node agent ServiceAccount lives in the e2e cluster.
const agentNamespace = "tessera-system"

// applyAgentRBAC applies the chart's node-agent ServiceAccount, ClusterRole and binding (rendered by
// helm; the DaemonSet left out: the agent runs as a host process here) and returns a kubeconfig
// with that ServiceAccount's identity, so the agent has exactly the rights the chart grants.
func (c *Cluster) applyAgentRBAC(t *testing.T) string {
	t.Helper()
	manifest, err := helm(t, "template", "tessera", helmChart(), "--namespace", agentNamespace, "--show-only", "templates/node-agent.yaml")
	if err != nil {
		t.Fatalf("helm template node-agent.yaml: %v\n%s", err, manifest)
	}
	var keep []string
	for _, doc := range strings.Split(manifest, "\n---") {
		if !strings.Contains(doc, "\nkind: DaemonSet") {
			keep = append(keep, doc)
		}
	}
	c.CP.CreateNamespace(t, agentNamespace)
	if out, err := runStdin(t, time.Minute, strings.Join(keep, "\n---"), tool(t, "kubectl"), "--kubeconfig", c.CP.Kubeconfig, "apply", "-f", "-"); err != nil {
		t.Fatalf("apply the chart's node-agent RBAC: %v\n%s", err, out)
	}
	// RBAC matches a ServiceAccount subject by this user name.
	return c.CP.MintKubeconfig(t, "tessera-node", CertSpec{CommonName: "system:serviceaccount:" + agentNamespace + ":tessera-node",
		Organizations: []string{"system:serviceaccounts", "system:serviceaccounts:" + agentNamespace}})
}

func (c *Cluster) startAgent(t *testing.T, driver SimDriver) {
	t.Helper()
	kc := c.applyAgentRBAC(t)
	c.applyDRAChart(t)
	c.AgentAddr = fmt.Sprintf("127.0.0.1:%d", freePort(t))
	c.AgentDataDir = filepath.Join(c.Dir, "agent-data")
	name := "tessera-node"
	runtime := []string{"--cdi-dir=" + c.Ctr.CDIDir, "--nri-socket=" + c.Ctr.NRISocket, "--cri-socket=" + c.Ctr.Socket}
	argv := []string{tesseraBinary(t, "tessera-node"), "run",
		"--backend=sim", "--state-dir=" + filepath.Join(c.Dir, "sim"), "--node-description=" + c.description,
		"--node-name=" + c.Node, "--data-dir=" + c.AgentDataDir, "--run-dir=" + filepath.Join(c.Dir, "agent-run"),
		"--device-plugin-dir=" + KubeletDevicePluginDir, "--pod-resources-socket=" + c.Kubelet.PodResourcesSocket,
		"--kubeconfig=" + kc, "--listen=" + c.AgentAddr, "--vcuda-library=" + driver.VCUDALibrary, "--sim-driver-dir=" + driver.FakeDir,
		"--config=" + c.draAgentConfig(t)} // "": none
	argv = append(append(argv, runtime...), c.agentArgs...)
	c.Agent = c.CP.StartProcess(t, name, argv[0], argv[1:]...)
	c.simStateDir = filepath.Join(c.Dir, "sim")
}

// AgentLog is tessera-node's log: the host process's, or the agent pod's container logs (every
// restart of its container, oldest first).
func (c *Cluster) AgentLog(t testing.TB) string {
	t.Helper()
	files := []string{}
	if c.Agent != nil {
		files = append(files, c.Agent.Log)
	} else if c.agentPod != nil {
		_, files = c.agentPod(t)
	}
	var b strings.Builder
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatalf("tessera-node's log: %v", err)
		}
		b.Write(data)
	}
	return b.String()
}

// AgentLogTail is the end of AgentLog, for failure messages.
func (c *Cluster) AgentLogTail(t testing.TB, n int) string {
	t.Helper()
	if c.Agent != nil {
		return c.Agent.LogTail(n)
	}
	lines := strings.Split(c.AgentLog(t), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// AgentHealthy reports whether tessera-node's /healthz is ok: inventory discovered, every device
// plugin registered with the kubelet and the NRI plugin synchronized with containerd.
func (c *Cluster) AgentHealthy() bool {
	hc := &http.Client{Timeout: 2 * time.Second}
	resp, err := hc.Get("http://" + c.AgentAddr + "/healthz")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// WaitAgentReady waits for tessera-node's /healthz and for its inventory on the Node; it records
// the inventory in c.Inventory.
func (c *Cluster) WaitAgentReady(t testing.TB) {
	t.Helper()
	err := waitFor(2*time.Minute, 100*time.Millisecond, func() (bool, error) {
		if c.Agent != nil && !c.Agent.Running() {
			return false, fmt.Errorf("tessera-node exited")
		}
		if !c.AgentHealthy() {
			return false, fmt.Errorf("tessera-node /healthz not ok")
		}
		n, err := c.CP.Client.CoreV1().Nodes().Get(context.Background(), c.Node, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		raw, ok := n.Annotations[api.AnnotationInventory]
		if !ok {
			return false, fmt.Errorf("no %s annotation on node %s", api.AnnotationInventory, c.Node)
		}
		inv, err := api.DecodeInventory([]byte(raw))
		if err != nil {
			return false, err
		}
		c.Inventory = inv
		return true, nil
	})
	if err != nil {
		t.Fatalf("tessera-node not ready: %v\n%s", err, c.AgentLogTail(t, 40))
	}
}

// Allocatable returns the Node's allocatable amount of each resource.
func (c *Cluster) Allocatable(t testing.TB) map[string]int64 {
	t.Helper()
	n, err := c.CP.Client.CoreV1().Nodes().Get(context.Background(), c.Node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	for k, v := range n.Status.Allocatable {
		out[string(k)] = v.Value()
	}
	return out
}

// WaitAllocatable waits until the Node's allocatable has exactly these amounts (the device plugins'
// healthy devices as the kubelet counts them).
func (c *Cluster) WaitAllocatable(t testing.TB, want map[string]int64) {
	t.Helper()
	var got map[string]int64
	err := waitFor(90*time.Second, 200*time.Millisecond, func() (bool, error) {
		n, err := c.CP.Client.CoreV1().Nodes().Get(context.Background(), c.Node, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		got = map[string]int64{}
		for r := range want {
			q := n.Status.Allocatable[corev1.ResourceName(r)]
			got[r] = q.Value()
			if got[r] != want[r] {
				return false, fmt.Errorf("allocatable %s = %d, want %d", r, got[r], want[r])
			}
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("node %s: %v\nagent:\n%s", c.Node, err, c.Agent.LogTail(20))
	}
}

// ExpectedAllocatable is what the Node's allocatable whole GPUs and shares must settle at, from
// the assignments of the pods bound now: a GPU holding shares is not offered whole, a GPU held
// whole offers no shares.
func (c *Cluster) ExpectedAllocatable(t testing.TB) map[string]int64 {
	t.Helper()
	l, err := c.CP.Client.CoreV1().Pods(metav1.NamespaceDefault).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	shared, whole := map[string]bool{}, map[string]bool{}
	for i := range l.Items {
		p := &l.Items[i]
		if p.Spec.NodeName == "" || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		if a := c.Assignment(t, p); a != nil {
			for _, ca := range a.Containers {
				for _, d := range ca.Devices {
					if d.Whole {
						whole[d.UUID] = true
					} else {
						shared[d.UUID] = true
					}
				}
			}
		}
	}
	return map[string]int64{api.ResourceGPU: int64(SimWholeGPUs - len(shared)),
		api.ResourceShare: int64(SimShares - len(whole)*c.Inventory.SharesPerGPU)}
}

// Kubectl runs kubectl against the cluster with the admin kubeconfig.
func (c *Cluster) Kubectl(t testing.TB, args ...string) (string, error) {
	t.Helper()
	return runCmd(t, 2*time.Minute, tool(t, "kubectl"), append([]string{"--kubeconfig", c.Kubeconfig}, args...)...)
}

// KubectlStdin runs kubectl with stdin.
func (c *Cluster) KubectlStdin(t testing.TB, stdin string, args ...string) (string, error) {
	t.Helper()
	return runStdin(t, 2*time.Minute, stdin, tool(t, "kubectl"), append([]string{"--kubeconfig", c.Kubeconfig}, args...)...)
}

// Exec runs a shell script in a pod's container through the API server and the kubelet
// (kubectl exec); it returns the combined output and the command's error. On a node of a
// multi-node cluster it goes through the node's CRI (crictl exec): the API server reaches kubelets
// by the node's address, and these kubelets all listen on loopback.
func (c *Cluster) Exec(t testing.TB, pod, container, script string) (string, error) {
	t.Helper()
	if c.Ctr.MountNS != "" {
		id := c.ContainerID(t, pod, container)
		if id == "" {
			return "", fmt.Errorf("pod %s has no running container %s on node %s", pod, container, c.Node)
		}
		return c.Ctr.Crictl(t, "exec", id, "sh", "-c", script)
	}
	return c.Kubectl(t, "exec", pod, "-c", container, "--", "sh", "-c", script)
}

// MustExec is Exec that fails the test on error.
func (c *Cluster) MustExec(t testing.TB, pod, script string) string {
	t.Helper()
	out, err := c.Exec(t, pod, "main", script)
	if err != nil {
		t.Fatalf("exec in %s: %v\n%s", pod, err, out)
	}
	return out
}

// ExecEventually is MustExec that retries for up to 30 s while exec fails: right after a kubelet
// restart the kubelet answers "pod does not exist" until it has synced its pods again.
func (c *Cluster) ExecEventually(t testing.TB, pod, script string) string {
	t.Helper()
	var out string
	err := waitFor(30*time.Second, 200*time.Millisecond, func() (bool, error) {
		var err error
		out, err = c.Exec(t, pod, "main", script)
		if err != nil {
			return false, fmt.Errorf("%v: %s", err, out)
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("exec in %s: %v", pod, err)
	}
	return out
}

// Pod returns a pod of the default namespace.
func (c *Cluster) Pod(t testing.TB, name string) *corev1.Pod {
	t.Helper()
	p, err := c.CP.Client.CoreV1().Pods(metav1.NamespaceDefault).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get pod %s: %v", name, err)
	}
	return p
}

// WaitRunning waits until every named pod of the default namespace is Running with its containers
// ready, and returns them in that order.
func (c *Cluster) WaitRunning(t testing.TB, timeout time.Duration, names ...string) []*corev1.Pod {
	t.Helper()
	out := make([]*corev1.Pod, len(names))
	for i, name := range names {
		err := waitFor(timeout, 200*time.Millisecond, func() (bool, error) {
			p, err := c.CP.Client.CoreV1().Pods(metav1.NamespaceDefault).Get(context.Background(), name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			out[i] = p
			if p.Status.Phase != corev1.PodRunning {
				return false, fmt.Errorf("pod %s is %s", name, p.Status.Phase)
			}
			for _, cs := range p.Status.ContainerStatuses {
				if !cs.Ready {
					return false, fmt.Errorf("pod %s container %s not ready", name, cs.Name)
				}
			}
			return true, nil
		})
		if err != nil {
			t.Fatalf("%v\n%s", err, c.Describe(t, name))
		}
	}
	return out
}

// Describe summarises a pod for failure messages: phase, conditions, container states, events.
func (c *Cluster) Describe(t testing.TB, name string) string {
	t.Helper()
	var b strings.Builder
	p, err := c.CP.Client.CoreV1().Pods(metav1.NamespaceDefault).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		return fmt.Sprintf("pod %s: %v", name, err)
	}
	fmt.Fprintf(&b, "pod %s: node=%q phase=%s\n", name, p.Spec.NodeName, p.Status.Phase)
	for _, cd := range p.Status.Conditions {
		fmt.Fprintf(&b, "  condition %s=%s %s %s\n", cd.Type, cd.Status, cd.Reason, cd.Message)
	}
	for _, cs := range p.Status.ContainerStatuses {
		fmt.Fprintf(&b, "  container %s: ready=%t restarts=%d state=%+v\n", cs.Name, cs.Ready, cs.RestartCount, cs.State)
	}
	for _, e := range c.Events(t, name, "") {
		fmt.Fprintf(&b, "  event %s\n", e)
	}
	return b.String()
}

// Events lists "Reason: message" of the events about a pod of the default namespace, optionally
// only those with reason.
func (c *Cluster) Events(t testing.TB, pod, reason string) []string {
	t.Helper()
	sel := fields.OneTermEqualSelector("involvedObject.name", pod)
	if reason != "" {
		sel = fields.AndSelectors(sel, fields.OneTermEqualSelector("reason", reason))
	}
	l, err := c.CP.Client.CoreV1().Events(metav1.NamespaceDefault).List(context.Background(), metav1.ListOptions{FieldSelector: sel.String()})
	if err != nil {
		return []string{err.Error()}
	}
	sort.Slice(l.Items, func(i, j int) bool { return l.Items[i].LastTimestamp.Before(&l.Items[j].LastTimestamp) })
	var out []string
	for _, e := range l.Items {
		out = append(out, e.Reason+": "+e.Message)
	}
	return out
}

// WaitUnschedulable waits until the pod is unbound with PodScheduled=False/Unschedulable and a
// message containing every want; it returns the message.
func (c *Cluster) WaitUnschedulable(t testing.TB, name string, want ...string) string {
	t.Helper()
	var msg string
	err := waitFor(time.Minute, 200*time.Millisecond, func() (bool, error) {
		p, err := c.CP.Client.CoreV1().Pods(metav1.NamespaceDefault).Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if p.Spec.NodeName != "" {
			return false, fmt.Errorf("pod %s was bound to %s", name, p.Spec.NodeName)
		}
		for _, cd := range p.Status.Conditions {
			if cd.Type == corev1.PodScheduled && cd.Status == corev1.ConditionFalse && cd.Reason == corev1.PodReasonUnschedulable {
				msg = cd.Message
				for _, w := range want {
					if !strings.Contains(msg, w) {
						return false, fmt.Errorf("pod %s: message %q lacks %q", name, msg, w)
					}
				}
				return true, nil
			}
		}
		return false, fmt.Errorf("pod %s is not marked unschedulable: %+v", name, p.Status.Conditions)
	})
	if err != nil {
		ext := "(the multi-node cluster's replicas: see the control plane's logs)"
		if c.Extender != nil {
			ext = c.Extender.LogTail(20)
		}
		t.Fatalf("%v\n%s\nextender:\n%s", err, c.Describe(t, name), ext)
	}
	return msg
}

// Assignment decodes a pod's tessera.dev/assignment annotation (nil when it has none).
func (c *Cluster) Assignment(t testing.TB, p *corev1.Pod) *api.PodAssignment {
	t.Helper()
	raw, ok := p.Annotations[api.AnnotationAssignment]
	if !ok {
		return nil
	}
	a, err := api.DecodeAssignment([]byte(raw))
	if err != nil {
		t.Fatalf("pod %s: %v", p.Name, err)
	}
	return a
}

// GPU returns the inventory's GPU with this UUID (nil if the node has none).
func (c *Cluster) GPU(uuid string) *api.GPU { return c.Inventory.GPUByUUID(uuid) }

// CreatePod creates a pod in the default namespace.
func (c *Cluster) CreatePod(t testing.TB, p *corev1.Pod) {
	t.Helper()
	if _, err := c.CP.Client.CoreV1().Pods(metav1.NamespaceDefault).Create(context.Background(), p, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create pod %s: %v", p.Name, err)
	}
}

// DeletePods deletes pods of the default namespace with a 1 s grace period and waits until they
// are gone from the API server, which the kubelet allows only once their containers have stopped
// (so tessera-node has released them).
func (c *Cluster) DeletePods(t testing.TB, names ...string) {
	t.Helper()
	ctx := context.Background()
	grace := int64(1)
	for _, n := range names {
		err := c.CP.Client.CoreV1().Pods(metav1.NamespaceDefault).Delete(ctx, n, metav1.DeleteOptions{GracePeriodSeconds: &grace})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Fatalf("delete pod %s: %v", n, err)
		}
	}
	for _, n := range names {
		err := waitFor(2*time.Minute, 200*time.Millisecond, func() (bool, error) {
			_, err := c.CP.Client.CoreV1().Pods(metav1.NamespaceDefault).Get(ctx, n, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				return true, nil
			}
			return false, fmt.Errorf("pod %s still exists (%v)", n, err)
		})
		if err != nil {
			t.Fatalf("%v\n%s", err, c.Describe(t, n))
		}
	}
}

// DeleteAllPods deletes every pod of the default namespace and waits until they are gone.
func (c *Cluster) DeleteAllPods(t testing.TB) {
	t.Helper()
	l, err := c.CP.Client.CoreV1().Pods(metav1.NamespaceDefault).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, p := range l.Items {
		names = append(names, p.Name)
	}
	c.DeletePods(t, names...)
}

// Reset deletes every pod of the default namespace and waits until tessera-node holds nothing and
// the Node offers every GPU again, whole and in shares.
func (c *Cluster) Reset(t testing.TB) {
	t.Helper()
	c.DeleteAllPods(t)
	c.WaitLedgerEmpty(t)
	c.WaitAllocatable(t, map[string]int64{api.ResourceGPU: SimWholeGPUs, api.ResourceShare: SimShares})
}

// ContainerID returns the CRI id of a pod's running container (crictl), "" when there is none.
func (c *Cluster) ContainerID(t testing.TB, pod, container string) string {
	t.Helper()
	out, err := c.Ctr.Crictl(t, "ps", "-q", "--state", "running", "--name", "^"+container+"$", "--label", "io.kubernetes.pod.name="+pod)
	if err != nil {
		t.Fatalf("crictl ps: %v\n%s", err, out)
	}
	return strings.TrimSpace(out)
}

// Ledger returns the raw ledger file of tessera-node.
func (c *Cluster) Ledger(t testing.TB) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(c.AgentDataDir, "ledger.json"))
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return string(b)
}

// LedgerEntries decodes the ledger file.
func (c *Cluster) LedgerEntries(t testing.TB) []*ledger.Entry {
	t.Helper()
	raw := c.Ledger(t)
	if raw == "" {
		return nil
	}
	var f struct {
		Entries []*ledger.Entry `json:"entries"`
	}
	if err := json.Unmarshal([]byte(raw), &f); err != nil {
		t.Fatalf("ledger: %v\n%s", err, raw)
	}
	return f.Entries
}

// Metrics returns tessera-node's /metrics text.
func (c *Cluster) Metrics(t testing.TB) string {
	t.Helper()
	hc := &http.Client{Timeout: 5 * time.Second}
	resp, err := hc.Get("http://" + c.AgentAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// WaitLedgerEmpty waits until tessera-node holds no ledger entry.
func (c *Cluster) WaitLedgerEmpty(t testing.TB) {
	t.Helper()
	err := waitFor(time.Minute, 200*time.Millisecond, func() (bool, error) {
		return strings.Contains(c.Metrics(t), "\ntessera_ledger_entries 0\n"), nil
	})
	if err != nil {
		t.Fatalf("tessera-node's ledger is not empty: %v\n%s\n%s", err, c.Ledger(t), c.AgentLogTail(t, 20))
	}
}

// RestartContainerd stops containerd and starts it again (containers keep running in their
// shims), then waits until tessera-node's NRI plugin has reconnected and the Node is Ready.
func (c *Cluster) RestartContainerd(t *testing.T) {
	t.Helper()
	c.Ctr.Stop(t)
	c.Ctr.Start(t)
	c.WaitAgentReady(t)
	c.Kubelet.WaitReady(t)
}

// TestPod is a host-network busybox pod with one container "main" that sleeps, asking for these
// limits (resource name -> quantity), with a 1 s grace period.
func TestPod(name string, limits map[string]string, annotations map[string]string) *corev1.Pod {
	lim := corev1.ResourceList{}
	for k, v := range limits {
		lim[corev1.ResourceName(k)] = resource.MustParse(v)
	}
	grace, no := int64(1), false
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: metav1.NamespaceDefault, Annotations: annotations},
		Spec: corev1.PodSpec{
			HostNetwork:                   true,
			RestartPolicy:                 corev1.RestartPolicyNever,
			TerminationGracePeriodSeconds: &grace,
			AutomountServiceAccountToken:  &no,
			Containers: []corev1.Container{{
				Name: "main", Image: "docker.io/library/bbox:latest", ImagePullPolicy: corev1.PullNever,
				Command:   []string{"sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"},
				Resources: corev1.ResourceRequirements{Limits: lim},
			}},
		},
	}
}

// teardown stops the node side before the control plane's cleanup (which logs every component's
// log tail when the test failed): the kubelet first (so it
// recreates nothing), then every pod sandbox through CRI (tessera-node sees them go), then the agent
// and the extender; it unmounts what the kubelet mounted and removes the device-plugin sockets.
func (c *Cluster) teardown(t *testing.T) {
	if c.Kubelet != nil {
		c.Kubelet.Stop(t)
	}
	if c.Ctr != nil && c.Ctr.cmd != nil {
		if out, err := c.Ctr.Crictl(t, "rmp", "-af"); err != nil {
			t.Logf("crictl rmp -af: %v\n%s", err, out)
		}
	}
	for _, p := range []*Process{c.Agent, c.Extender} {
		if p != nil {
			p.Stop(t)
		}
	}
	if c.Kubelet != nil {
		for _, m := range mountsUnder(c.Kubelet.RootDir) {
			syscall.Unmount(m, syscall.MNT_DETACH)
		}
		syscall.Unmount(c.Kubelet.RootDir, syscall.MNT_DETACH)
		if left := mountsUnder(c.Kubelet.RootDir); len(left) > 0 {
			t.Errorf("mounts left under the kubelet's root dir: %v", left)
		}
	}
	// Sockets the kubelet and the agent made in the hard-coded directory (the directory itself
	// goes with the host release when this run created it). Only a cluster holding the host's
	// kubelet paths owns them: a multi-node cluster's nodes have that path in their own mount
	// namespaces (their directories go with their own cleanup), and removing the host's files from
	// here deleted the kubelet.sock of a single-node cluster running beside them.
	if c.host == nil {
		return
	}
	for _, pat := range []string{"kubelet.sock", "kubelet_internal_checkpoint", "tessera*.sock"} {
		m, _ := filepath.Glob(filepath.Join(KubeletDevicePluginDir, pat))
		for _, f := range m {
			os.Remove(f)
		}
	}
}

// runStdin runs a command with stdin and a timeout and returns its combined output.
func runStdin(t testing.TB, timeout time.Duration, stdin, name string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stdin = strings.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// runEnv runs a command with extra environment variables and a timeout and returns its combined output.
func runEnv(t testing.TB, timeout time.Duration, env []string, name string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// quietTB lets a helper that may call Fatalf run off the test's goroutine (where FailNow must not
// be called): it only records the failure.
type quietTB struct {
	testing.TB
	failed string
}

func (q *quietTB) Fatalf(format string, args ...any) { q.failed = fmt.Sprintf(format, args...) }
