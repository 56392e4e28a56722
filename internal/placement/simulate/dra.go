package simulate

import (
	"slices"
	"strings"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// How DRA claims are placed when the kube-scheduler's allocator, not the extender, chooses
// (docs/placement.md, "DRA claims placed by the scheduler, measured"): the node by the scheduler's
// own scores, which see CPU and memory but no DRA devices, and the devices inside it first fit over
// the order the driver publishes them in. These are simulator policies only, never offered to live
// pods (placement.NewEngine does not know them).
//
// Node scores, as kube-scheduler v1.37's default profile computes them for a pod with no
// affinities, owners or images: NodeResourcesFit (LeastAllocated by default, or MostAllocated)
// over cpu and memory at weight 1 each, plus NodeResourcesBalancedAllocation, both 0..100 in
// integer arithmetic; equal totals are broken at random (the scheduler samples among the best);
// every feasible node is scored (percentageOfNodesToScore: 100, as the placement benchmark sets).
// The pods' requests count as given (the scheduler's non-zero defaults for pods without a CPU or
// memory request are left out: the trace's pods all ask for CPU).

// DRA policy names: dra-<node>[-fullest]. The node by the scheduler's scores with NodeResourcesFit
// least (LeastAllocated, the scheduler's default) or most (MostAllocated), or by the tessera
// policy (tessera: the extender's filter choosing the node for pods with claims, the allocator
// still choosing the devices inside it). -fullest publishes each node's GPUs fullest first (shared
// GPUs by compute used, then the free ones), the device-order lever, instead of by index.
var DRAPolicies = []string{"dra-least", "dra-most", "dra-tessera", "dra-least-fullest", "dra-most-fullest", "dra-tessera-fullest"}

// IsDRAPolicy reports whether name is one of DRAPolicies.
func IsDRAPolicy(name string) bool { return slices.Contains(DRAPolicies, name) }

// picker chooses a node (index into nodes, -1: none) and a placement on it.
type picker func(sc *placement.ScoreContext, nodes []*placement.NodeState, r *placement.Request) (int, placement.Placement)

// pickerFor is the DRA picker for a DRA policy name, else the placement engine's.
func pickerFor(policy string) (picker, error) {
	fullest := strings.HasSuffix(policy, "-fullest")
	if strings.HasPrefix(policy, "dra-tessera") && IsDRAPolicy(policy) {
		eng, err := placement.NewEngine("tessera")
		if err != nil {
			return nil, err
		}
		return func(sc *placement.ScoreContext, nodes []*placement.NodeState, r *placement.Request) (int, placement.Placement) {
			i, _ := eng.Pick(sc, nodes, r, nil)
			if i < 0 {
				return -1, placement.Placement{}
			}
			p, ok := firstFit(nodes[i], r, fullest)
			if !ok {
				return -1, placement.Placement{}
			}
			return i, p
		}, nil
	}
	if IsDRAPolicy(policy) {
		most := strings.HasPrefix(policy, "dra-most")
		return func(sc *placement.ScoreContext, nodes []*placement.NodeState, r *placement.Request) (int, placement.Placement) {
			return draPick(sc, nodes, r, most, fullest)
		}, nil
	}
	eng, err := placement.NewEngine(policy)
	if err != nil {
		return nil, err
	}
	return func(sc *placement.ScoreContext, nodes []*placement.NodeState, r *placement.Request) (int, placement.Placement) {
		return eng.Pick(sc, nodes, r, nil)
	}, nil
}

// draPick scores every node where the allocator finds devices and the pod's CPU and memory fit,
// and returns a best one at random with the allocator's devices there.
func draPick(sc *placement.ScoreContext, nodes []*placement.NodeState, r *placement.Request, most, fullest bool) (int, placement.Placement) {
	best, ties := -1, 0
	var bestScore int64
	var bestP placement.Placement
	for i, n := range nodes {
		p, ok := firstFit(n, r, fullest)
		if !ok {
			continue
		}
		s := nodeScore(n, r, most)
		switch {
		case best < 0 || s > bestScore:
			best, bestScore, bestP, ties = i, s, p, 1
		case s == bestScore:
			// Reservoir sampling over equal scores, as the scheduler's selectHost does.
			ties++
			if sc.Rand.IntN(ties) == 0 {
				best, bestP = i, p
			}
		}
	}
	return best, bestP
}

// nodeScore is NodeResourcesFit plus NodeResourcesBalancedAllocation over cpu and memory, with
// the pod's requests added to what the node has requested.
func nodeScore(n *placement.NodeState, r *placement.Request, most bool) int64 {
	cpu, mem := n.UsedCPU+r.CPUMilli, n.UsedMem+r.MemMiB
	frac := func(req, capacity int64) int64 {
		if capacity == 0 {
			return 0
		}
		if most {
			return min(req, capacity) * 100 / capacity
		}
		if req > capacity {
			return 0
		}
		return (capacity - req) * 100 / capacity
	}
	fit := (frac(cpu, n.CPUMilli) + frac(mem, n.MemMiB)) / 2
	var fc, fm float64
	if n.CPUMilli > 0 {
		fc = min(1, float64(cpu)/float64(n.CPUMilli))
	}
	if n.MemMiB > 0 {
		fm = min(1, float64(mem)/float64(n.MemMiB))
	}
	std := (fc - fm) / 2
	if std < 0 {
		std = -std
	}
	return fit + int64((1-std)*100)
}

// firstFit is the DRA allocator's choice inside a node for the request's devices: each container's
// whole GPUs, then its shares, each the first device in publication order that is free whole (for a
// whole GPU) or has the share's compute left (a share's consumable capacity), of an allowed model,
// not already taken by this claim. ok is false when the node cannot hold the pod (the devices or
// its CPU and memory).
func firstFit(n *placement.NodeState, r *placement.Request, fullest bool) (placement.Placement, bool) {
	if n.CPUMilli > 0 && n.UsedCPU+r.CPUMilli > n.CPUMilli || n.MemMiB > 0 && n.UsedMem+r.MemMiB > n.MemMiB {
		return placement.Placement{}, false
	}
	order := make([]int, len(n.GPUs))
	for i := range order {
		order[i] = i
	}
	if fullest {
		// Shared GPUs by compute used (fullest first), then the free ones, each in index order.
		slices.SortStableFunc(order, func(a, b int) int {
			ga, gb := &n.GPUs[a], &n.GPUs[b]
			return gb.UsedMilli - ga.UsedMilli
		})
	}
	allowed := func(model string) bool { return len(r.Models) == 0 || api.GPUModelMatchesAny(r.Models, model) }
	taken := make([]bool, len(n.GPUs))
	var p placement.Placement
	for ci, c := range r.Containers {
		for range c.Whole {
			g := slices.IndexFunc(order, func(g int) bool { return !taken[g] && n.GPUs[g].FreeWhole() && allowed(n.GPUs[g].Model) })
			if g < 0 {
				return placement.Placement{}, false
			}
			taken[order[g]] = true
			p.Devices = append(p.Devices, placement.Device{Container: ci, GPU: order[g], Whole: true})
		}
		for range c.Shares {
			g := slices.IndexFunc(order, func(g int) bool {
				return !taken[g] && n.GPUs[g].FreeMilli() >= c.Milli && allowed(n.GPUs[g].Model)
			})
			if g < 0 {
				return placement.Placement{}, false
			}
			taken[order[g]] = true
			p.Devices = append(p.Devices, placement.Device{Container: ci, GPU: order[g], Milli: c.Milli})
		}
	}
	if !placement.Fits(n, r, &p) {
		return placement.Placement{}, false
	}
	return p, true
}
