package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestCluster runs Tessera end to end on one real node (StartCluster): pods go through the real
// scheduler and tessera-extender, the real kubelet allocates from tessera-node's device plugins, and
// containerd calls tessera-node's NRI plugin, which realises the extender's assignment. The subtests
// share the cluster and run in order; each leaves it empty (Reset), so one failing step does not
// fail the next.
func TestCluster(t *testing.T) {
	c := StartCluster(t, ClusterOptions{})
	steps := []struct {
		name string
		fn   func(*testing.T, *Cluster)
	}{
		{"Workloads", testClusterWorkloads},
		{"DeleteFreesShare", testClusterDeleteFreesShare},
		{"ForgedAssignment", testClusterForgedAssignment},
		{"KubeletRestart", testClusterKubeletRestart},
		{"ContainerdRestart", testClusterContainerdRestart},
		{"AgentKill", testClusterAgentKill},
		{"ExtenderRestart", testClusterExtenderRestart},
		{"Migration", testClusterMigration},
	}
	for _, s := range steps {
		t.Run(s.name, func(t *testing.T) {
			// Each step starts from an empty cluster and leaves it empty, failed or not.
			t.Cleanup(func() { c.Reset(t) })
			s.fn(t, c)
		})
	}
}

// exampleDir holds the demo workloads.
func exampleDir() string { return filepath.Join(repoRoot(), "deploy", "examples") }

// examplePods are the pods of deploy/examples that run, by name; too-big stays Pending.
var examplePods = []string{"share-a", "share-b", "two-shares", "whole", "mig"}

// ApplyExamples applies every manifest of deploy/examples with kubectl.
func ApplyExamples(t testing.TB, c *Cluster) {
	t.Helper()
	if out, err := c.Kubectl(t, "apply", "-f", exampleDir()); err != nil {
		t.Fatalf("kubectl apply -f %s: %v\n%s", exampleDir(), err, out)
	}
}

// cudaGranule is the allocation step of `cudaprobe fill` in the e2e checks.
const cudaGranule = 64 << 20

// probeValues parses one "key=value ..." line of cudaprobe's output that has the given key.
func probeValues(t *testing.T, out, key string) map[string]uint64 {
	t.Helper()
	for _, line := range strings.Split(out, "\n") {
		if !strings.HasPrefix(line, key+"=") && !strings.Contains(line, " "+key+"=") {
			continue
		}
		vals := map[string]uint64{}
		for _, f := range strings.Fields(line) {
			if k, v, ok := strings.Cut(f, "="); ok {
				n, err := strconv.ParseUint(v, 10, 64)
				if err == nil {
					vals[k] = n
				}
			}
		}
		return vals
	}
	t.Fatalf("cudaprobe printed no %s= line:\n%s", key, out)
	return nil
}

// checkShareCUDA runs a real CUDA program in a share container, through the real path:
// /etc/ld.so.preload -> libvcuda.so -> the driver's libcuda.so.1 mounted by the CDI spec. CUDA
// must report the share's cap as the GPU's memory, stop allocating at the cap (within one
// allocation), count a second process's memory against the same cap, and nvidia-smi must show it.
func checkShareCUDA(t *testing.T, c *Cluster, pod string, capBytes int64) {
	t.Helper()
	out := c.MustExec(t, pod, "cudaprobe info")
	info := probeValues(t, out, "device")
	if info["total_mem"] != uint64(capBytes) || info["meminfo_total"] != uint64(capBytes) {
		t.Errorf("%s: CUDA reports %d bytes (cuDeviceTotalMem) and %d (cuMemGetInfo), want the cap %d:\n%s",
			pod, info["total_mem"], info["meminfo_total"], capBytes, out)
	}
	out = c.MustExec(t, pod, fmt.Sprintf("cudaprobe fill %d", cudaGranule))
	fill := probeValues(t, out, "allocated")
	if fill["stopped_by"] != 2 || fill["allocated"] > fill["meminfo_free"] || fill["meminfo_free"]-fill["allocated"] >= cudaGranule ||
		fill["meminfo_free"] > uint64(capBytes) {
		t.Errorf("%s: filled %d bytes with %d free of a %d cap, stopped by CUDA error %d; want CUDA_ERROR_OUT_OF_MEMORY (2) within one %d-byte allocation of the free memory:\n%s",
			pod, fill["allocated"], fill["meminfo_free"], capBytes, fill["stopped_by"], cudaGranule, out)
	}
	// Two processes of one container share one cap: what one holds, the other cannot take.
	held := uint64(capBytes) / 4
	out = c.MustExec(t, pod, fmt.Sprintf("cudaprobe hold %d 8 & sleep 2; cudaprobe fill %d; nvidia-smi; wait", held, cudaGranule))
	if h := probeValues(t, out, "held"); h["held"] != held {
		t.Fatalf("%s: the first process could not hold %d bytes:\n%s", pod, held, out)
	}
	fill = probeValues(t, out, "allocated")
	if fill["allocated"]+held > uint64(capBytes) || fill["stopped_by"] != 2 {
		t.Errorf("%s: a second process allocated %d bytes beside %d held by the first, over the %d cap:\n%s", pod, fill["allocated"], held, capBytes, out)
	}
	if want := fmt.Sprintf("/ %d MiB", capBytes>>20); !strings.Contains(out, want) {
		t.Errorf("%s: nvidia-smi does not show the cap (%q):\n%s", pod, want, out)
	}
}

// deviceNodes lists the GPU device nodes (/dev/nvidia<N>) in `ls /dev` output.
func deviceNodes(ls string) []string {
	return regexp.MustCompile(`(?m)^nvidia[0-9]+$`).FindAllString(ls, -1)
}

func testClusterWorkloads(t *testing.T, c *Cluster) {
	ApplyExamples(t, c)
	pods := map[string]*corev1.Pod{}
	for i, p := range c.WaitRunning(t, 3*time.Minute, examplePods...) {
		pods[examplePods[i]] = p
	}
	// too-big asks for 48 GiB per share: no GPU has that much, and the extender says so.
	msg := c.WaitUnschedulable(t, "too-big", "0/1 nodes are available")
	t.Logf("too-big: %s", msg)
	if strings.Contains(msg, "Insufficient") || !strings.Contains(msg, "49152 MiB per share") {
		t.Errorf("too-big: the message does not carry the extender's reason: %q", msg)
	}

	// share-a and share-b share one GPU, each with its own caps.
	a, b := c.Assignment(t, pods["share-a"]), c.Assignment(t, pods["share-b"])
	if a == nil || b == nil {
		t.Fatalf("share pods without assignments: %v %v", pods["share-a"].Annotations, pods["share-b"].Annotations)
	}
	da, db := a.Container("main").Devices, b.Container("main").Devices
	if len(da) != 1 || len(db) != 1 || da[0].UUID != db[0].UUID {
		t.Fatalf("share-a %+v and share-b %+v are not on one GPU", da, db)
	}
	if da[0].MemoryBytes != 10<<30 || da[0].CoresPercent != 30 || db[0].MemoryBytes != 4<<30 || db[0].CoresPercent != 20 {
		t.Errorf("share caps: share-a %+v, share-b %+v", da[0], db[0])
	}
	g := c.GPU(da[0].UUID)
	for _, s := range []struct {
		pod string
		d   api.DeviceAssignment
	}{{"share-a", da[0]}, {"share-b", db[0]}} {
		out := c.MustExec(t, s.pod, "ls /dev; echo ---; cat /etc/ld.so.preload; echo ---; cat /etc/tessera/vcuda/limits; echo ---; ls -l "+api.VCUDALibraryInContainer)
		if got := deviceNodes(out); len(got) != 1 || got[0] != fmt.Sprintf("nvidia%d", g.Minor) {
			t.Errorf("%s sees GPU nodes %v, want only nvidia%d:\n%s", s.pod, got, g.Minor, out)
		}
		limits := fmt.Sprintf("gpu %s %d %d", s.d.UUID, s.d.MemoryBytes, s.d.CoresPercent)
		for _, want := range []string{"(?m)^nvidiactl$", "(?m)^" + regexp.QuoteMeta(api.VCUDALibraryInContainer) + "$", "(?m)^" + regexp.QuoteMeta(limits) + "$"} {
			if !regexp.MustCompile(want).MatchString(out) {
				t.Errorf("%s lacks %s:\n%s", s.pod, want, out)
			}
		}
		if out, err := c.Exec(t, s.pod, "main", "echo x > /etc/ld.so.preload || exit 1; echo y > /etc/tessera/vcuda/limits"); err == nil {
			t.Errorf("%s can write its preload or limits file: %s", s.pod, out)
		}
		checkShareCUDA(t, c, s.pod, s.d.MemoryBytes)
	}

	// two-shares: two shares of 50% memory on two different GPUs, both visible, both capped.
	ts := c.Assignment(t, pods["two-shares"])
	if ts == nil || len(ts.Container("main").Devices) != 2 {
		t.Fatalf("two-shares assignment: %+v", ts)
	}
	d2 := ts.Container("main").Devices
	if d2[0].UUID == d2[1].UUID {
		t.Errorf("two-shares got two shares of one GPU: %+v", d2)
	}
	out := c.MustExec(t, "two-shares", "ls /dev; echo ---; cat /etc/tessera/vcuda/limits")
	var want []string
	for _, d := range d2 {
		gd := c.GPU(d.UUID)
		if d.MemoryBytes != gd.MemoryBytes/2 || d.Whole {
			t.Errorf("two-shares: share %+v is not half of GPU %d's %d bytes", d, gd.Index, gd.MemoryBytes)
		}
		want = append(want, fmt.Sprintf("nvidia%d", gd.Minor))
		if !strings.Contains(out, fmt.Sprintf("gpu %s %d ", d.UUID, d.MemoryBytes)) {
			t.Errorf("two-shares limits lack GPU %s:\n%s", d.UUID, out)
		}
	}
	sort.Strings(want)
	if got := deviceNodes(out); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("two-shares sees %v, want %v:\n%s", got, want, out)
	}

	// whole: one GPU, exclusive, no preload and no limits.
	w := c.Assignment(t, pods["whole"])
	if w == nil || len(w.Container("main").Devices) != 1 || !w.Container("main").Devices[0].Whole {
		t.Fatalf("whole assignment: %+v", w)
	}
	wg := c.GPU(w.Container("main").Devices[0].UUID)
	for _, d := range append(append(da, d2...), db...) {
		if d.UUID == wg.UUID {
			t.Errorf("GPU %s is held whole by whole and shared by another pod", wg.UUID)
		}
	}
	out = c.MustExec(t, "whole", "ls /dev; echo ---; cat /etc/ld.so.preload 2>&1; ls /etc/tessera 2>&1; true")
	if got := deviceNodes(out); len(got) != 1 || got[0] != fmt.Sprintf("nvidia%d", wg.Minor) {
		t.Errorf("whole sees %v, want only nvidia%d:\n%s", got, wg.Minor, out)
	}
	if !strings.Contains(out, "can't open '/etc/ld.so.preload'") || strings.Contains(out, "vcuda") {
		t.Errorf("whole-GPU container has a preload or limits:\n%s", out)
	}
	// A whole GPU is the full GPU to CUDA, with nothing in between.
	out = c.MustExec(t, "whole", "cudaprobe info")
	if info := probeValues(t, out, "device"); info["total_mem"] != uint64(wg.MemoryBytes) || info["meminfo_total"] != uint64(wg.MemoryBytes) {
		t.Errorf("whole: CUDA sees %d bytes, want the GPU's %d:\n%s", info["total_mem"], wg.MemoryBytes, out)
	}

	// mig: the MIG GPU's node and two nvidia-caps nodes (GI and CI), no preload, no assignment.
	if a := c.Assignment(t, pods["mig"]); a != nil {
		t.Errorf("mig pod carries an assignment: %+v", a)
	}
	out = c.MustExec(t, "mig", "ls /dev /dev/nvidia-caps; echo ---; cat /etc/ld.so.preload 2>&1; true")
	var migGPU *api.GPU
	for i := range c.Inventory.GPUs {
		if c.Inventory.GPUs[i].MIG != nil {
			migGPU = &c.Inventory.GPUs[i]
		}
	}
	if migGPU == nil {
		t.Fatal("the simulated node has no MIG GPU")
	}
	if got := deviceNodes(out); len(got) != 1 || got[0] != fmt.Sprintf("nvidia%d", migGPU.Minor) {
		t.Errorf("mig sees %v, want only nvidia%d:\n%s", got, migGPU.Minor, out)
	}
	if n := len(regexp.MustCompile(`(?m)^nvidia-cap[0-9]+$`).FindAllString(out, -1)); n != 2 || !strings.Contains(out, "can't open '/etc/ld.so.preload'") {
		t.Errorf("mig container (%d cap nodes):\n%s", n, out)
	}

	// The ledger holds exactly the five containers; the Node's allocatable follows the GPU modes:
	// GPUs holding shares are not offered whole any more, and the GPU held whole offers no shares.
	entries := c.LedgerEntries(t)
	if len(entries) != len(examplePods) {
		t.Errorf("ledger has %d entries, want %d:\n%s", len(entries), len(examplePods), c.Ledger(t))
	}
	c.WaitAllocatable(t, c.ExpectedAllocatable(t))
	checkClusterMetrics(t, c, g, wg)
	// The extender tells each pod which GPU it got, and how much of it.
	assigned := fmt.Sprintf("GPUAssigned: node %s: main: %s share 10Gi memory 30%% cores", c.Node, da[0].UUID)
	if err := waitFor(30*time.Second, 200*time.Millisecond, func() (bool, error) {
		return slices.Contains(c.Events(t, "share-a", "GPUAssigned"), assigned), nil
	}); err != nil {
		t.Errorf("share-a has no Event %q: %v; its events: %q", assigned, err, c.Events(t, "share-a", ""))
	}

	c.DeleteAllPods(t)
	c.WaitLedgerEmpty(t)
	c.WaitAllocatable(t, map[string]int64{api.ResourceGPU: SimWholeGPUs, api.ResourceShare: SimShares})
}

// checkClusterMetrics scrapes both binaries as Prometheus would after the examples ran: the agent
// shows the shares (what is promised and what vcuda measured) and whole GPU under dcgm-exporter's
// labels, its NRI and Allocate histograms and build_info; the extender its filter/prioritize/bind
// histograms and build_info.
func checkClusterMetrics(t *testing.T, c *Cluster, shared, whole *api.GPU) {
	t.Helper()
	gpu := func(g *api.GPU) string {
		return fmt.Sprintf(`UUID="%s",device="nvidia%d",gpu="%d",hostname="%s"`, g.UUID, g.Minor, g.Index, c.Node)
	}
	node := c.Metrics(t)
	// HAMi's names double the series: only with --hami-metrics or --hami-legacy-metrics
	// (TestHAMiMetricsOnlyOnRequest).
	if strings.Contains(node, "vGPU_device_memory_limit_in_bytes") || strings.Contains(node, "hami_vgpu_memory_limit_bytes") {
		t.Errorf("tessera-node /metrics serves HAMi's names without --hami-metrics or --hami-legacy-metrics")
	}
	for _, want := range []string{
		`tessera_gpu_allocated_shares{` + gpu(shared) + `,modelName=`,
		`tessera_gpu_mode{` + gpu(whole) + `,mode="whole",modelName=`,
		`tessera_container_gpu_allocated_memory_bytes{UUID="` + shared.UUID + `",container="main",device_uuid="` + shared.UUID + `",gpu="` + fmt.Sprint(shared.Index) + `",hostname="` + c.Node + `",mode="share",namespace="default",pod="share-a"} 1.073741824e+10`,
		`tessera_container_gpu_memory_limit_bytes{UUID="` + shared.UUID + `",container="main",gpu="` + fmt.Sprint(shared.Index) + `",hostname="` + c.Node + `",namespace="default",pod="share-a"} 1.073741824e+10`,
		// The info series that joins dcgm-exporter's to pods on UUID.
		`tessera_container_gpu_info{GPU_I_ID="",GPU_I_PROFILE="",UUID="` + shared.UUID + `",container="main",device_uuid="` + shared.UUID + `",gpu="` + fmt.Sprint(shared.Index) + `",hostname="` + c.Node + `",mode="share",namespace="default",pod="share-a"} 1`,
		`tessera_nri_create_container_duration_seconds_bucket{result="ok",le="+Inf"}`,
		`tessera_deviceplugin_allocate_duration_seconds_bucket{resource="` + api.ResourceShare + `",result="ok",le="+Inf"}`,
		"tessera_node_build_info{",
	} {
		if !strings.Contains(node, want) {
			t.Errorf("tessera-node /metrics lacks %s", want)
		}
	}
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get("http://" + c.ExtenderAddr + "/metrics")
	if err != nil {
		t.Fatalf("tessera-extender /metrics: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	for _, want := range []string{
		`tessera_extender_request_duration_seconds_bucket{result="ok",verb="filter",le="+Inf"}`,
		`tessera_extender_request_duration_seconds_bucket{result="unschedulable",verb="filter",le="+Inf"}`,
		`tessera_extender_request_duration_seconds_bucket{result="ok",verb="bind",le="+Inf"}`,
		"\ntessera_extender_leader 1\n",
		"tessera_extender_build_info{",
	} {
		if !strings.Contains(string(b), want) {
			t.Errorf("tessera-extender /metrics lacks %s", want)
		}
	}
	if t.Failed() {
		t.Logf("tessera-node /metrics:\n%s\ntessera-extender /metrics:\n%s", node, b)
	}
}

// share is the limits of a pod with n shares of mem each (cores 0: uncapped).
func share(n int, mem string, cores int) map[string]string {
	l := map[string]string{api.ResourceShare: fmt.Sprint(n), api.ResourceShareMemory: mem}
	if cores > 0 {
		l[api.ResourceShareCores] = fmt.Sprint(cores)
	}
	return l
}

// whole is the limits of a pod with n whole GPUs.
func whole(n int) map[string]string { return map[string]string{api.ResourceGPU: fmt.Sprint(n)} }

// testClusterDeleteFreesShare: a pod holding all the GPU memory makes the next share pod wait with
// the extender's reason; deleting it lets the waiting pod in.
func testClusterDeleteFreesShare(t *testing.T, c *Cluster) {
	c.CreatePod(t, TestPod("hog", map[string]string{api.ResourceShare: "6", api.ResourceShareMemoryPercent: "100"}, nil))
	c.WaitRunning(t, 2*time.Minute, "hog")
	c.CreatePod(t, TestPod("waiter", share(1, "1Gi", 10), nil))
	msg := c.WaitUnschedulable(t, "waiter", "0/1 nodes are available")
	t.Logf("waiter while hog runs: %s", msg)
	if strings.Contains(msg, "Insufficient") {
		t.Errorf("waiter was refused by the scheduler's count, not the extender: %q", msg)
	}
	c.DeletePods(t, "hog")
	p := c.WaitRunning(t, 2*time.Minute, "waiter")[0]
	a := c.Assignment(t, p)
	if a == nil || len(a.Container("main").Devices) != 1 || a.Container("main").Devices[0].MemoryBytes != 1<<30 {
		t.Errorf("waiter's assignment: %+v", a)
	}
	if out := c.MustExec(t, "waiter", "cat /etc/tessera/vcuda/limits"); !strings.Contains(out, fmt.Sprintf("gpu %s %d 10", a.Container("main").Devices[0].UUID, 1<<30)) {
		t.Errorf("waiter's limits:\n%s", out)
	}
	if n := len(c.LedgerEntries(t)); n != 1 {
		t.Errorf("ledger has %d entries with only waiter running:\n%s", n, c.Ledger(t))
	}
	c.DeletePods(t, "waiter")
	c.WaitLedgerEmpty(t)
}

// testClusterForgedAssignment: a pod that asks for no GPU but carries an assignment annotation
// naming a whole GPU (the default scheduler binds it: it asks for nothing the extender manages)
// gets no GPU device, no preload and no ledger entry, and the GPU stays free for others.
func testClusterForgedAssignment(t *testing.T, c *Cluster) {
	g := c.Inventory.GPUs[0]
	forged, err := json.Marshal(&api.PodAssignment{APIVersion: api.Version, Node: c.Node,
		Containers: []api.ContainerAssignment{{Name: "main", Devices: []api.DeviceAssignment{{UUID: g.UUID, Whole: true}}}}})
	if err != nil {
		t.Fatal(err)
	}
	c.CreatePod(t, TestPod("forged", nil, map[string]string{api.AnnotationAssignment: string(forged)}))
	c.WaitRunning(t, 2*time.Minute, "forged")
	out := c.MustExec(t, "forged", "ls /dev; echo ---; cat /etc/ld.so.preload 2>&1; ls /etc/tessera 2>&1; true")
	if regexp.MustCompile(`(?m)^nvidia`).MatchString(out) || strings.Contains(out, "vcuda") {
		t.Errorf("a pod without GPU requests got GPU devices or vcuda from a forged assignment:\n%s", out)
	}
	if n := len(c.LedgerEntries(t)); n != 0 {
		t.Errorf("the forged pod is in the ledger:\n%s", c.Ledger(t))
	}
	// The forged annotation holds nothing in the extender either: all six GPUs can still be
	// given whole, the forged one included.
	c.CreatePod(t, TestPod("all-whole", whole(SimWholeGPUs), nil))
	p := c.WaitRunning(t, 2*time.Minute, "all-whole")[0]
	if a := c.Assignment(t, p); a == nil || len(a.Container("main").Devices) != SimWholeGPUs {
		t.Errorf("all-whole's assignment: %+v", a)
	}
	c.DeletePods(t, "forged", "all-whole")
	c.WaitLedgerEmpty(t)
}

// AgentLogCount counts the lines of tessera-node's log (across restarts) containing every part.
func (c *Cluster) AgentLogCount(t testing.TB, parts ...string) int {
	t.Helper()
	n := 0
lines:
	for _, l := range strings.Split(c.AgentLog(t), "\n") {
		for _, p := range parts {
			if !strings.Contains(l, p) {
				continue lines
			}
		}
		n++
	}
	return n
}

// waitAgentLog waits until AgentLogCount(parts) exceeds before.
func waitAgentLog(t *testing.T, c *Cluster, before int, parts ...string) {
	t.Helper()
	err := waitFor(time.Minute, 100*time.Millisecond, func() (bool, error) {
		return c.AgentLogCount(t, parts...) > before, nil
	})
	if err != nil {
		t.Fatalf("tessera-node never logged %q again: %v\n%s", parts, err, c.Agent.LogTail(30))
	}
}

// podState is what must not change for a running pod across a component restart.
type podState struct {
	container string
	restarts  int32
	started   string
	sees      string
}

func (c *Cluster) podState(t *testing.T, name string) podState {
	t.Helper()
	p := c.Pod(t, name)
	if p.Status.Phase != corev1.PodRunning || len(p.Status.ContainerStatuses) != 1 || p.Status.ContainerStatuses[0].State.Running == nil {
		t.Fatalf("pod %s is not running:\n%s", name, c.Describe(t, name))
	}
	cs := p.Status.ContainerStatuses[0]
	return podState{container: cs.ContainerID, restarts: cs.RestartCount, started: cs.State.Running.StartedAt.String(),
		sees: c.ExecEventually(t, name, "ls /dev | grep nvidia; cat /etc/tessera/vcuda/limits 2>/dev/null; true")}
}

// restartPods starts a share pod and a whole-GPU pod and returns their state.
func restartPods(t *testing.T, c *Cluster, prefix string) map[string]podState {
	t.Helper()
	c.CreatePod(t, TestPod(prefix+"-share", share(1, "2Gi", 10), nil))
	c.CreatePod(t, TestPod(prefix+"-whole", whole(1), nil))
	c.WaitRunning(t, 2*time.Minute, prefix+"-share", prefix+"-whole")
	return map[string]podState{prefix + "-share": c.podState(t, prefix+"-share"), prefix + "-whole": c.podState(t, prefix+"-whole")}
}

// checkPodsKept checks that the pods run on in the same containers, seeing the same devices.
func checkPodsKept(t *testing.T, c *Cluster, before map[string]podState) {
	t.Helper()
	for name, b := range before {
		if a := c.podState(t, name); a != b {
			t.Errorf("pod %s changed:\nbefore %+v\nafter  %+v", name, b, a)
		}
	}
}

// checkNewPod runs one more share pod and checks it gets its GPU and limits, then deletes it.
func checkNewPod(t *testing.T, c *Cluster, name string) {
	t.Helper()
	c.CreatePod(t, TestPod(name, share(1, "3Gi", 0), nil))
	p := c.WaitRunning(t, 2*time.Minute, name)[0]
	a := c.Assignment(t, p)
	if a == nil || len(a.Container("main").Devices) != 1 {
		t.Fatalf("%s's assignment: %+v", name, a)
	}
	d := a.Container("main").Devices[0]
	out := c.MustExec(t, name, "ls /dev; cat /etc/tessera/vcuda/limits")
	if got := deviceNodes(out); len(got) != 1 || got[0] != fmt.Sprintf("nvidia%d", c.GPU(d.UUID).Minor) ||
		!strings.Contains(out, fmt.Sprintf("gpu %s %d 100", d.UUID, 3<<30)) {
		t.Errorf("%s (assigned %+v) sees:\n%s", name, d, out)
	}
	c.DeletePods(t, name)
}

// testClusterKubeletRestart: the kubelet restarts (deleting every device-plugin socket): the
// agent's device plugins register again, running pods keep their containers and devices, the
// ledger is untouched, and a new pod gets its GPU.
func testClusterKubeletRestart(t *testing.T, c *Cluster) {
	before := restartPods(t, c, "kr")
	alloc := c.ExpectedAllocatable(t)
	c.WaitAllocatable(t, alloc)
	ledgerBefore := c.Ledger(t)
	regs := c.AgentLogCount(t, "registered with the kubelet", "resource="+api.ResourceShare+" ")
	c.Kubelet.Restart(t)
	waitAgentLog(t, c, regs, "registered with the kubelet", "resource="+api.ResourceShare+" ")
	c.WaitAgentReady(t)
	c.WaitAllocatable(t, alloc)
	checkPodsKept(t, c, before)
	if l := c.Ledger(t); l != ledgerBefore {
		t.Errorf("ledger changed across a kubelet restart:\nbefore %s\nafter  %s", ledgerBefore, l)
	}
	checkNewPod(t, c, "after-kubelet")
	c.DeletePods(t, "kr-share", "kr-whole")
	c.WaitLedgerEmpty(t)
}

// testClusterContainerdRestart: containerd restarts under running pods: they keep running, the
// agent's NRI plugin reconnects (its /healthz says so), and the next pod gets its GPU and limits.
func testClusterContainerdRestart(t *testing.T, c *Cluster) {
	before := restartPods(t, c, "cr")
	ledgerBefore := c.Ledger(t)
	conns := c.AgentLogCount(t, "NRI plugin connected")
	c.RestartContainerd(t)
	waitAgentLog(t, c, conns, "NRI plugin connected")
	c.WaitAgentReady(t)
	checkPodsKept(t, c, before)
	if l := c.Ledger(t); l != ledgerBefore {
		t.Errorf("ledger changed across a containerd restart:\nbefore %s\nafter  %s", ledgerBefore, l)
	}
	checkNewPod(t, c, "after-containerd")
	c.DeletePods(t, "cr-share", "cr-whole")
	c.WaitLedgerEmpty(t)
}

// testClusterAgentKill: tessera-node is killed (SIGKILL) with pods running and started again: its
// ledger is restored unchanged, its device plugins register again, the pods keep their devices, a
// new pod works, and once every pod is gone nothing is left held or written.
func testClusterAgentKill(t *testing.T, c *Cluster) {
	before := restartPods(t, c, "ak")
	alloc := c.ExpectedAllocatable(t)
	c.WaitAllocatable(t, alloc)
	ledgerBefore := c.Ledger(t)
	if n := len(c.LedgerEntries(t)); n != 2 {
		t.Fatalf("ledger before the kill has %d entries:\n%s", n, ledgerBefore)
	}
	regs := c.AgentLogCount(t, "registered with the kubelet", "resource="+api.ResourceShare+" ")
	c.Agent.Kill(t)
	c.Agent.Start(t)
	waitAgentLog(t, c, regs, "registered with the kubelet", "resource="+api.ResourceShare+" ")
	c.WaitAgentReady(t)
	if l := c.Ledger(t); l != ledgerBefore {
		t.Errorf("ledger changed across an agent kill -9:\nbefore %s\nafter  %s", ledgerBefore, l)
	}
	if m := c.Metrics(t); !strings.Contains(m, "\ntessera_ledger_entries 2\n") {
		t.Errorf("metrics after the restart:\n%s", m)
	}
	c.WaitAllocatable(t, alloc)
	checkPodsKept(t, c, before)
	checkNewPod(t, c, "after-agent")
	c.DeletePods(t, "ak-share", "ak-whole")
	c.WaitLedgerEmpty(t)
	c.WaitAllocatable(t, map[string]int64{api.ResourceGPU: SimWholeGPUs, api.ResourceShare: SimShares})
	// Nothing leaked: no per-container files are left in the agent's data directory (the ledger and
	// its lock file, the GPU health record and the hook binaries the agent installed for the specs
	// are its own).
	var left []string
	bin := filepath.Join(c.AgentDataDir, "bin")
	filepath.Walk(c.AgentDataDir, func(p string, fi os.FileInfo, err error) error {
		own := filepath.Base(p) == "ledger.json" || filepath.Base(p) == "ledger.json.lock" || filepath.Base(p) == "health.json" || filepath.Dir(p) == bin
		if err == nil && !fi.IsDir() && !own {
			left = append(left, p)
		}
		return nil
	})
	if len(left) > 0 {
		t.Errorf("files left in the agent's data dir with no pod running: %v", left)
	}
}

// checkNoOvercommit recomputes every GPU's use from the assignments of the pods that hold devices
// and checks none is over-committed.
func checkNoOvercommit(t *testing.T, c *Cluster) {
	t.Helper()
	l, err := c.CP.Client.CoreV1().Pods(metav1.NamespaceDefault).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	type use struct {
		whole, shares, cores int
		mem                  int64
	}
	used := map[string]*use{}
	for i := range l.Items {
		p := &l.Items[i]
		if p.Spec.NodeName == "" {
			continue
		}
		a := c.Assignment(t, p)
		if a == nil {
			continue
		}
		for _, ca := range a.Containers {
			for _, d := range ca.Devices {
				u := used[d.UUID]
				if u == nil {
					u = &use{}
					used[d.UUID] = u
				}
				if d.Whole {
					u.whole++
				} else {
					u.shares++
					u.mem += d.MemoryBytes
					u.cores += d.CoresPercent
				}
			}
		}
	}
	for uuid, u := range used {
		g := c.GPU(uuid)
		if g == nil {
			t.Errorf("assignment names GPU %s, not on the node", uuid)
			continue
		}
		if u.whole > 1 || (u.whole == 1 && u.shares > 0) || u.mem > g.MemoryBytes || u.cores > 100 || u.shares > c.Inventory.SharesPerGPU {
			t.Errorf("GPU %d (%s) over-committed: %+v (memory %d)", g.Index, uuid, *u, g.MemoryBytes)
		}
	}
}

// testClusterExtenderRestart: the extender is killed (SIGKILL) with GPUs mostly taken and a pod
// arrives while it is down: once it is back that pod is placed, and the extender, rebuilt from the
// pods' annotations, over-commits nothing: a pod needing more memory than any GPU has left waits,
// and pods that fit exactly in what is left run.
func testClusterExtenderRestart(t *testing.T, c *Cluster) {
	c.CreatePod(t, TestPod("hog", map[string]string{api.ResourceShare: "6", api.ResourceShareMemoryPercent: "75"}, nil))
	c.WaitRunning(t, 2*time.Minute, "hog")
	c.Extender.Kill(t)
	c.CreatePod(t, TestPod("during", share(1, "10Gi", 0), nil))
	c.Extender.Start(t)
	c.WaitExtender(t)
	c.WaitRunning(t, 2*time.Minute, "during")
	// 10 GiB is left on five GPUs, nothing on the sixth
	c.CreatePod(t, TestPod("too-much", share(1, "11Gi", 0), nil))
	msg := c.WaitUnschedulable(t, "too-much", "0/1 nodes are available")
	t.Logf("too-much after the extender restart: %s", msg)
	c.CreatePod(t, TestPod("rest", share(5, "10Gi", 0), nil))
	c.WaitRunning(t, 2*time.Minute, "rest")
	checkNoOvercommit(t, c)
	if n := len(c.LedgerEntries(t)); n != 3 {
		t.Errorf("ledger has %d entries, want 3:\n%s", n, c.Ledger(t))
	}
	c.DeletePods(t, "hog", "during", "too-much", "rest")
	c.WaitLedgerEmpty(t)
}
