package placement

import (
	"math"
	"strings"
	"testing"
)

// The known answers below are what the FGD reference simulator computes
// (github.com/hkust-adsl/kubernetes-scheduler-simulator at 8f3d641): pkg/utils/frag.go
// NodeGpuShareFragAmount (l.147), GetNodePodFrag (l.556), CanNodeHostPodOnGpuMemory (l.543),
// GetGpuFragMilliByNodeResAndPodRes (l.184), pkg/utils/utils.go IsNodeAccessibleToPodByType (l.956),
// and pkg/simulator/plugin/fgd_score.go calculateGpuShareFragExtendScore (l.62). They were worked out
// with a line-by-line port of those functions, not with this package.

// katNode is a node of the cases: CPU capacity and use, GPU model, per-GPU compute in use by shares
// (per-mille; -1 = held whole).
type katNode struct {
	cpu, usedCPU int64
	model        string
	used         []int
}

var katNodes = map[string]katNode{
	"empty8":   {96000, 0, "V100M16", []int{0, 0, 0, 0, 0, 0, 0, 0}},
	"cpuPoor8": {96000, 92000, "V100M16", []int{0, 0, 0, 0, 0, 0, 0, 0}},
	"mixed8":   {96000, 40000, "V100M16", []int{500, 700, -1, 0, 0, 300, 1000, 0}},
	"shared2":  {64000, 8000, "P100", []int{600, 250}},
	"full2":    {64000, 60000, "P100", []int{-1, 900}},
	"cpuLeft0": {32000, 32000, "T4", []int{0, 0}},
	"oneFree4": {96000, 16000, "A10", []int{-1, -1, -1, 0}},
	"halfs4":   {96000, 10000, "A10", []int{500, 500, 500, 500}},
}

func (k katNode) state() *NodeState {
	n := &NodeState{CPUMilli: k.cpu, UsedCPU: k.usedCPU, MemMiB: 1 << 20}
	for i, u := range k.used {
		g := GPUState{Index: i, Model: k.model, Usable: true}
		switch {
		case u < 0:
			g.Whole = true
		case u > 0:
			g.Shares, g.UsedMilli = 1, u
		}
		n.GPUs = append(n.GPUs, g)
	}
	n.Prepare()
	return n
}

// katShapes are task shapes as the trace writes them: cpu_milli, gpu_milli, num_gpu, gpu_spec.
var katShapes = map[string]Request{
	"cpuOnly4":  {CPUMilli: 4000},
	"share500":  {CPUMilli: 6000, Containers: []ContainerShape{{Shares: 1, Milli: 500}}},
	"share250":  {CPUMilli: 8000, Containers: []ContainerShape{{Shares: 1, Milli: 250}}},
	"whole1":    {CPUMilli: 12000, Containers: []ContainerShape{{Whole: 1}}},
	"whole2":    {CPUMilli: 16000, Containers: []ContainerShape{{Whole: 2}}},
	"whole8":    {CPUMilli: 64000, Containers: []ContainerShape{{Whole: 8}}},
	"shareV100": {CPUMilli: 4000, Containers: []ContainerShape{{Shares: 1, Milli: 300}}, Models: []string{"V100M16", "V100M32"}},
	"wholeT4":   {CPUMilli: 8000, Containers: []ContainerShape{{Whole: 1}}, Models: []string{"T4"}},
}

// TestFragmentationKnownAnswers pins FGD's fragmentation of one node for one shape (weight 1) to the
// reference's values. It kills "removing partial-GPU fragmentation" (the Q3 cases with partial GPUs:
// mixed8, shared2, full2), dropping CPU-only shapes (cpuOnly4) and counting host memory.
func TestFragmentationKnownAnswers(t *testing.T) {
	cases := []struct {
		node, shape string
		want        float64
	}{
		{"empty8", "cpuOnly4", 8000}, // XL: a CPU-only task uses no GPU: all free GPU is a fragment to it
		{"empty8", "share500", 0},
		{"empty8", "whole8", 0},
		{"empty8", "wholeT4", 8000}, // no access: a V100 node for a T4-only task
		{"cpuPoor8", "share500", 8000},
		{"cpuPoor8", "cpuOnly4", 8000},
		{"cpuPoor8", "whole1", 8000}, // Q4: lacks CPU
		{"mixed8", "share500", 300},  // Q3: the GPUs with less than 500 free (300 + 0 + 0 whole)
		{"mixed8", "share250", 0},
		{"mixed8", "whole1", 1500}, // Q3: partial GPUs 500 + 300 + 700 are fragments to a whole-GPU task
		{"mixed8", "whole2", 1500},
		{"mixed8", "whole8", 4500}, // Q2: too few free GPUs: everything
		{"mixed8", "shareV100", 0},
		{"mixed8", "cpuOnly4", 4500},
		{"shared2", "share500", 400},
		{"shared2", "share250", 0},
		{"shared2", "whole1", 1150},
		{"full2", "share500", 100}, // Q2 (100 free < 500)
		{"full2", "share250", 100}, // Q4: 4000 CPU left, the shape needs 8000
		{"full2", "cpuOnly4", 100},
		{"cpuLeft0", "wholeT4", 2000},
		{"cpuLeft0", "cpuOnly4", 2000}, // XR
		{"oneFree4", "whole1", 0},
		{"oneFree4", "whole2", 1000},
		{"oneFree4", "share500", 0},
		{"halfs4", "share500", 0},
		{"halfs4", "share250", 0},
		{"halfs4", "whole1", 2000},
	}
	for _, c := range cases {
		n := katNodes[c.node].state()
		got := NodeFragmentation(n, []Shape{{Req: katShapes[c.shape], Weight: 1}})
		if got != c.want {
			t.Errorf("%s for %s: fragmentation %g, the reference computes %g", c.node, c.shape, got, c.want)
		}
	}
}

// katMix is a typical-shape table with a CPU-only shape, as the reference's typical pods include them.
func katMix() []Shape {
	return []Shape{
		{Req: katShapes["share500"], Weight: 0.4},
		{Req: katShapes["whole1"], Weight: 0.3},
		{Req: katShapes["cpuOnly4"], Weight: 0.2},
		{Req: katShapes["whole2"], Weight: 0.1},
	}
}

// TestFragmentationMixKnownAnswers pins the weighted fragmentation over a shape mix.
func TestFragmentationMixKnownAnswers(t *testing.T) {
	want := map[string]float64{"empty8": 1600, "cpuPoor8": 8000, "mixed8": 1620, "shared2": 850, "full2": 100,
		"cpuLeft0": 2000, "oneFree4": 300, "halfs4": 1200}
	for name, w := range want {
		if got := NodeFragmentation(katNodes[name].state(), katMix()); math.Abs(got-w) > 1e-9 {
			t.Errorf("%s: mix fragmentation %g, the reference computes %g", name, got, w)
		}
	}
}

// TestFGDScoreKnownAnswers pins FGD's node score (sigmoid of the fragmentation gain, truncated to
// 0..100) of the best GPU for a 500-milli share to the reference's calculateGpuShareFragExtendScore.
// It kills a flipped sign of the FGD score.
func TestFGDScoreKnownAnswers(t *testing.T) {
	eng, err := NewEngine("fgd")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]struct {
		score float64
		gpu   int
	}{"empty8": {47, 0}, "mixed8": {57, 0}, "shared2": {54, 1}, "oneFree4": {50, 3}, "halfs4": {57, 0}}
	r := katShapes["share500"]
	for name, w := range want {
		sc := &ScoreContext{Shapes: katMix()}
		p, s, u := eng.Evaluate(sc, katNodes[name].state(), &r)
		if u != nil {
			t.Fatalf("%s: %v", name, u)
		}
		if s != w.score || len(p.Devices) != 1 || p.Devices[0].GPU != w.gpu {
			t.Errorf("%s: score %g on GPU %v, the reference scores %g on GPU %d", name, s, p.Devices, w.score, w.gpu)
		}
	}
}

// TestStrandedFloor pins tessera's multi-resource fragmentation on a node with free GPUs but little
// CPU: every GPU shape fits, so FGD sees no fragment, but at the mix's CPU per GPU (7600 CPU-milli per
// 700 GPU-milli) the 20 free CPUs feed only 1842 of the 8000 free GPU-milli. It kills removing the
// stranded-GPU floor.
func TestStrandedFloor(t *testing.T) {
	n := katNode{96000, 76000, "V100M16", []int{0, 0, 0, 0, 0, 0, 0, 0}}.state()
	if got := NodeFragmentation(n, katMix()); got != 1600 {
		t.Fatalf("fgd: %g, want 1600 (the CPU-only shape's 0.2 x 8000)", got)
	}
	want := 0.8 * (8000 - 20000*700.0/7600)
	if got := NodeFragmentationFed(n, katMix()); math.Abs(got-want) > 1e-6 {
		t.Fatalf("tessera: %g, want %g (0.8 of GPU shapes x the stranded compute)", got, want)
	}
	if got := NodeFragmentationFed(katNodes["empty8"].state(), katMix()); got != 0 {
		t.Fatalf("tessera on an empty balanced node: %g, want 0", got)
	}
}

// TestPoliciesPreferLessFragmentation checks the direction of both fragmentation policies: a share goes
// onto a half-used GPU rather than breaking a fresh node, a whole GPU onto the node whose CPU can
// feed it. A flipped sign of either score picks the other node.
func TestPoliciesPreferLessFragmentation(t *testing.T) {
	for _, policy := range []string{"fgd", "tessera"} {
		eng, err := NewEngine(policy)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range []struct {
			shape string
			nodes []string
			want  string
		}{
			{"share500", []string{"empty8", "halfs4"}, "halfs4"},
			{"share500", []string{"empty8", "mixed8"}, "mixed8"},
			{"whole1", []string{"empty8", "oneFree4"}, "oneFree4"},
		} {
			var nodes []*NodeState
			for _, name := range c.nodes {
				n := katNodes[name].state()
				n.Name = name
				nodes = append(nodes, n)
			}
			r := katShapes[c.shape]
			i, _ := eng.Pick(&ScoreContext{Shapes: katMix()}, nodes, &r, nil)
			if i < 0 || nodes[i].Name != c.want {
				t.Errorf("%s: %s among %s went to %v, want %s", policy, c.shape, strings.Join(c.nodes, ","), i, c.want)
			}
		}
	}
}

// TestFragmentationIgnoresHostMemory: the reference's measure has no host memory (GetNodePodFrag
// looks at CPU and GPU only), so a node whose memory is spent still offers its GPUs to FGD's shapes.
func TestFragmentationIgnoresHostMemory(t *testing.T) {
	n := katNodes["empty8"].state()
	n.UsedMem = n.MemMiB
	r := katShapes["share500"]
	r.MemMiB = 16384
	if got := NodeFragmentation(n, []Shape{{Req: r, Weight: 1}}); got != 0 {
		t.Fatalf("fragmentation %g with host memory spent, the reference computes 0", got)
	}
}
