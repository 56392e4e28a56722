package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// Nodes of the multi-node cluster: two simulated GPU nodes of different models and a CPU-only one.
const (
	NodeA100 = "gpu-a100" // tessera-node --node-description=dgx-a100
	NodeH100 = "gpu-h100" // tessera-node --node-description=dgx-h100; containerd as operators run it (Containerd.Stock)
	NodeCPU  = "cpu-only" // kubelet and containerd, no tessera-node
)

// The drills see a node agent go stale within seconds rather than the chart's minutes: the agents
// renew their heartbeat every multiNodeHeartbeat and the extenders refuse a node whose heartbeat is
// older than multiNodeMaxAge.
const (
	multiNodeHeartbeat = 5 * time.Second
	multiNodeMaxAge    = 20 * time.Second
	// multiNodeHealthCheck is the agents' health-check interval (the chart's default is 30 s): a GPU
	// that stops raising XIDs is healthy again one quiet interval later, so the XID drill's recovery
	// takes seconds.
	multiNodeHealthCheck = 5 * time.Second
)

// MultiNode is a three-node Kubernetes cluster on this machine: one control plane (etcd,
// kube-apiserver, kube-scheduler wired to the extender as the chart configures it,
// kube-controller-manager), two tessera-extender replicas sharing the extender port (SO_REUSEPORT,
// leader election, non-leaders pass binds on to the leader, as the chart runs them), and three
// nodes, each a real kubelet with its own containerd, runc root, kubelet root and device-plugin
// directory, and on the two GPU nodes tessera-node with its own simulated GPUs, data and run dirs.
//
// The nodes share the host's network (every port picked free) and differ by mount namespace: the
// kubelet hard-codes /var/lib/kubelet/device-plugins, so each node's kubelet, containerd and
// tessera-node run in a private mount namespace where the node's own directory is bind-mounted
// there (and where the agent's per-container mounts are seen by that node's runc). That costs no
// process per node beyond a sleeping holder, unlike network namespaces, which would need a bridge,
// addresses and routing for the API server and kubelets on 2 cores. The mounts a node's kubelet and
// containerd make stay in its namespace and go with it.
//
// Tessera is installed by the chart (MultiNodeOptions.Chart, multinode_chart.go: the agent's
// DaemonSet on the GPU nodes, the extender's Deployment), or runs as host processes, as in the
// one-node Cluster.
type MultiNode struct {
	CP *ControlPlane
	// ExtenderAddr is the port both replicas serve the scheduler on.
	ExtenderAddr string
	// Extenders are the host-process replicas (none with the chart: its Deployment's pods).
	Extenders []*Process
	// Nodes by name; each is a Cluster sharing CP (its Extender is nil: see Extenders; with the
	// chart its Agent is nil too, the agent being the DaemonSet's pod on it).
	Nodes map[string]*Cluster

	chart bool
	helm  *helmHost // the chart's install (values, the scheduler's TLS), nil without the chart
}

// MultiNodeOptions tunes StartMultiNode.
type MultiNodeOptions struct {
	// Chart installs Tessera with deploy/helm/tessera from the images `make images` builds.
	Chart bool
}

// StartMultiNode brings the cluster up: the control plane, both extender replicas, then each node
// until it is Ready and, on the GPU nodes, tessera-node has registered its device plugins and
// published its inventory.
func StartMultiNode(t *testing.T, opts MultiNodeOptions) *MultiNode {
	t.Helper()
	if opts.Chart {
		return startMultiNodeChart(t)
	}
	t0 := time.Now()
	step := func(what string) { t.Logf("multinode: %s (%.1fs)", what, time.Since(t0).Seconds()) }
	// No host path is shared (startMountNS), so unlike a one-node Cluster this one does not take
	// the host's kubelet paths (lockKubeletHost): it runs beside other clusters.
	built := make(chan struct{})
	go func() {
		defer close(built)
		tesseraBinary(&quietTB{TB: t}, "tessera-node")
		tesseraBinary(&quietTB{TB: t}, "tessera-extender")
	}()
	m := &MultiNode{Nodes: map[string]*Cluster{}}
	m.ExtenderAddr = fmt.Sprintf("127.0.0.1:%d", freePort(t))
	m.CP = StartControlPlane(t, ControlPlaneOptions{Extender: chartExtender(t, "http://"+m.ExtenderAddr), ControllerManager: true})
	step("control plane up")
	<-built
	for i := range 2 {
		id := fmt.Sprintf("tessera-extender-%d", i)
		m.Extenders = append(m.Extenders, startExtenderReplica(t, m.CP, api.PolicyTessera, multiNodeMaxAge, id,
			"--listen", m.ExtenderAddr, "--identity", id, "--leader-elect=true", "--reuse-port=true",
			"--peer-listen=127.0.0.1:0", "--advertise-url=http://127.0.0.1:0"))
	}
	for _, x := range m.Extenders {
		x.WaitHealthy(t, "http://"+m.ExtenderAddr+"/healthz", time.Minute)
	}
	step("two tessera-extender replicas up")
	driver := BuildSimDriver(t)
	for _, n := range []struct {
		name, description string
		gpu, stock        bool
	}{{NodeA100, "dgx-a100", true, false}, {NodeH100, "dgx-h100", true, true}, {NodeCPU, "", false, false}} {
		c := m.joinNode(t, n.name, n.description, n.stock)
		if n.gpu {
			c.dra = true
			c.agentArgs = []string{"--rediscover-interval=" + multiNodeHeartbeat.String(), "--health-check-interval=" + multiNodeHealthCheck.String()}
			c.startAgent(t, driver)
			c.WaitAgentReady(t)
		}
		m.Nodes[n.name] = c
		step("node " + n.name + " up")
	}
	return m
}

// joinNode starts one node in its own mount namespace: containerd (with its stock configuration
// when stock), then the kubelet (with kubeletArgs), registered as name with the control plane.
func (m *MultiNode) joinNode(t *testing.T, name, description string, stock bool, kubeletArgs ...string) *Cluster {
	t.Helper()
	dpDir, err := os.MkdirTemp("/tmp", "tsr-dp-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dpDir) })
	ns := startMountNS(t, dpDir)
	c := &Cluster{Node: name, CP: m.CP, Kubeconfig: m.CP.Kubeconfig, ExtenderAddr: m.ExtenderAddr, description: description}
	c.Ctr = startContainerd(t, ns, stock)
	c.Dir = c.Ctr.Base
	// Registered after containerd's cleanup, so it runs first: kubelet, pods, agent, then containerd.
	t.Cleanup(func() { c.teardown(t) })
	c.Kubelet = startKubelet(t, m.CP, c.Ctr, name, "kubelet-"+name, kubeletArgs...)
	return c
}

// startMountNS starts a process holding a private mount namespace in which dpDir is mounted on
// KubeletDevicePluginDir, and returns the namespace's path for nsenter. /var/lib and /var/log are
// empty tmpfs there (the kubelet's hard-coded paths below them are then the node's own, and the
// host's need not exist: nothing else there is used, every other directory being given by flag).
// The test's cleanup ends the holder; the namespace goes when the last process in it has exited.
func startMountNS(t *testing.T, dpDir string) string {
	t.Helper()
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Fatalf("a multi-node cluster needs unshare (util-linux): %v", err)
	}
	cmd := exec.Command(unshare, "--mount", "--propagation", "private", "--", "sh", "-c",
		`mount -t tmpfs -o size=16m,mode=0755 tsr-node /var/lib && mount -t tmpfs -o size=64m,mode=0755 tsr-node /var/log &&
		mkdir -p "$1" && mount --bind "$0" "$1" && exec sleep 2147483647`, dpDir, KubeletDevicePluginDir)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start the mount namespace holder: %v", err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-exited })
	pid := cmd.Process.Pid
	err = waitFor(10*time.Second, 20*time.Millisecond, func() (bool, error) {
		select {
		case <-exited:
			return false, fmt.Errorf("holder exited: %s", out.String())
		default:
		}
		mi, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
		if err != nil {
			return false, err
		}
		return strings.Contains(string(mi), " "+KubeletDevicePluginDir+" "), fmt.Errorf("%s not mounted yet", KubeletDevicePluginDir)
	})
	if err != nil {
		t.Fatalf("mount namespace for %s: %v", dpDir, err)
	}
	return fmt.Sprintf("/proc/%d/ns/mnt", pid)
}

// inMountNS is the command line running bin with args in the mount namespace ns (nsenter execs
// bin, so the process is bin itself); with ns "" it is bin and args unchanged.
func inMountNS(t testing.TB, ns, bin string, args ...string) []string {
	t.Helper()
	if ns == "" {
		return append([]string{bin}, args...)
	}
	nsenter, err := exec.LookPath("nsenter")
	if err != nil {
		t.Fatalf("a multi-node cluster needs nsenter (util-linux): %v", err)
	}
	return append([]string{nsenter, "--mount=" + ns, "--", bin}, args...)
}

// Node returns the named node.
func (m *MultiNode) Node(t testing.TB, name string) *Cluster {
	t.Helper()
	c, ok := m.Nodes[name]
	if !ok {
		t.Fatalf("no node %s in the multi-node cluster", name)
	}
	return c
}

// KillNode ends the node at once, as a power loss would: SIGKILL to every process of its mount
// namespace (kubelet, containerd, the shims, tessera-node) and to every container's processes
// (they run in mount namespaces of their own; the chart's agent is one). What is on its disk stays,
// as does the namespace's holder (the machine, with its mounts), so RestartNode can boot it again.
func (m *MultiNode) KillNode(t testing.TB, name string) {
	t.Helper()
	c := m.Node(t, name)
	var pids []int
	// Containers and pod sandboxes (their pause processes): each one's init, in its own namespaces.
	for _, kind := range [][3]string{{"ps", "running", "inspect"}, {"pods", "ready", "inspectp"}} {
		ids, err := c.Ctr.Crictl(t, kind[0], "-q", "--state", kind[1])
		if err != nil {
			t.Fatalf("crictl %s on %s: %v\n%s", kind[0], name, err, ids)
		}
		for _, id := range strings.Fields(ids) {
			out, err := c.Ctr.Crictl(t, kind[2], "-o", "go-template", "--template", "{{.info.pid}}", id)
			var pid int
			if _, serr := fmt.Sscanf(strings.TrimSpace(out), "%d", &pid); err != nil || serr != nil || pid <= 0 {
				t.Fatalf("pid of %s on %s: %v %v\n%s", id, name, err, serr, out)
			}
			pids = append(pids, pid)
		}
	}
	inNS, err := pidsInMountNS(c.Ctr.MountNS)
	if err != nil {
		t.Fatal(err)
	}
	pids = append(pids, inNS...)
	for _, pid := range pids {
		syscall.Kill(pid, syscall.SIGKILL)
	}
	// Reap what the test started; the signals above already ended them.
	c.Kubelet.Kill(t)
	if c.Agent != nil {
		c.Agent.Kill(t)
	}
	c.Ctr.Stop(t)
	t.Logf("node %s killed: %d processes", name, len(pids))
}

// pidsInMountNS lists the processes in the node's mount namespace ns (inMountNS's path) but its
// holder (startMountNS): the node's kubelet, containerd, shims and tessera-node.
func pidsInMountNS(ns string) ([]int, error) {
	target, err := os.Readlink(ns)
	if err != nil {
		return nil, fmt.Errorf("the node's mount namespace: %w", err)
	}
	holder := filepath.Base(filepath.Dir(filepath.Dir(ns)))
	var pids []int
	links, _ := filepath.Glob("/proc/[0-9]*/ns/mnt")
	for _, l := range links {
		pid := filepath.Base(filepath.Dir(filepath.Dir(l)))
		if got, err := os.Readlink(l); err == nil && got == target && pid != holder {
			var n int
			fmt.Sscanf(pid, "%d", &n)
			pids = append(pids, n)
		}
	}
	return pids, nil
}

// RestartNode boots a killed node again: containerd, the kubelet (until Ready), tessera-node
// (until it has published its inventory): the host process, or the agent pod, which the kubelet
// starts again as it finds it bound to its node.
func (m *MultiNode) RestartNode(t testing.TB, name string) {
	t.Helper()
	c := m.Node(t, name)
	c.Ctr.Start(t)
	c.Kubelet.Start(t)
	c.Kubelet.WaitReady(t)
	if c.Agent != nil {
		c.Agent.Start(t)
	}
	c.WaitAgentReady(t)
}
