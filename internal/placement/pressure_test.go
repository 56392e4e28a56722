package placement

import (
	"math"
	"strings"
	"testing"
)

// wholeGPU is a 1-GPU request restricted to models (none: any).
func wholeGPU(models ...string) *Request {
	return &Request{CPUMilli: 4000, Containers: []ContainerShape{{Whole: 1}}, Models: models}
}

// TestPressureKnownAnswers pins pressureOf's coefficients, W·(1 - min(1, r(M))) with
// r(M) = Σ_{S ∋ M} request(S)/request · free/free(S), on hand-computed cases.
func TestPressureKnownAnswers(t *testing.T) {
	for _, c := range []struct {
		name string
		// observed pods: count per allowed set ("" unrestricted), each asking one whole GPU
		pods map[string]int
		free map[string]int64
		want map[string]float64
	}{
		// T4-only pods ask 20% of the request; T4 holds 20% of the free compute: r(T4) = 1, nothing
		// left for others there; G2 is wanted by no restricted pod: coefficient W = 0.2.
		{"saturated", map[string]int{"": 80, "T4": 20}, map[string]int64{"G2": 8000, "T4": 2000}, map[string]float64{"G2": 0.2, "T4": 0}},
		// Half as many T4-only pods: r(T4) = 0.1/0.2 = 0.5.
		{"half", map[string]int{"": 90, "T4": 10}, map[string]int64{"G2": 8000, "T4": 2000}, map[string]float64{"G2": 0.1, "T4": 0.05}},
		// A set of both models spreads over their free compute: r(T4) = 20/110·5 + 10/110·1 = 1,
		// r(G2) = 10/110; W = 30/110.
		{"set", map[string]int{"": 80, "T4": 20, "G2|T4": 10}, map[string]int64{"G2": 8000, "T4": 2000},
			map[string]float64{"G2": 30.0 / 110 * (1 - 10.0/110), "T4": 0}},
		// The T4 GPUs are full: nothing to protect there (its set is skipped), and its pods still count in W.
		{"full", map[string]int{"": 80, "T4": 20}, map[string]int64{"G2": 8000, "T4": 0}, map[string]float64{"G2": 0.2, "T4": 0.2}},
		// The same share restricted to models in proportion to their free compute: equal coefficients.
		{"proportional", map[string]int{"": 50, "T4": 10, "G2": 40}, map[string]int64{"G2": 8000, "T4": 2000}, map[string]float64{"G2": 0.25, "T4": 0.25}},
	} {
		t.Run(c.name, func(t *testing.T) {
			st := NewShapeStats()
			for set, n := range c.pods {
				var models []string
				if set != "" {
					models = strings.Split(set, "|")
				}
				for range n {
					st.Observe(wholeGPU(models...), 1)
				}
			}
			p := pressureOf(st.restricted, st.gpuPods, st.gpuMilli, c.free)
			if p == nil {
				t.Fatal("no pressure")
			}
			for m, want := range c.want {
				if got := p.coef[m]; math.Abs(got-want) > 1e-12 {
					t.Errorf("coef(%s) = %v, want %v", m, got, want)
				}
			}
		})
	}
	if p := pressureOf(map[string]*setDemand{}, 10, 10000, map[string]int64{"G2": 8000}); p != nil {
		t.Errorf("no restricted pods: pressure %+v, want none", p)
	}
}

// TestPressureSteersUnrestrictedPods: two empty 2-GPU nodes alike but for the model. T4-only pods
// ask for as much as the T4 GPUs hold; G2-only pods for a tenth of G2's. An unrestricted pod goes to
// the G2 node whichever node comes first; with nothing restricted it goes to the first (a tie). fgd
// keeps its own measure (no pressure).
func TestPressureSteersUnrestrictedPods(t *testing.T) {
	for _, restricted := range []bool{true, false} {
		for _, t4First := range []bool{true, false} {
			t4 := katNode{64000, 0, "T4", []int{0, 0}}.state()
			g2 := katNode{64000, 0, "G2", []int{0, 0}}.state()
			t4.Name, g2.Name = "t4", "g2"
			nodes := []*NodeState{g2, t4}
			if t4First {
				nodes = []*NodeState{t4, g2}
			}
			st := NewShapeStats()
			for range 60 {
				st.Observe(wholeGPU(), 1)
			}
			for range 20 {
				if restricted {
					st.Observe(wholeGPU("T4"), 1)
					st.Observe(wholeGPU("G2"), 1)
				} else {
					st.Observe(wholeGPU(), 2)
				}
			}
			for _, n := range nodes {
				st.AddNodeFree(n, 1)
			}
			// The cluster beyond these two nodes: G2 has 10x the T4 compute.
			st.AddNodeFree(katNode{64000, 0, "G2", []int{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}}.state(), 1)
			eng, err := NewEngine("tessera")
			if err != nil {
				t.Fatal(err)
			}
			sc := st.ScoreContext()
			if restricted != (sc.pressure != nil) {
				t.Fatalf("restricted pods %t: pressure %+v", restricted, sc.pressure)
			}
			i, _ := eng.Pick(sc, nodes, wholeGPU(), nil)
			want := nodes[0].Name
			if restricted {
				want = "g2"
			}
			if i < 0 || nodes[i].Name != want {
				t.Errorf("restricted %t, T4 first %t: picked %v, want %s", restricted, t4First, i, want)
			}
		}
	}
}

// TestPressureRebuildsOnlyPastTheThreshold: a move of the free compute that shifts a coefficient
// by less than pressureMove of W keeps the snapshot; a larger one makes a new snapshot with the
// same shapes, fragmentation cache and plan, and new coefficients.
func TestPressureRebuildsOnlyPastTheThreshold(t *testing.T) {
	st := NewShapeStats()
	for range 80 {
		st.Observe(wholeGPU(), 1)
	}
	for range 20 {
		st.Observe(wholeGPU("T4"), 1)
	}
	g2 := katNode{64000, 0, "G2", []int{0, 0, 0, 0, 0, 0, 0, 0}}.state()
	t4 := katNode{64000, 0, "T4", []int{0, 0, 0, 0, 0, 0, 0, 0}}.state()
	st.AddNodeFree(g2, 1)
	st.AddNodeFree(t4, 1)
	first := st.ScoreContext()
	if first.pressure == nil {
		t.Fatal("no pressure")
	}
	// r(T4) = 0.2·16000/8000 = 0.4: coef 0.12. Filling one G2 GPU: r(T4) = 0.2·15/8 = 0.375, coef
	// 0.125 (moved 0.005 < 0.05·0.2).
	st.AddNodeFree(g2, -1)
	g2.Apply(wholeGPU(), &Placement{Devices: []Device{{GPU: 0, Whole: true}}})
	st.AddNodeFree(g2, 1)
	if sc := st.ScoreContext(); sc.Snapshot != first.Snapshot {
		t.Fatalf("snapshot %d after a small move, want %d kept", sc.Snapshot, first.Snapshot)
	}
	// Filling four more: r(T4) = 0.2·11/8 = 0.275, coef 0.145 (moved 0.025 > 0.01).
	st.AddNodeFree(g2, -1)
	for i := 1; i <= 4; i++ {
		g2.Apply(wholeGPU(), &Placement{Devices: []Device{{GPU: i, Whole: true}}})
	}
	st.AddNodeFree(g2, 1)
	sc := st.ScoreContext()
	if sc.Snapshot <= first.Snapshot {
		t.Fatalf("snapshot %d after a large move, want a new one", sc.Snapshot)
	}
	if &sc.Shapes[0] != &first.Shapes[0] || sc.Cache != first.Cache || sc.plan != first.plan {
		t.Fatal("a pressure-only snapshot must keep the shapes, the fragmentation cache and the plan")
	}
	if got, want := sc.pressure.coef["T4"], 0.2*(1-0.2*11/8); math.Abs(got-want) > 1e-12 {
		t.Fatalf("coef(T4) = %v, want %v", got, want)
	}
	if got := st.FreeCompute(); got["G2"] != 3000 || got["T4"] != 8000 {
		t.Fatalf("free compute %v, want G2 3000, T4 8000", got)
	}
}
