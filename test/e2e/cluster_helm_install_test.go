package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestHelmInstall installs deploy/helm/tessera for real into the one-node cluster (containerd 2.2
// with NRI and CDI, kube-apiserver, kube-controller-manager, the kubelet; the simulated GPU node)
// from the images `make images` builds, imported into the node's containerd, and runs the demo's
// workloads against it. Then `helm upgrade` replaces the agent pod without losing a running pod's
// GPU or the ledger, and `helm uninstall` leaves nothing of Tessera's on the node.
//
// The machine has no CNI, kube-proxy, cluster DNS or registry, which the install works around with
// chart values an operator can use too (docs/install.md):
//   - images: imported with `ctr -n k8s.io images import`, image.pullPolicy=Never;
//   - both components on the host network (node.hostNetwork, extender.hostNetwork), listening on
//     127.0.0.1 only (listenHost; the probes follow); apiServer.host/port replace the kubernetes
//     Service address in KUBERNETES_SERVICE_HOST/PORT;
//   - the two extender replicas share their ports on the one node with SO_REUSEPORT (and a new
//     connection per call, so the kernel spreads the scheduler's calls over both); each has a peer
//     port of its own that it advertises in the leader Lease, so a non-leader passes binds on to the
//     leader;
//   - kube-scheduler is a host process (there is no registry for its image) running the
//     KubeSchedulerConfiguration the chart ships (scheduler.mode=default, the ConfigMap read back
//     from the API server), with scheduler.extenderURL naming the shared port instead of the
//     Service's DNS name.
//
// The agent's host paths (data, run, lib dirs, CDI, NRI and pod-resources sockets) are the cluster's
// private ones, set through the chart's values; only the kubelet's device-plugin directory is the
// real one. The run dir is a shared tmpfs mount: its Bidirectional mount propagation requires it.
func TestHelmInstall(t *testing.T) {
	images := buildImages(t)
	c := StartCluster(t, ClusterOptions{Bare: true})
	t0 := time.Now()
	step := func(what string) { t.Logf("helm install: %s (%.1fs)", what, time.Since(t0).Seconds()) }
	const ns, release = "tessera-system", "tessera"
	c.CP.CreateNamespace(t, ns)
	for _, img := range images {
		mustRun(t, 2*time.Minute, tool(t, "ctr"), "-a", c.Ctr.Socket, "-n", "k8s.io", "images", "import", img)
	}
	if out, err := c.Kubectl(t, "label", "node", c.Node, "nvidia.com/gpu.present=true"); err != nil {
		t.Fatalf("label the GPU node: %v\n%s", err, out)
	}
	step("images imported")

	h := newHelmHost(t, c)
	helmCmd := func(args ...string) string { t.Helper(); return h.run(t, ns, args...) }
	// The scheduler comes first: it places the chart's own pods too (they ask for no GPU, so the
	// extender is not called for them). It needs its client certificate for the extender before
	// the install: the chart's generated Secrets, rendered and created ahead, which the install
	// keeps (lookup) as it keeps them across upgrades.
	h.preloadTLS(t, c, ns, release)
	schedCfg := h.startScheduler(t, c, ns, release)
	step("kube-scheduler running the chart's configuration")
	helmCmd("install", release, h.chart, "--wait", "--timeout", "100s")
	step("helm install --wait done")
	cm, err := c.CP.Client.CoreV1().ConfigMaps(ns).Get(context.Background(), release+"-scheduler-config", metav1.GetOptions{})
	if err != nil || strings.TrimSpace(cm.Data["config.yaml"]) != strings.TrimSpace(schedCfg) {
		t.Errorf("the installed scheduler configuration (%v) differs from the rendered one the scheduler runs:\n%s\n---\n%s", err, cm.Data["config.yaml"], schedCfg)
	}
	h.waitAgent(t, c)
	c.Inventory = h.inventory(t, c)
	checkGPULabels(t, c)
	step("agent serving")
	// Pods go in once the kubelet offers the plugins' devices, as an operator would wait for the
	// node to advertise them: a pod the scheduler met before that waits for its requeue (seen once
	// here: 2 minutes without a retry after "Insufficient tessera.dev/vgpu").
	if err := waitFor(90*time.Second, 200*time.Millisecond, func() (bool, error) {
		got := c.Allocatable(t)
		if got[api.ResourceGPU] == 0 || got[api.ResourceShare] == 0 {
			return false, fmt.Errorf("allocatable %s = %d, %s = %d", api.ResourceGPU, got[api.ResourceGPU], api.ResourceShare, got[api.ResourceShare])
		}
		return true, nil
	}); err != nil {
		t.Fatalf("node %s does not offer GPUs: %v\n%s", c.Node, err, h.diagnose(t, ns))
	}
	step("node offers whole GPUs and shares")

	// The demo's workloads: one whole GPU, two shares with memory and compute caps.
	shareLimits := map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "10Gi", api.ResourceShareCores: "30"}
	c.CreatePod(t, TestPod("whole", map[string]string{api.ResourceGPU: "1"}, nil))
	c.CreatePod(t, TestPod("share-a", shareLimits, nil))
	c.CreatePod(t, TestPod("share-b", shareLimits, nil))
	pods := c.WaitRunning(t, 2*time.Minute, "whole", "share-a", "share-b")
	step("demo pods running")
	for _, p := range pods {
		a := c.Assignment(t, p)
		if a == nil || len(a.Container("main").Devices) != 1 {
			t.Fatalf("pod %s has no one-device assignment: %+v", p.Name, a)
		}
		if ev := c.Events(t, p.Name, "GPUAssigned"); len(ev) == 0 {
			t.Errorf("no GPUAssigned Event for %s:\n%s", p.Name, c.Describe(t, p.Name))
		}
	}
	h.checkAgentWrites(t, c, ns, pods)
	for _, name := range []string{"share-a", "share-b"} {
		out := c.MustExec(t, name, "cudaprobe info")
		if info := probeValues(t, out, "device"); info["total_mem"] != 10<<30 {
			t.Errorf("%s: CUDA reports %d bytes of GPU memory, want its 10Gi cap:\n%s", name, info["total_mem"], out)
		}
	}
	// Both replicas serve the scheduler; a bind a non-leader gets is passed on to the leader. Calls
	// spread by the kernel's hash of each new connection, so schedule a few more small pods until
	// both have answered binds (each more pod halves the odds they have not).
	for i := 0; !h.bindsOnBoth(t, c, ns) && i < 8; i++ {
		name := fmt.Sprintf("extra-%d", i)
		c.CreatePod(t, TestPod(name, map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "1Gi"}, nil))
		c.WaitRunning(t, time.Minute, name)
	}
	replicas := h.extenderReplicas(t, c, ns)
	for _, r := range replicas {
		t.Logf("extender %s (leader %t, %s): binds ok=%d error=%d, filter ok=%d", r.pod, r.leader, r.url, r.binds["ok"], r.binds["error"], r.filters)
		if r.binds["error"] != 0 {
			t.Errorf("extender %s answered %d binds with an error", r.pod, r.binds["error"])
		}
		if r.binds["ok"] == 0 {
			t.Errorf("extender %s answered no bind: the scheduler's calls did not reach both replicas", r.pod)
		}
	}
	if len(replicas) != 2 {
		t.Errorf("%d extender replicas serve, want 2", len(replicas))
	}
	step("binds through both extender replicas checked")
	h.checkTLSRefusals(t, replicas)
	extCert := h.secretData(t, c, ns, release+"-extender-tls")

	// helm upgrade with a changed agent value: a new agent pod; running pods keep their GPUs.
	before := map[string]string{}
	for _, p := range pods {
		before[p.Name] = c.Pod(t, p.Name).Annotations[api.AnnotationAssignment]
	}
	ledgerBefore := c.LedgerEntries(t)
	oldAgent := h.agentPod(t, c, ns)
	helmCmd("upgrade", release, h.chart, "--wait", "--timeout", "100s", "--set", "node.sharesPerGPU=10", "--set", "node.resources.requests.cpu=60m")
	h.waitNewAgent(t, c, ns, oldAgent)
	h.waitAgent(t, c)
	// The kubelet marks a plugin's devices unhealthy when it goes, until the new agent's plugin
	// lists them again: wait for the Node to offer what the running pods leave.
	h.waitAllocatable(t, c, c.ExpectedAllocatable(t))
	step("helm upgrade done, new agent pod serving")
	if got := h.secretData(t, c, ns, release+"-extender-tls"); got != extCert {
		t.Errorf("helm upgrade replaced the extender's generated certificate: the running scheduler's client certificate no longer matches")
	}
	for name, a := range before {
		if got := c.Pod(t, name).Annotations[api.AnnotationAssignment]; got != a {
			t.Errorf("%s: assignment changed across the upgrade:\n%s\n->\n%s", name, a, got)
		}
	}
	if got := c.LedgerEntries(t); len(got) != len(ledgerBefore) {
		t.Errorf("the ledger had %d entries before the upgrade, %d after:\n%s", len(ledgerBefore), len(got), c.Ledger(t))
	}
	c.MustExec(t, "share-a", "cudaprobe info")
	c.CreatePod(t, TestPod("after-upgrade", map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "2Gi"}, nil))
	c.WaitRunning(t, time.Minute, "after-upgrade")

	// helm uninstall: the agent sees its DaemonSet deleted and removes what it put on the node. A
	// share container still running keeps its GPU, library and region (bind-mounted).
	helmCmd("uninstall", release, "--wait", "--timeout", "100s")
	step("helm uninstall done")
	h.waitNoAgent(t, c, ns)
	if left := h.leftovers(t, c); len(left) > 0 {
		t.Errorf("helm uninstall left on the node:\n  %s\n%s", strings.Join(left, "\n  "), h.diagnose(t, ns))
	}
	if out, err := c.Exec(t, "share-a", "main", "cudaprobe info"); err != nil || !strings.Contains(out, "total_mem=") {
		t.Errorf("share-a's CUDA stopped working after the uninstall: %v\n%s", err, out)
	}
	step("node clean")
}
