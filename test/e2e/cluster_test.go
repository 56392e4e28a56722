package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/tessera-gpu/tessera/api"
)

// TestCluster runs Tessera end to end on one real node (StartCluster): pods go through the real
// scheduler and tessera-extender, the real kubelet allocates from tessera-node's device plugins, and
// containerd calls tessera-node's NRI plugin, which realises the extender's assignment. The subtests
// share the cluster and run in order; each leaves it empty.
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
	}
	for _, s := range steps {
		if !t.Run(s.name, func(t *testing.T) { s.fn(t, c) }) {
			// the cluster may be in any state now; later steps would only report that
			t.Fatalf("%s failed; skipping the remaining steps", s.name)
		}
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
	shared := map[string]bool{}
	for _, d := range append(append(da, d2...), db...) {
		shared[d.UUID] = true
	}
	c.WaitAllocatable(t, map[string]int64{api.ResourceGPU: int64(SimWholeGPUs - len(shared)), api.ResourceShare: SimShares - 10})

	c.DeleteAllPods(t)
	c.WaitLedgerEmpty(t)
	c.WaitAllocatable(t, map[string]int64{api.ResourceGPU: SimWholeGPUs, api.ResourceShare: SimShares})
}

func testClusterDeleteFreesShare(t *testing.T, c *Cluster)  {}
func testClusterForgedAssignment(t *testing.T, c *Cluster)  {}
func testClusterKubeletRestart(t *testing.T, c *Cluster)    {}
func testClusterContainerdRestart(t *testing.T, c *Cluster) {}
func testClusterAgentKill(t *testing.T, c *Cluster)         {}
func testClusterExtenderRestart(t *testing.T, c *Cluster)   {}

var _ = os.Getenv
