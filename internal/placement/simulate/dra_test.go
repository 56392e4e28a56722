package simulate

import (
	"math/rand/v2"
	"testing"

	"github.com/tessera-gpu/tessera/internal/placement"
)

// draNode is a 4-GPU node of 32 CPUs and 128 GiB with the given compute (per-mille) used by shares
// on each GPU (-1: the GPU is held whole).
func draNode(name string, usedCPU, usedMem int64, used ...int) *placement.NodeState {
	n := &placement.NodeState{Name: name, CPUMilli: 32000, MemMiB: 131072, UsedCPU: usedCPU, UsedMem: usedMem}
	for g, u := range used {
		gs := placement.GPUState{Index: g, Model: "A", Usable: true}
		switch {
		case u < 0:
			gs.Whole = true
		case u > 0:
			gs.UsedMilli, gs.Shares = u, 1
		}
		n.GPUs = append(n.GPUs, gs)
	}
	n.Prepare()
	return n
}

// TestDRAFirstFit: the allocator takes the first device in publication order with room: by index,
// a 300-per-mille share lands on GPU 0 (empty) although GPU 2 has just that much left; published
// fullest first, it lands on GPU 2, and a share that fits no shared GPU on the first free one. A
// whole GPU is the first free one either way; a model the node lacks, or CPU the node does not
// have, fits nowhere.
func TestDRAFirstFit(t *testing.T) {
	n := draNode("n", 0, 0, 0, 500, 700, -1)
	share := &placement.Request{Containers: []placement.ContainerShape{{Name: "main", Shares: 1, Milli: 300}}}
	for _, tc := range []struct {
		name    string
		r       *placement.Request
		fullest bool
		gpu     int // -1: no fit
	}{
		{"share by index", share, false, 0},
		{"share fullest first", share, true, 2},
		{"bigger share fullest first", &placement.Request{Containers: []placement.ContainerShape{{Name: "main", Shares: 1, Milli: 600}}}, true, 0},
		{"whole by index", &placement.Request{Containers: []placement.ContainerShape{{Name: "main", Whole: 1}}}, false, 0},
		{"whole fullest first", &placement.Request{Containers: []placement.ContainerShape{{Name: "main", Whole: 1}}}, true, 0},
		{"other model", &placement.Request{Models: []string{"B"}, Containers: []placement.ContainerShape{{Name: "main", Whole: 1}}}, false, -1},
		{"too much CPU", &placement.Request{CPUMilli: 40000, Containers: []placement.ContainerShape{{Name: "main", Whole: 1}}}, false, -1},
	} {
		p, ok := firstFit(n, tc.r, tc.fullest)
		switch {
		case tc.gpu < 0 && ok:
			t.Errorf("%s: placed on GPU %d, want no fit", tc.name, p.Devices[0].GPU)
		case tc.gpu >= 0 && (!ok || len(p.Devices) != 1 || p.Devices[0].GPU != tc.gpu):
			t.Errorf("%s: %+v (fit %v), want GPU %d", tc.name, p, ok, tc.gpu)
		}
	}
}

// TestDRANodeScore: LeastAllocated prefers the emptier node, MostAllocated the fuller one, both
// with BalancedAllocation added (kube-scheduler's integer arithmetic: (fit over cpu and memory) /
// 2 + (1 - |cpu fraction - memory fraction| / 2) x 100); equal scores fall at random.
func TestDRANodeScore(t *testing.T) {
	empty, half := draNode("empty", 0, 0, 0, 0, 0, 0), draNode("half", 16000, 65536, 0, 0, 0, 0)
	r := &placement.Request{CPUMilli: 8000, MemMiB: 32768, Containers: []placement.ContainerShape{{Name: "main", Whole: 1}}}
	// empty: cpu and memory 25% requested with the pod -> least 75, most 25, balanced 100.
	if got := nodeScore(empty, r, false); got != 175 {
		t.Errorf("LeastAllocated on the empty node: %d, want 175", got)
	}
	if got := nodeScore(half, r, true); got != 175 {
		t.Errorf("MostAllocated on the half-used node: %d, want 75+100", got)
	}
	sc := &placement.ScoreContext{Rand: rand.New(rand.NewPCG(1, 2))}
	nodes := []*placement.NodeState{half, empty}
	if i, _ := draPick(sc, nodes, r, false, false); i != 1 {
		t.Errorf("LeastAllocated picked %s, want empty", nodes[i].Name)
	}
	if i, _ := draPick(sc, nodes, r, true, false); i != 0 {
		t.Errorf("MostAllocated picked %s, want half", nodes[i].Name)
	}
	twins := []*placement.NodeState{draNode("a", 0, 0, 0), draNode("b", 0, 0, 0)}
	seen := map[int]bool{}
	for range 64 {
		i, _ := draPick(sc, twins, r, false, false)
		seen[i] = true
	}
	if !seen[0] || !seen[1] {
		t.Errorf("equal scores always fell on one node: %v", seen)
	}
}

// TestDRAPoliciesOnlyInTheSimulator: the DRA policies run in the simulator and are unknown to the
// placement engine (never offered to live pods).
func TestDRAPoliciesOnlyInTheSimulator(t *testing.T) {
	nodes := []Node{{Name: "n0", CPUMilli: 32000, MemMiB: 131072, GPUs: 4, Model: "A"}}
	pods := []Pod{{Name: "p", CPUMilli: 1000, MemMiB: 1024, NumGPU: 1, GPUMilli: 1000}}
	c := NewCluster(nodes, pods)
	for _, p := range DRAPolicies {
		if _, err := placement.NewEngine(p); err == nil {
			t.Errorf("placement.NewEngine knows %s", p)
		}
		res, err := c.Run(p, 42, 1.3)
		// 130% of the 4 GPUs arrive as 1-GPU pods: 4 placed, the rest failed.
		if err != nil || res.Arrived-res.Failed != 4 {
			t.Errorf("%s: %v, %d of %d placed, want 4", p, err, res.Arrived-res.Failed, res.Arrived)
		}
	}
}
