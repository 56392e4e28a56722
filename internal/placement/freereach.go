package placement

import "math"

// freeReach keeps, for each GPU shape of the latest typical-shape table, the cluster's free GPU
// compute of the shape's models and the part of it on nodes that could host the shape now (Shape.
// Reach): as the nodes that can take a big shape fill, its reach falls and tessera's measure weighs
// what is left of them higher (fragPlan.weighByReach). A reach fixed at the empty cluster does not
// see the last free 8-GPU nodes getting scarce (docs/placement.md "Cluster-shape variants").
//
// Nodes are counted by their free state (freeState), so a new table is summed over the distinct
// states, and each reported change costs one test per shape.
type freeReach struct {
	nodes  map[freeState]int
	shapes []Shape // the table the sums are for (its GPU shapes; others are skipped)
	fit    []int64
	all    []int64
}

// freeState is what decides whether a node could host a shape now: its GPU model, its free whole
// GPUs, the most compute free on one of its shared GPUs, its free GPU compute, and its CPU and
// memory (math.MaxInt64: not tracked). CPU and memory are the node's capacity, not what is free:
// the CPU left is the stranded floor's to weigh (NodeFragmentationFed), and counting it here too
// made every CPU-hungry shape's reach collapse as a CPU-starved cluster fills (host=0.5,
// multigpu-request=0.3, seeds 42-45: 41.16 against 38.44 with capacity). Nodes of several GPU
// models (rare) are left out.
type freeState struct {
	cpu, mem int64
	model    string
	whole    int
	part     int
	free     int64
}

func freeStateOf(n *NodeState) (freeState, bool) {
	k := freeState{cpu: math.MaxInt64, mem: math.MaxInt64}
	if n.CPUMilli > 0 {
		k.cpu = n.CPUMilli
	}
	if n.MemMiB > 0 {
		k.mem = n.MemMiB
	}
	first := true
	for i := range n.GPUs {
		g := &n.GPUs[i]
		if !g.Usable {
			continue
		}
		if first {
			k.model, first = g.Model, false
		} else if g.Model != k.model {
			return k, false
		}
		f := g.FreeMilli()
		k.free += int64(f)
		switch {
		case g.FreeWhole():
			k.whole++
		case g.shareSlotFree():
			k.part = max(k.part, f)
		}
	}
	return k, !first
}

// hosts reports whether a node in state k could take r now (GPUs, CPU, memory; a share's GPU
// memory and share-slot limits of free GPUs are not looked at).
func (k *freeState) hosts(r *Request) bool {
	if r.CPUMilli > k.cpu || r.MemMiB > k.mem {
		return false
	}
	whole, shared := k.whole, 0
	if k.part > 0 {
		shared = 1
	}
	for _, c := range r.Containers {
		if c.Whole > 0 {
			if whole < c.Whole {
				return false
			}
			whole -= c.Whole
			continue
		}
		for range c.Shares {
			switch {
			case shared > 0 && k.part >= c.Milli:
				shared--
			case whole > 0:
				whole--
			default:
				return false
			}
		}
	}
	return true
}

// add counts n's free state (sign -1: takes it away).
func (f *freeReach) add(n *NodeState, sign int) {
	k, ok := freeStateOf(n)
	if !ok {
		return
	}
	if f.nodes == nil {
		f.nodes = map[freeState]int{}
	}
	if f.nodes[k] += sign; f.nodes[k] == 0 {
		delete(f.nodes, k)
	}
	f.count(&k, int64(sign))
}

func (f *freeReach) count(k *freeState, times int64) {
	if k.free == 0 {
		return
	}
	for i := range f.shapes {
		r := &f.shapes[i].Req
		if !r.WantsGPU() || !r.modelAllowed(k.model) {
			continue
		}
		f.all[i] += times * k.free
		if k.hosts(r) {
			f.fit[i] += times * k.free
		}
	}
}

// track makes shapes the table the sums are for.
func (f *freeReach) track(shapes []Shape) {
	f.shapes = shapes
	f.fit, f.all = make([]int64, len(shapes)), make([]int64, len(shapes))
	for k, c := range f.nodes {
		f.count(&k, int64(c))
	}
}

// reach is shape i's share of the free compute of its models on nodes that could host it now (0:
// none free, or no GPU shape).
func (f *freeReach) reach(i int) float64 {
	if f.all[i] == 0 {
		return 0
	}
	return float64(f.fit[i]) / float64(f.all[i])
}

// reachMove is how far (relative) a shape's reach may drift before the snapshot takes new ones, as
// pressureMove for the model pressure: every snapshot has its own fragmentation cache and plan, so
// that the cache, the evaluation memo and the score bounds stay exact.
const reachMove = 0.05

// moved reports whether the reach now differs from the table's by more than reachMove of it.
func (f *freeReach) moved(shapes []Shape) bool {
	for i := range shapes {
		if !shapes[i].Req.WantsGPU() {
			continue
		}
		now, was := f.reach(i), shapes[i].Reach
		if (now == 0) != (was == 0) || math.Abs(now-was) > reachMove*was {
			return true
		}
	}
	return false
}
