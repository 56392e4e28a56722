package placement

import (
	"math"
	"testing"
)

// reachMix: 1-GPU pods most of all, 2-GPU pods, and a few 8-GPU pods that only a fifth of the
// capacity could host (Reach 0.2: most 8-GPU nodes split into 2-GPU ones). CPU in proportion to
// the GPUs (4 CPUs each), so nothing is stranded on the test's nodes.
func reachMix(reach8 float64) []Shape {
	return []Shape{
		{Req: Request{CPUMilli: 4000, Containers: []ContainerShape{{Whole: 1}}}, Weight: 0.67, Reach: 1},
		{Req: Request{CPUMilli: 8000, Containers: []ContainerShape{{Whole: 2}}}, Weight: 0.3, Reach: 1},
		{Req: Request{CPUMilli: 32000, Containers: []ContainerShape{{Whole: 8}}}, Weight: 0.03, Reach: reach8},
	}
}

// TestReachWeighsFragments pins tessera's measure with Shape.Reach: an 8-GPU node with one GPU used
// leaves 7,000 the 8-GPU shape cannot use. Weighed by 1/Reach, total kept (0.67 + 0.3 + 0.03/0.2 =
// 1.12 scaled back to 1): 7,000 x 0.15/1.12 = 937.5; with reach 1 (or not known, 0) 7,000 x 0.03 =
// 210; FGD ignores reach: 210.
func TestReachWeighsFragments(t *testing.T) {
	n := katNode{96000, 4000, "G2", []int{-1, 0, 0, 0, 0, 0, 0, 0}}.state()
	for _, c := range []struct {
		reach8 float64
		m      measure
		want   float64
	}{
		{0.2, measureFed, 7000 * 0.15 / 1.12},
		{0.2, measureFedNoFloor, 7000 * 0.15 / 1.12},
		{1, measureFed, 210},
		{0, measureFed, 210},
		{0.2, measureFGD, 210},
	} {
		if got := fragmentation(n, reachMix(c.reach8), c.m); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("reach %g measure %d: %g, want %g", c.reach8, c.m, got, c.want)
		}
	}
}

// TestReachKeepsScarceNodesWhole: a 1-GPU pod, an empty 8-GPU node and an empty 2-GPU node. On the
// 8-GPU node the pod leaves 7 GPUs the 8-GPU shape cannot use (7,000 x its weight); on the 2-GPU node
// it leaves one GPU the 2-GPU shape cannot use (1,000 x 0.3) and takes one of the two the 8-GPU
// shape could never use. By popularity (FGD, and tessera were every node able to host the 8-GPU
// pods) the 8-GPU node costs less (210 against 270); weighed by reach (the 8-GPU pods' only homes
// are a fifth of the capacity) it costs 937.5 against 134, and tessera keeps it whole for them,
// whichever node comes first.
func TestReachKeepsScarceNodesWhole(t *testing.T) {
	r := Request{CPUMilli: 4000, Containers: []ContainerShape{{Whole: 1}}}
	for _, c := range []struct {
		policy string
		reach8 float64
		want   string
	}{{"tessera", 0.2, "two"}, {"tessera", 1, "eight"}, {"fgd", 0.2, "eight"}} {
		eng, err := NewEngine(c.policy)
		if err != nil {
			t.Fatal(err)
		}
		for _, eightFirst := range []bool{true, false} {
			eight := katNode{32000, 0, "G2", []int{0, 0, 0, 0, 0, 0, 0, 0}}.state()
			two := katNode{8000, 0, "G2", []int{0, 0}}.state()
			eight.Name, two.Name = "eight", "two"
			nodes := []*NodeState{two, eight}
			if eightFirst {
				nodes = []*NodeState{eight, two}
			}
			i, _ := eng.Pick(&ScoreContext{Shapes: reachMix(c.reach8)}, nodes, &r, nil)
			if i < 0 || nodes[i].Name != c.want {
				t.Errorf("%s, 8-GPU reach %g (8-GPU node first: %t): picked %v, want %s", c.policy, c.reach8, eightFirst, i, c.want)
			}
		}
	}
}

// TestShapeReachFromCapacity: on an empty cluster the snapshot's Reach is the share of the GPU
// capacity of the shape's models on nodes that could host it (enough GPUs, CPU, memory), from the nodes reported
// (AddNodeFree); a node taken away leaves it. A model-restricted shape's reach is within its models
// (the model pressure weighs the models' scarcity).
func TestShapeReachFromCapacity(t *testing.T) {
	st := NewShapeStats()
	eight := katNode{96000, 0, "G2", []int{0, 0, 0, 0, 0, 0, 0, 0}}.state()
	eight.TypeID = 1
	var twos []*NodeState
	for range 4 {
		n := katNode{24000, 0, "G2", []int{0, 0}}.state()
		n.TypeID = 2
		twos = append(twos, n)
	}
	t4 := katNode{104000, 0, "T4", []int{0, 0}}.state()
	t4.TypeID = 3
	for _, n := range append([]*NodeState{eight, t4}, twos...) {
		st.AddNodeFree(n, 1)
	}
	shapes := map[string]*Request{
		"whole1":  {CPUMilli: 4000, Containers: []ContainerShape{{Whole: 1}}},
		"whole8":  {CPUMilli: 64000, Containers: []ContainerShape{{Whole: 8}}},
		"cpu30":   {CPUMilli: 30000, Containers: []ContainerShape{{Whole: 1}}},
		"t4only":  {CPUMilli: 4000, Containers: []ContainerShape{{Whole: 2}}, Models: []string{"T4"}},
		"share":   {CPUMilli: 2000, Containers: []ContainerShape{{Shares: 1, Milli: 300}}},
		"bigmem":  {CPUMilli: 1000, MemMiB: 2 << 20, Containers: []ContainerShape{{Whole: 1}}},
		"cpuOnly": {CPUMilli: 4000},
	}
	for _, r := range shapes {
		st.Observe(r, 1)
	}
	// 18 GPUs: 8 on the 8-GPU node (96 CPUs), 2 on the T4 (104), 8 on four 2-GPU nodes (24 each);
	// katNode gives every node 1 TiB of memory, so 2 TiB fits none.
	want := map[string]float64{"whole1": 1, "whole8": 8.0 / 18, "cpu30": 10.0 / 18, "t4only": 1, "share": 1, "bigmem": 0, "cpuOnly": 0}
	check := func(want map[string]float64) {
		t.Helper()
		for _, sh := range st.Typical() {
			ks, _ := keyOf(&sh.Req)
			for name, r := range shapes {
				if kr, _ := keyOf(r); kr == ks {
					if math.Abs(sh.Reach-want[name]) > 1e-12 {
						t.Errorf("%s: reach %g, want %g", name, sh.Reach, want[name])
					}
				}
			}
		}
	}
	check(want)
	st.AddNodeFree(eight, -1) // gone: the 8-GPU shape has no home; the next snapshot says so
	for _, r := range shapes {
		st.Observe(r, 1)
	}
	check(map[string]float64{"whole1": 1, "whole8": 0, "cpu30": 0.2, "t4only": 1, "share": 1, "bigmem": 0, "cpuOnly": 0})
}

// TestReachFollowsFreeCapacity: Reach is the share of the free compute on nodes that could host the
// shape now, and a snapshot takes the new reach (with a version, plan and fragmentation cache of its
// own) once it moved by more than reachMove, not before: one GPU taken on the only 8-GPU node leaves
// the 8-GPU shape no home; a 10-per-mille share on a 2-GPU node moves nothing past the threshold.
func TestReachFollowsFreeCapacity(t *testing.T) {
	st := NewShapeStats()
	eight := katNode{96000, 0, "G2", []int{0, 0, 0, 0, 0, 0, 0, 0}}.state()
	var twos []*NodeState
	for range 4 {
		twos = append(twos, katNode{24000, 0, "G2", []int{0, 0}}.state())
	}
	for _, n := range append([]*NodeState{eight}, twos...) {
		st.AddNodeFree(n, 1)
	}
	whole1 := &Request{CPUMilli: 4000, Containers: []ContainerShape{{Whole: 1}}}
	whole8 := &Request{CPUMilli: 64000, Containers: []ContainerShape{{Whole: 8}}}
	share := &Request{CPUMilli: 2000, Containers: []ContainerShape{{Shares: 1, Milli: 300}}}
	for _, r := range []*Request{whole1, whole8, share} {
		st.Observe(r, 1)
	}
	reach := func() (map[int]float64, *ScoreContext) {
		sc := st.ScoreContext()
		out := map[int]float64{}
		for _, sh := range sc.Shapes {
			out[sh.Req.Containers[0].Whole] = sh.Reach
		}
		return out, sc
	}
	apply := func(n *NodeState, r *Request, p Placement) {
		st.AddNodeFree(n, -1)
		n.Apply(r, &p)
		st.AddNodeFree(n, 1)
	}
	got, sc0 := reach()
	if got[8] != 0.5 || got[1] != 1 || got[0] != 1 {
		t.Fatalf("empty cluster: reach %v, want 8-GPU 0.5, others 1", got)
	}
	apply(twos[0], share, Placement{Devices: []Device{{GPU: 0, Milli: 10}}})
	if _, sc := reach(); sc.Snapshot != sc0.Snapshot {
		t.Fatalf("reach moved by %g, below reachMove: snapshot %d -> %d", 1-16000/15990.0, sc0.Snapshot, sc.Snapshot)
	}
	apply(eight, whole1, Placement{Devices: []Device{{GPU: 0, Whole: true}}})
	got, sc := reach()
	if got[8] != 0 || got[1] != 1 {
		t.Fatalf("8-GPU node no longer whole: reach %v, want 8-GPU 0, 1-GPU 1", got)
	}
	if sc.Snapshot == sc0.Snapshot || sc.Cache == sc0.Cache || sc.plan == sc0.plan {
		t.Fatal("reach moved but the snapshot kept its version, cache or plan")
	}
	for _, sh := range sc0.Shapes {
		if sh.Req.Containers[0].Whole == 8 && sh.Reach != 0.5 {
			t.Fatalf("the old snapshot's table was changed in place: 8-GPU reach %g", sh.Reach)
		}
	}
}

// TestReachSeesBigNodesFill: the same 1-GPU pod and the same two candidates, an empty 8-GPU node and
// an empty 2-GPU node, with reachMix's 1-GPU, 2-GPU and 8-GPU pods observed 62 : 30 : 3. While the
// cluster's four 8-GPU nodes are empty the 8-GPU shape's reach is 32/34 and breaking the 8-GPU node
// costs less (the flip is at reach 0.8: 30 > 8 x 3 / reach); once the other three have one GPU
// taken each, only the candidate could host an 8-GPU pod (reach 8/31) and tessera keeps it whole.
// A reach fixed at the empty cluster picks the 8-GPU node both times.
func TestReachSeesBigNodesFill(t *testing.T) {
	eng, err := NewEngine("tessera")
	if err != nil {
		t.Fatal(err)
	}
	for _, eightFirst := range []bool{true, false} {
		st := NewShapeStats()
		for i, n := range []int{62, 30, 3} {
			r := reachMix(0)[i].Req
			st.Observe(&r, n)
		}
		for i := range 5 { // a tail beyond the typical shapes' 95%, so that the 8-GPU shape is typical
			st.Observe(&Request{CPUMilli: int64(1000 + i), Containers: []ContainerShape{{Whole: 1}}}, 1)
		}
		eight := katNode{32000, 0, "G2", []int{0, 0, 0, 0, 0, 0, 0, 0}}.state()
		two := katNode{8000, 0, "G2", []int{0, 0}}.state()
		eight.Name, two.Name = "eight", "two"
		others := []*NodeState{}
		for range 3 {
			others = append(others, katNode{32000, 0, "G2", []int{0, 0, 0, 0, 0, 0, 0, 0}}.state())
		}
		for _, n := range append([]*NodeState{eight, two}, others...) {
			st.AddNodeFree(n, 1)
		}
		cands := []*NodeState{two, eight}
		if eightFirst {
			cands = []*NodeState{eight, two}
		}
		r := reachMix(0)[0].Req
		pick := func() string {
			i, _ := eng.Pick(st.ScoreContext(), cands, &r, nil)
			if i < 0 {
				t.Fatal("no node picked")
			}
			return cands[i].Name
		}
		if got := pick(); got != "eight" {
			t.Errorf("every 8-GPU node empty (8-GPU node first: %t): picked %s, want eight", eightFirst, got)
		}
		for _, n := range others {
			st.AddNodeFree(n, -1)
			n.Apply(&r, &Placement{Devices: []Device{{GPU: 0, Whole: true}}})
			st.AddNodeFree(n, 1)
		}
		if got := pick(); got != "two" {
			t.Errorf("the candidate is the last whole 8-GPU node (8-GPU node first: %t): picked %s, want two", eightFirst, got)
		}
	}
}
