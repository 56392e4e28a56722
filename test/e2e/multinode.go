package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Nodes of the multi-node cluster: two simulated GPU nodes of different models and a CPU-only one.
const (
	NodeA100 = "gpu-a100" // the agent simulates dgx-a100 (node.simDescription)
	NodeH100 = "gpu-h100" // the agent simulates dgx-h100; containerd as operators run it (Containerd.Stock)
	NodeCPU  = "cpu-only" // kubelet and containerd, no tessera-node; the extender replicas
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
// kube-apiserver, kube-scheduler running the chart's configuration, kube-controller-manager), three
// nodes, each a real kubelet with its own containerd, runc root, kubelet root and device-plugin
// directory, and Tessera installed by the chart (multinode_chart.go): tessera-node's DaemonSet on
// the two GPU nodes, each agent with its own simulated GPUs, data and run dirs, and two
// tessera-extender replicas sharing the extender port (SO_REUSEPORT, leader election, non-leaders
// pass binds on to the leader).
//
// The nodes share the host's network (every port picked free; each node has an address of its own
// on lo, nodeAddresses) and differ by mount namespace: the kubelet hard-codes
// /var/lib/kubelet/device-plugins, and the chart's one DaemonSet names the same host paths on
// every node, so each node's kubelet and containerd (and so its pods' hostPath volumes) run in a
// private mount namespace where the node's own directories are bind-mounted there (and where the
// agent's per-container mounts are seen by that node's runc). That costs no process per node
// beyond a sleeping holder, unlike network namespaces, which would need a bridge, addresses and
// routing for the API server and kubelets on 2 cores. The mounts a node's kubelet and containerd
// make stay in its namespace and go with it.
type MultiNode struct {
	CP *ControlPlane
	// ExtenderAddr is the port both replicas serve the scheduler on.
	ExtenderAddr string
	// Nodes by name; each is a Cluster sharing CP, its Agent and Extender nil (the agent is the
	// DaemonSet's pod on it, the extenders the Deployment's pods on the CPU node).
	Nodes map[string]*Cluster

	helm *helmHost // the chart's install: its values, the scheduler's TLS
}

// StartMultiNode brings the cluster up: the control plane, the nodes until each is Ready, then
// Tessera installed by deploy/helm/tessera from the images `make images` builds: the agent's
// DaemonSet on the two GPU nodes (labelled as the GPU Operator labels them; the CPU node is not),
// the extender's Deployment of 2 replicas on the CPU node, both on the host network, kube-scheduler
// a host process running the chart's configuration (TestHelmInstall explains each of these for a
// machine without CNI, registry or DNS), until each agent serves and has published its inventory.
func StartMultiNode(t *testing.T) *MultiNode {
	t.Helper()
	t0 := time.Now()
	step := func(what string) { t.Logf("multinode: %s (%.1fs)", what, time.Since(t0).Seconds()) }
	var images []string
	q := &quietTB{TB: t}
	built := make(chan struct{})
	go func() { defer close(built); images = buildImages(q) }()
	m := &MultiNode{Nodes: map[string]*Cluster{}}
	m.CP = StartControlPlane(t, ControlPlaneOptions{NoScheduler: true, ControllerManager: true})
	m.CP.CreateNamespace(t, chartNamespace)
	step("control plane up")
	BuildSimDriver(t) // the test image's cudaprobe
	for _, n := range []struct {
		name, description string
		gpu, stock        bool
	}{{NodeA100, "dgx-a100", true, false}, {NodeH100, "dgx-h100", true, true}, {NodeCPU, "", false, false}} {
		addNodeAddress(t, nodeAddresses[n.name])
		c := m.joinNode(t, n.name, n.description, n.stock, "--node-ip="+nodeAddresses[n.name])
		if n.gpu {
			m.chartNodeMounts(t, c)
		}
		m.Nodes[n.name] = c
		step("node " + n.name + " up")
	}
	<-built
	if q.failed != "" {
		t.Fatal(q.failed)
	}
	for name, c := range m.Nodes {
		img := images[1] // tessera-extender: the CPU node runs the replicas
		if name != NodeCPU {
			img = images[0]
		}
		mustRun(t, 2*time.Minute, tool(t, "ctr"), "-a", c.Ctr.Socket, "-n", "k8s.io", "images", "import", img)
	}
	for _, n := range []string{NodeA100, NodeH100} {
		m.labelGPU(t, n, true)
	}
	step("images imported, GPU nodes labelled")

	cpu := m.Nodes[NodeCPU]
	h := &helmHost{c: cpu, chart: helmChart(), tlsDir: filepath.Join(m.CP.Dir, "scheduler-tls"),
		extenderPort: freePort(t), extenderMetrics: freePort(t), agentMetrics: freePort(t)}
	h.extenderAddr = fmt.Sprintf("127.0.0.1:%d", h.extenderPort)
	m.ExtenderAddr = h.extenderAddr
	apiPort, err := urlPort(m.CP.APIServerURL)
	if err != nil {
		t.Fatal(err)
	}
	h.set = map[string]string{
		"image.node.tag": "e2e", "image.extender.tag": "e2e", "image.pullPolicy": "Never",
		"apiServer.host": "127.0.0.1", "apiServer.port": apiPort,
		// The agent: listenHost left empty, so each listens on its node's own address.
		"node.backend": "sim", "node.metricsPort": strconv.Itoa(h.agentMetrics),
		"node.cdiDir": chartCDIDir, "node.libDir": chartLibDir, "node.simDescription": chartSimDescription,
		// The drills see an agent go stale, and a GPU heal, within seconds (multiNodeHeartbeat).
		"node.extraArgs[0]":    "--rediscover-interval=" + multiNodeHeartbeat.String(),
		"node.extraArgs[1]":    "--health-check-interval=" + multiNodeHealthCheck.String(),
		"extender.hostNetwork": "true", "extender.listenHost": "127.0.0.1",
		"extender.port": strconv.Itoa(h.extenderPort), "extender.metricsPort": strconv.Itoa(h.extenderMetrics),
		"extender.inventoryMaxAge":                      multiNodeMaxAge.String(),
		`extender.nodeSelector.kubernetes\.io/hostname`: NodeCPU,
		"scheduler.mode":                                "default", "scheduler.extenderURL": "https://" + h.extenderAddr, "scheduler.tls.dir": h.tlsDir,
		"extender.networkPolicy.extraFrom[0].ipBlock.cidr": "127.0.0.1/32",
	}
	m.helm = h
	for _, n := range []string{NodeA100, NodeH100} {
		m.Nodes[n].AgentAddr = fmt.Sprintf("%s:%d", nodeAddresses[n], h.agentMetrics)
	}
	h.preloadTLS(t, cpu, chartNamespace, chartRelease)
	h.startScheduler(t, cpu, chartNamespace, chartRelease)
	step("kube-scheduler running the chart's configuration")
	h.run(t, chartNamespace, "install", chartRelease, h.chart, "--wait", "--timeout", "150s")
	step("helm install --wait done")
	for _, n := range []string{NodeA100, NodeH100} {
		c := m.Nodes[n]
		c.WaitAgentReady(t)
		step("agent on " + n + " serving")
	}
	m.checkPlacement(t)
	return m
}

// checkPlacement: the chart's workloads run where the install put them: one agent pod on each
// labelled GPU node and none on the CPU node (the DaemonSet's nodeSelector), both extender
// replicas on the CPU node (extender.nodeSelector).
func (m *MultiNode) checkPlacement(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	ds, err := m.CP.Client.AppsV1().DaemonSets(chartNamespace).Get(ctx, chartRelease+"-node", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if ds.Status.DesiredNumberScheduled != 2 || m.agentPodObject(t, NodeCPU) != nil {
		t.Errorf("the agent's DaemonSet wants %d pods (an agent pod on %s: %v); want 2, on the GPU nodes only\n%s",
			ds.Status.DesiredNumberScheduled, NodeCPU, m.agentPodObject(t, NodeCPU) != nil, m.helm.diagnose(t, chartNamespace))
	}
	l, err := m.CP.Client.CoreV1().Pods(chartNamespace).List(ctx, metav1.ListOptions{LabelSelector: chartExtenderSelector})
	if err != nil {
		t.Fatal(err)
	}
	var on []string
	for _, p := range l.Items {
		on = append(on, p.Spec.NodeName)
	}
	if len(on) != 2 || on[0] != NodeCPU || on[1] != NodeCPU {
		t.Errorf("extender replicas on %v, want 2 on %s", on, NodeCPU)
	}
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

// RestartNode boots a killed node again: containerd, the kubelet (until Ready), which starts the
// agent pod it finds bound to its node again, and waits until the agent has published its
// inventory.
func (m *MultiNode) RestartNode(t testing.TB, name string) {
	t.Helper()
	c := m.Node(t, name)
	c.Ctr.Start(t)
	c.Kubelet.Start(t)
	c.Kubelet.WaitReady(t)
	c.WaitAgentReady(t)
}
