package e2e

import (
	"math"
	"slices"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"google.golang.org/protobuf/proto"

	"github.com/tessera-gpu/tessera/internal/placement/simulate"
)

// Unit tests of the placement benchmark's helpers (no cluster; they need no tools).

func benchTestNodes() []simulate.Node {
	return []simulate.Node{
		{Name: "openb-node-0002", CPUMilli: 64000, MemMiB: 262144, GPUs: 2, Model: "P100"},
		{Name: "openb-node-0000", CPUMilli: 96000, MemMiB: 786432, GPUs: 8, Model: "V100M32"},
		{Name: "openb-node-0001", CPUMilli: 32000, MemMiB: 131072, GPUs: 0, Model: ""},
	}
}

func TestReplicateNodesScalesTheCluster(t *testing.T) {
	base := benchTestNodes()
	same, err := replicateNodes(base, 1)
	if err != nil || !slices.Equal(same, base) {
		t.Fatalf("1 copy must leave the list as it is: %v, %v", same, err)
	}
	const k = 4
	nodes, err := replicateNodes(base, k)
	if err != nil {
		t.Fatal(err)
	}
	if len(nodes) != k*len(base) {
		t.Fatalf("%d nodes, want %d", len(nodes), k*len(base))
	}
	names := map[string]bool{}
	perOrig := map[string]int{}
	for _, n := range nodes {
		if names[n.Name] {
			t.Fatalf("name %s twice", n.Name)
		}
		names[n.Name] = true
		orig, _, _ := strings.Cut(n.Name, "-c")
		perOrig[orig]++
		i := slices.IndexFunc(base, func(b simulate.Node) bool { return b.Name == orig })
		if i < 0 {
			t.Fatalf("copy %s has no original", n.Name)
		}
		if want := base[i]; n.CPUMilli != want.CPUMilli || n.MemMiB != want.MemMiB || n.GPUs != want.GPUs || n.Model != want.Model {
			t.Fatalf("copy %+v differs from its original %+v", n, want)
		}
	}
	for _, b := range base {
		if perOrig[b.Name] != k || !names[b.Name] {
			t.Fatalf("%s: %d copies (original name kept: %t), want %d", b.Name, perOrig[b.Name], names[b.Name], k)
		}
	}
	one, many := simulate.NewCluster(base, nil), simulate.NewCluster(nodes, nil)
	if many.Capacity != k*one.Capacity || one.Capacity != 10*1000 {
		t.Fatalf("capacity %d, want %d x %d", many.Capacity, k, one.Capacity)
	}
}

func TestReplicateNodesRefusesCollidingNames(t *testing.T) {
	nodes := []simulate.Node{{Name: "a", GPUs: 1}, {Name: "a-c1", GPUs: 1}}
	if _, err := replicateNodes(nodes, 2); err == nil || !strings.Contains(err.Error(), `"a-c1"`) {
		t.Fatalf("a copy named like another node must be refused, got %v", err)
	}
}

// The live names must sort in the seed's order (the smallest name is the tie-break of the
// scheduler's and the extender's, and list order the simulator's), also past 10,000 nodes, and the
// order must be the same permutation on every call and differ between seeds.
func TestBenchNodeNamesKeepTheSeedsOrder(t *testing.T) {
	for _, copies := range []int{1, 4, 3400} { // 3, 12 and 10,200 nodes
		nodes, err := replicateNodes(benchTestNodes(), copies)
		if err != nil {
			t.Fatal(err)
		}
		c := simulate.NewCluster(nodes, nil)
		order := c.NodeOrder(42)
		if !slices.Equal(order, c.NodeOrder(42)) {
			t.Fatal("the node order of one seed differs between calls")
		}
		if copies > 1 && slices.Equal(order, c.NodeOrder(43)) {
			t.Fatalf("%d nodes: seeds 42 and 43 give the same order", len(nodes))
		}
		sorted := slices.Clone(order)
		slices.Sort(sorted)
		for i, v := range sorted {
			if v != i {
				t.Fatalf("%d nodes: the order is not a permutation (%d at %d)", len(nodes), v, i)
			}
		}
		names := make([]string, len(order))
		for pos, i := range order {
			names[pos] = benchNodeName(pos, len(order), nodes[i].Name)
		}
		if !slices.IsSorted(names) {
			t.Fatalf("%d nodes: live names do not sort in the seed's order", len(nodes))
		}
		if want := "0000-"; len(nodes) < 10000 && !strings.HasPrefix(names[0], want) {
			t.Fatalf("%d nodes: first name %s, want the reference's %%04d prefix", len(nodes), names[0])
		}
		if len(nodes) >= 10000 && !strings.HasPrefix(names[0], "00000-") {
			t.Fatalf("%d nodes: first name %s, want a 5-digit prefix", len(nodes), names[0])
		}
	}
}

func TestPlacementLine(t *testing.T) {
	full := placementLine("tessera", []float64{0, 0, 1, 4.4}, 130, 125.6, 27.4, 42, 1213, 10857, 10857)
	if full != "policy=tessera unallocated_gpu_pct_at_100=4.40 pods_per_s=27.4 (live, seed 42, 1213 nodes, 10857 arrivals)" {
		t.Fatalf("full run line changed: %s", full)
	}
	past := placementLine("fgd", []float64{0, 0, 1, 5.26}, 101.2, 96, 20, 42, 4852, 40000, 43000)
	if !strings.HasPrefix(past, "policy=fgd unallocated_gpu_pct_at_100=5.26 ") || !strings.Contains(past, "first 40000 of 43000 arrivals") {
		t.Fatalf("a run stopped past the 100%% point: %s", past)
	}
	// Stopped at 6% arrived load: the number at 100% was never measured and must not be printed.
	part := placementLine("tessera", []float64{94, 94, 94, 94}, 6.25, 6.0, 9.5, 42, 4852, 3000, 43000)
	if strings.Contains(part, "unallocated_gpu_pct_at_100=") {
		t.Fatalf("a partial run printed a number at 100%%: %s", part)
	}
	for _, want := range []string{"stopped_before_100pct_arrived", "arrived_gpu_pct=6.25", "unallocated_gpu_pct_at_arrived=94.00",
		"failed_gpu_pct=0.25", "pods_per_s=9.5", "first 3000 of 43000 arrivals"} {
		if !strings.Contains(part, want) {
			t.Fatalf("partial run line lacks %q: %s", want, part)
		}
	}
	// Inside the arrivals that round to 100%, the checkpoint is not complete yet.
	if reached100(100.4, false) || !reached100(100.6, false) || !reached100(50, true) {
		t.Fatal("reached100 misjudges the 100% point")
	}
}

func TestArrivedLoad(t *testing.T) {
	a, p := arrivedLoad(4000, []int{1000, 500, 2000, 0}, []bool{true, false, true, true})
	if a != 87.5 || p != 75 {
		t.Fatalf("arrived %.2f allocated %.2f, want 87.50 75.00", a, p)
	}
}

func TestBucketQuantile(t *testing.T) {
	// 10 observations: 4 in (0, 1ms], 5 in (1ms, 5ms], 1 above 10 s.
	h := &dto.Histogram{SampleCount: proto.Uint64(10), SampleSum: proto.Float64(11), Bucket: []*dto.Bucket{
		{UpperBound: proto.Float64(0.001), CumulativeCount: proto.Uint64(4)},
		{UpperBound: proto.Float64(0.005), CumulativeCount: proto.Uint64(9)},
		{UpperBound: proto.Float64(10), CumulativeCount: proto.Uint64(9)},
		{UpperBound: proto.Float64(math.Inf(1)), CumulativeCount: proto.Uint64(10)},
	}}
	label := func(k, v string) *dto.LabelPair { return &dto.LabelPair{Name: proto.String(k), Value: proto.String(v)} }
	fam := &dto.MetricFamily{Metric: []*dto.Metric{
		{Label: []*dto.LabelPair{label("verb", "filter"), label("result", "ok")}, Histogram: h},
		{Label: []*dto.LabelPair{label("verb", "filter"), label("result", "error")}, Histogram: h},
	}}
	s := summariseHistogram(fam, "verb")["filter"]
	if s.count != 20 || s.mean != 1.1 {
		t.Fatalf("merged series: %+v", s)
	}
	// rank 10 of 20 falls in the second bucket (8..18): 1ms + 4ms x 2/10.
	if math.Abs(s.p50-0.0018) > 1e-12 {
		t.Fatalf("p50 %v, want 0.0018", s.p50)
	}
	if s.p99 != 10 { // in the +Inf bucket: the last finite bound
		t.Fatalf("p99 %v, want 10", s.p99)
	}
	// Keyed by two labels: one series each.
	if by := summariseHistogram(fam, "verb,result"); len(by) != 2 || by["filter/ok"].count != 10 || by["filter/error"].count != 10 {
		t.Fatalf("by verb and result: %+v", by)
	}
}
