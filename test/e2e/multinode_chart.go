package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/tessera-gpu/tessera/internal/gpu"
)

// The chart's install in the multi-node cluster: one release, as an operator installs it on a
// cluster of GPU and CPU nodes.
const (
	chartRelease = "tessera"
	// gpuNodeLabel is the chart's default node.nodeSelector: the DaemonSet runs where it is.
	gpuNodeLabel = "nvidia.com/gpu.present"
	// Paths the one DaemonSet gives every node's agent, each the node's own in its mount
	// namespace (chartNodeMounts). CDI specs go to /var/run/cdi, one of containerd 2.x's default
	// spec dirs (the harness's containerd reads the same directory there); libDir is below /var/lib,
	// the node's own, since the host's /usr/local/lib is not; the simulated node is a file there.
	chartCDIDir         = "/var/run/cdi"
	chartLibDir         = "/var/lib/tessera-lib"
	chartSimDescription = "/var/lib/tessera-sim-node.yaml"
	chartRunDir         = "/run/tessera" // the chart's default
	chartDataDir        = "/var/lib/tessera"
	chartKubeletDir     = "/var/lib/kubelet"
	chartDefaultNRI     = "/var/run/nri/nri.sock"
	chartDefaultCRI     = "/run/containerd/containerd.sock"
	chartAgentContainer = "tessera-node"
)

// nodeAddresses are the nodes' own IP addresses (kubelet --node-ip), added to lo for the cluster's
// life. The agents listen on their pod's IP (the chart's default under hostNetwork: the node's
// InternalIP), so on one host each needs an address of its own, as each machine has. The kubelet
// refuses a loopback --node-ip, hence TEST-NET-2 (RFC 5737, never routed) rather than 127.0.0.x.
var nodeAddresses = map[string]string{NodeA100: "198.51.100.11", NodeH100: "198.51.100.12", NodeCPU: "198.51.100.13"}

// addNodeAddress puts ip on lo until the test ends.
func addNodeAddress(t *testing.T, ip string) {
	t.Helper()
	ipTool, err := exec.LookPath("ip")
	if err != nil {
		t.Fatalf("a multi-node cluster gives each node an address of its own with ip (iproute2): %v", err)
	}
	// replace: an address a killed run left behind is taken over, not an error.
	mustRun(t, time.Minute, ipTool, "addr", "replace", ip+"/32", "dev", "lo")
	t.Cleanup(func() { runCmd(t, time.Minute, ipTool, "addr", "del", ip+"/32", "dev", "lo") })
}

// chartNodeMounts makes the chart's paths for the agent the GPU node's own in its mount
// namespace, where its kubelet and containerd (and so the agent pod's hostPath volumes) resolve
// them, and points the node's Cluster at where this host reads them:
//   - dataDir (the ledger) and libDir bound to directories in the node's Dir;
//   - the kubelet's pod-resources and DRA plugin directories bound to those under its --root-dir
//     (device-plugins already is, startMountNS);
//   - runDir a tmpfs of the node's own, shared (the agent mounts each share's region there,
//     Bidirectional), read through the namespace (/proc/<holder>/root);
//   - the simulated node's description file (node.simDescription), the node's GPUs.
func (m *MultiNode) chartNodeMounts(t *testing.T, c *Cluster) {
	t.Helper()
	desc, ok := gpu.BuiltinDescriptions[c.description]
	if !ok {
		t.Fatalf("node %s: no built-in simulated node %q", c.Node, c.description)
	}
	src := filepath.Join(c.Dir, "sim-node.yaml")
	if err := os.WriteFile(src, []byte(desc), 0o644); err != nil {
		t.Fatal(err)
	}
	kr := c.Kubelet.RootDir
	binds := [][2]string{{filepath.Join(c.Dir, "tessera-data"), chartDataDir}, {filepath.Join(c.Dir, "tessera-lib"), chartLibDir},
		{filepath.Join(kr, "pod-resources"), chartKubeletDir + "/pod-resources"},
		{filepath.Join(kr, "plugins_registry"), chartKubeletDir + "/plugins_registry"},
		{filepath.Join(kr, "plugins"), chartKubeletDir + "/plugins"}}
	script := []string{"set -e"}
	for _, b := range binds {
		if err := os.MkdirAll(b[0], 0o755); err != nil {
			t.Fatal(err)
		}
		script = append(script, fmt.Sprintf("mkdir -p %[2]s && mount --bind %[1]s %[2]s", b[0], b[1]))
	}
	script = append(script,
		fmt.Sprintf("mkdir -p %[1]s && mount -t tmpfs -o size=64m,mode=0755 tsr-tessera-run %[1]s && mount --make-shared %[1]s", chartRunDir),
		fmt.Sprintf("cp %s %s", src, chartSimDescription))
	argv := inMountNS(t, c.Ctr.MountNS, "/bin/sh", "-c", strings.Join(script, "\n"))
	mustRun(t, time.Minute, argv[0], argv[1:]...)
	c.AgentDataDir = binds[0][0]
	c.simStateDir = filepath.Join(nodeRoot(c), chartRunDir, "sim")
	c.agentPod = func(t testing.TB) (string, []string) { return m.agentPod(t, c) }
}

// nodeRoot is where this host sees the node's root directory: through its namespace holder.
func nodeRoot(c *Cluster) string {
	return filepath.Join(filepath.Dir(filepath.Dir(c.Ctr.MountNS)), "root")
}

// agentPod returns the name of the tessera-node pod on the node (the newest, when one is being
// replaced) and its container's log files under the kubelet's pod log dir, oldest first.
func (m *MultiNode) agentPod(t testing.TB, c *Cluster) (string, []string) {
	t.Helper()
	p := m.agentPodObject(t, c.Node)
	if p == nil {
		return "", nil
	}
	logs, _ := filepath.Glob(filepath.Join(c.Dir, "pod-logs", fmt.Sprintf("%s_%s_%s", p.Namespace, p.Name, p.UID), chartAgentContainer, "*.log"))
	slices.SortFunc(logs, func(a, b string) int { return logRestart(a) - logRestart(b) })
	return p.Name, logs
}

// logRestart is the restart count a container log file is named for (<n>.log).
func logRestart(path string) int {
	n, _ := strconv.Atoi(strings.TrimSuffix(filepath.Base(path), ".log"))
	return n
}

// agentPodObject returns the newest tessera-node pod bound to node, nil when there is none.
func (m *MultiNode) agentPodObject(t testing.TB, node string) *corev1.Pod {
	t.Helper()
	l, err := m.CP.Client.CoreV1().Pods(chartNamespace).List(context.Background(), metav1.ListOptions{
		LabelSelector: chartAgentSelector, FieldSelector: "spec.nodeName=" + node})
	if err != nil {
		t.Fatal(err)
	}
	var newest *corev1.Pod
	for i := range l.Items {
		if newest == nil || l.Items[i].CreationTimestamp.After(newest.CreationTimestamp.Time) {
			newest = &l.Items[i]
		}
	}
	return newest
}

// labelGPU puts the chart's node.nodeSelector label on the node (the DaemonSet starts an agent
// pod there) or takes it off (the DaemonSet deletes the pod), as an operator would.
func (m *MultiNode) labelGPU(t testing.TB, node string, on bool) {
	t.Helper()
	v := `"true"`
	if !on {
		v = "null"
	}
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%s}}}`, gpuNodeLabel, v)
	if _, err := m.CP.Client.CoreV1().Nodes().Patch(context.Background(), node, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatalf("label %s %s=%v: %v", node, gpuNodeLabel, on, err)
	}
}

// StopAgent stops the node's tessera-node as an operator would: the node's label taken off, so
// the DaemonSet deletes its pod; it waits until the pod is gone.
func (m *MultiNode) StopAgent(t *testing.T, node string) {
	t.Helper()
	m.labelGPU(t, node, false)
	err := waitFor(2*time.Minute, 200*time.Millisecond, func() (bool, error) {
		p := m.agentPodObject(t, node)
		return p == nil, fmt.Errorf("the agent pod on %s is still there", node)
	})
	if err != nil {
		t.Fatalf("%v\n%s", err, m.helm.diagnose(t, chartNamespace))
	}
}

// StartAgent starts the node's tessera-node again (the label put back: a new agent pod) and waits
// until it serves and has published its inventory.
func (m *MultiNode) StartAgent(t testing.TB, node string) {
	t.Helper()
	m.labelGPU(t, node, true)
	m.Node(t, node).WaitAgentReady(t)
}

// RestartAgentPod deletes the node's agent pod; the DaemonSet starts a new one, which this waits
// for (serving, its inventory published).
func (m *MultiNode) RestartAgentPod(t testing.TB, node string) {
	t.Helper()
	m.replaceAgentPod(t, node)
	m.Node(t, node).WaitAgentReady(t)
}

// replaceAgentPod deletes the node's agent pod and waits until the DaemonSet's new one runs.
func (m *MultiNode) replaceAgentPod(t testing.TB, node string) {
	t.Helper()
	old := m.agentPodObject(t, node)
	if old == nil {
		t.Fatalf("no agent pod on %s", node)
	}
	if err := m.CP.Client.CoreV1().Pods(chartNamespace).Delete(context.Background(), old.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	err := waitFor(2*time.Minute, 200*time.Millisecond, func() (bool, error) {
		p := m.agentPodObject(t, node)
		if p == nil || p.UID == old.UID {
			return false, fmt.Errorf("no new agent pod on %s yet", node)
		}
		return p.Status.Phase == corev1.PodRunning, fmt.Errorf("the new agent pod %s is %s", p.Name, p.Status.Phase)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// agentArgs are the arguments of the node's agent pod's tessera-node.
func (m *MultiNode) agentArgs(t testing.TB, node string) []string {
	t.Helper()
	p := m.agentPodObject(t, node)
	if p == nil {
		t.Fatalf("no agent pod on %s", node)
	}
	for _, ctr := range p.Spec.Containers {
		if ctr.Name == chartAgentContainer {
			return ctr.Args
		}
	}
	t.Fatalf("agent pod %s has no container %s", p.Name, chartAgentContainer)
	return nil
}

// leaseHolder is the extenders' leader Lease holder, "<identity>@<advertised URL>" ("" when none),
// in the release namespace.
func (m *MultiNode) leaseHolder(t testing.TB) string {
	t.Helper()
	l, err := m.CP.Client.CoordinationV1().Leases(chartNamespace).Get(context.Background(), "tessera-extender", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the extenders' leader Lease: %v", err)
	}
	if l.Spec.HolderIdentity == nil {
		return ""
	}
	return *l.Spec.HolderIdentity
}

// killLeader SIGKILLs the process of the extender replica holding the leader Lease, as a crash
// would, and returns the Lease's holder at the kill. The kubelet restarts the container in its pod;
// the test's cleanup waits until the Deployment has its 2 replicas ready again.
func (m *MultiNode) killLeader(t *testing.T) string {
	t.Helper()
	holder := m.leaseHolder(t)
	id, _, _ := strings.Cut(holder, "@") // the identity is the pod's name
	c := m.Node(t, NodeCPU)
	ids, err := c.Ctr.Crictl(t, "ps", "-q", "--state", "running", "--name", "^tessera-extender$", "--label", "io.kubernetes.pod.name="+id)
	if err != nil || len(strings.Fields(ids)) != 1 {
		t.Fatalf("the leader's container (pod %s) on %s: %v\n%s", id, NodeCPU, err, ids)
	}
	out, err := c.Ctr.Crictl(t, "inspect", "-o", "go-template", "--template", "{{.info.pid}}", strings.TrimSpace(ids))
	pid, serr := strconv.Atoi(strings.TrimSpace(out))
	if err != nil || serr != nil || pid <= 0 {
		t.Fatalf("pid of the leader %s: %v %v\n%s", id, err, serr, out)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill the leader %s (pid %d): %v", id, pid, err)
	}
	t.Cleanup(func() {
		err := waitFor(2*time.Minute, 300*time.Millisecond, func() (bool, error) {
			d, err := m.CP.Client.AppsV1().Deployments(chartNamespace).Get(context.Background(), chartRelease+"-extender", metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			return d.Status.ReadyReplicas == 2, fmt.Errorf("%d extender replicas ready", d.Status.ReadyReplicas)
		})
		if err != nil {
			t.Errorf("after the leader kill: %v\n%s", err, m.helm.diagnose(t, chartNamespace))
		}
	})
	return holder
}
