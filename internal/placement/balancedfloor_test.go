package placement

import (
	"math"
	"testing"
)

// wholeMix is one whole-GPU shape of 12 CPUs per GPU: the mix feeds 1000 per-mille of compute per 12
// CPUs.
func wholeMix() []Shape { return []Shape{{Req: katShapes["whole1"], Weight: 1}} }

// TestBalancedFloorKnownAnswers pins the two-sided floor (measureFedBalanced, what tessera scores by
// in a host-bound cluster) against the one-sided one (measureFed), worked out by hand from the mix's
// 1000 per 12 CPUs: a node with one free GPU and 48 free CPUs feeds 4000 and has 1000 free, so 3000
// apart (nothing stranded); a 4-GPU node with 24 CPUs feeds 2000 of its 4000 (2000 stranded, both);
// a node in the mix's proportion has neither; a node without free compute counts nothing; where a
// GPU too full for the shape leaves more than the floor, that counts (max(floor, v)).
func TestBalancedFloorKnownAnswers(t *testing.T) {
	for _, c := range []struct {
		name          string
		node          katNode
		fed, balanced float64
	}{
		{"spare CPU, one GPU free", katNode{48000, 0, "A", []int{-1, -1, -1, 0}}, 0, 3000},
		{"short CPU", katNode{24000, 0, "A", []int{0, 0, 0, 0}}, 2000, 2000},
		{"in proportion", katNode{24000, 0, "A", []int{0, 0}}, 0, 0},
		{"no free compute", katNode{48000, 0, "A", []int{-1, -1}}, 0, 0},
		// 1500 free (500 on a shared GPU the whole shape cannot use), 36 CPUs free feed 3000.
		{"spare CPU beside a shared GPU", katNode{48000, 12000, "A", []int{500, 0}}, 500, 1500},
		// 1500 free, 12 CPUs feed 1000: stranded 500, the shared GPU's 500 the same.
		{"short beside a shared GPU", katNode{48000, 36000, "A", []int{500, 0}}, 500, 500},
	} {
		n := c.node.state()
		if got := fragmentation(n, wholeMix(), measureFed); math.Abs(got-c.fed) > 1e-9 {
			t.Errorf("%s: one-sided %g, want %g", c.name, got, c.fed)
		}
		if got := fragmentation(n, wholeMix(), measureFedBalanced); math.Abs(got-c.balanced) > 1e-9 {
			t.Errorf("%s: two-sided %g, want %g", c.name, got, c.balanced)
		}
	}
}

// TestHostBoundFinishesSpareCPUNodes: a GPU-hungry 1-GPU pod (4 CPUs, a third of the mix's 12 per
// GPU), a node with its last GPU free and 48 CPUs to spare, and an empty node in the mix's
// proportion (4 GPUs, 48 CPUs). With the one-sided floor nothing is stranded either way and the
// two tie (the first node wins, the empty one when it comes first). In a host-bound cluster tessera
// scores with the two-sided floor: taking the last GPU ends the first node's 3000 apart (gain 3000),
// breaking the empty node leaves 3 GPUs beside 44 CPUs that feed 3667 (gain -667), so the pod
// finishes the node with CPU to spare and the empty node stays whole for a larger pod, whichever
// comes first. Not host-bound, the measure is the one-sided floor as before.
func TestHostBoundFinishesSpareCPUNodes(t *testing.T) {
	pod := Request{CPUMilli: 4000, Containers: []ContainerShape{{Whole: 1}}}
	eng, err := NewEngine("tessera")
	if err != nil {
		t.Fatal(err)
	}
	for _, spareFirst := range []bool{true, false} {
		spare := katNode{48000, 0, "A", []int{-1, -1, -1, 0}}.state()
		empty := katNode{48000, 0, "A", []int{0, 0, 0, 0}}.state()
		spare.Name, empty.Name = "spare", "empty"
		nodes := []*NodeState{spare, empty}
		if !spareFirst {
			nodes = []*NodeState{empty, spare}
		}
		i, _ := eng.Pick(&ScoreContext{Shapes: wholeMix(), HostBound: true}, nodes, &pod, nil)
		if i < 0 || nodes[i].Name != "spare" {
			t.Errorf("host-bound (spare node first: %t): picked %v, want the spare node", spareFirst, i)
		}
		if i, _ := eng.Pick(&ScoreContext{Shapes: wholeMix()}, nodes, &pod, nil); i != 0 {
			t.Errorf("not host-bound (spare node first: %t): picked %v, want the first node (a tie under the one-sided floor)", spareFirst, i)
		}
	}
}

// TestHostBoundCountsCPUOnlyPods: the verdict weighs the CPU-only pods' CPU beside the GPU pods'. A
// node of 12 CPUs per GPU serves a mix of 12-CPU 1-GPU pods exactly (not host-bound); once as many
// 4-CPU CPU-only pods are typical, the mix asks 16 CPUs per GPU and the cluster is host-bound.
func TestHostBoundCountsCPUOnlyPods(t *testing.T) {
	st := NewShapeStats()
	whole, cpuOnly := katShapes["whole1"], Request{CPUMilli: 4000}
	for range 10 {
		st.Observe(&whole, 1)
	}
	st.AddNodeFree(katNode{96000, 0, "A", []int{0, 0, 0, 0, 0, 0, 0, 0}}.state(), 1)
	if st.ScoreContext().HostBound {
		t.Fatal("host-bound with the CPU per GPU the GPU pods ask and no CPU-only pods")
	}
	for range 10 {
		st.Observe(&cpuOnly, 1)
	}
	if !st.ScoreContext().HostBound {
		t.Fatal("not host-bound with CPU-only pods asking another 4 CPUs per GPU pod")
	}
}
