package simulate

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sort"

	"github.com/tessera-gpu/tessera/internal/placement"
)

// Checkpoints are the arrived-workload percentages the report shows.
var Checkpoints = []float64{25, 50, 75, 100}

// Result is one run: unallocated GPU % at each checkpoint, and how many pods failed.
type Result struct {
	Policy      string
	Seed        uint64
	Unallocated []float64
	Failed      int
	Arrived     int
	// FailedMilli is the GPU request (per-mille) of the pods that failed before the 100% checkpoint,
	// by pod class ("share", "1gpu", "2gpu", ...): at 100% it is exactly the unallocated capacity.
	FailedMilli map[string]int64
	// Free100 breaks the free GPU compute at the 100% checkpoint down (per-mille): "partial" on GPUs
	// already shared, "whole" free GPUs, and of those "whole-cpu<4" on nodes with under 4 free CPUs;
	// "floor" is the least "partial" any placement of the shares placed by then leaves (packingFloor),
	// "offline" what an offline packer of them leaves (offlineWaste).
	Free100 map[string]int64
}

func freeBreakdown(nodes []*placement.NodeState) map[string]int64 {
	out := map[string]int64{}
	for _, n := range nodes {
		for i := range n.GPUs {
			g := &n.GPUs[i]
			switch {
			case g.FreeWhole():
				out["whole"] += placement.MilliPerGPU
				if n.CPUMilli-n.UsedCPU < 4000 {
					out["whole-cpu<4"] += placement.MilliPerGPU
				}
			default:
				out["partial"] += int64(g.FreeMilli())
			}
		}
	}
	return out
}

// podClass names a pod's shape class for the failure breakdown.
func podClass(p *Pod) string {
	switch {
	case p.NumGPU == 0 || p.GPUMilli == 0:
		return "cpu"
	case p.GPUMilli < placement.MilliPerGPU:
		return "share"
	}
	return fmt.Sprintf("%dgpu", p.NumGPU)
}

// Cluster is a loaded trace.
type Cluster struct {
	Nodes []Node
	Pods  []Pod
	// Capacity is the cluster's GPU compute in per-mille.
	Capacity int64
	oracle   bool
}

// NewCluster prepares a trace for runs.
func NewCluster(nodes []Node, pods []Pod) *Cluster {
	c := &Cluster{Nodes: nodes, Pods: pods}
	for _, n := range nodes {
		c.Capacity += int64(n.GPUs) * placement.MilliPerGPU
	}
	return c
}

// UseOracleShapes makes every run score with the typical shapes of the whole pod list (CPU-only
// pods included), as the FGD paper's simulator does, instead of learning them from the GPU pods
// arrived so far (the default, and all the server can know). It exists to reproduce the paper.
func (c *Cluster) UseOracleShapes() { c.oracle = true }

// buildNodes returns fresh node states in the seed's order; nodes with identical hardware share a
// TypeID. The reference simulator sorts the nodes by name, renames node i to "%04d-<name>" with
// perm[i] of rand.Perm (pkg/simulator/simulator.go syncClusterResourceList) and breaks equal scores
// by the smallest name, so the order in which ties fall is a fresh permutation per seed. Engine.Pick
// breaks ties by list order, so the list is put in that renamed order.
func (c *Cluster) buildNodes(seed uint64) []*placement.NodeState {
	types := map[string]int{}
	order := c.NodeOrder(seed)
	out := make([]*placement.NodeState, len(c.Nodes))
	for pos, i := range order {
		n := c.Nodes[i]
		key := fmt.Sprintf("%d/%s/%d/%d", n.GPUs, n.Model, n.CPUMilli, n.MemMiB)
		if types[key] == 0 {
			types[key] = len(types) + 1
		}
		ns := &placement.NodeState{Name: n.Name, CPUMilli: n.CPUMilli, MemMiB: n.MemMiB, TypeID: types[key]}
		for g := 0; g < n.GPUs; g++ {
			ns.GPUs = append(ns.GPUs, placement.GPUState{Index: g, Model: n.Model, Usable: true})
		}
		ns.Prepare()
		out[pos] = ns
	}
	return out
}

// NodeOrder returns the seed's node order (indexes into Nodes): position k holds the node the
// reference renames "%04d-" with k, so this order is also the order of the renamed names.
func (c *Cluster) NodeOrder(seed uint64) []int {
	byName := make([]int, len(c.Nodes))
	for i := range byName {
		byName[i] = i
	}
	sort.SliceStable(byName, func(a, b int) bool { return c.Nodes[byName[a]].Name < c.Nodes[byName[b]].Name })
	perm := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15)).Perm(len(byName))
	order := make([]int, len(byName)) // order[perm[k]] = the k-th node by name
	for k, idx := range byName {
		order[perm[k]] = idx
	}
	return order
}

// Arrivals is the published protocol's arrival order: the pod list shuffled with the seed, then
// inflated by resampling its own pods while the GPU request stays within inflate x capacity (the
// reference's tuneUpPods stops at the first sampled pod that would pass it).
func (c *Cluster) Arrivals(seed uint64, inflate float64) []Pod {
	rng := rand.New(rand.NewPCG(seed, seed^0x5eed))
	out := make([]Pod, len(c.Pods))
	copy(out, c.Pods)
	rng.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	var total int64
	for i := range out {
		total += int64(out[i].GPURequest())
	}
	target := inflate * float64(c.Capacity)
	for len(c.Pods) > 0 {
		p := c.Pods[rng.IntN(len(c.Pods))]
		if float64(total+int64(p.GPUMilli)) > target {
			break
		}
		out = append(out, p)
		total += int64(p.GPURequest())
	}
	return out
}

// checkpoint averages the allocation ratio over the arrivals whose arrived workload rounds to one
// percentage, as the reference's analysis does (experiments/analysis/merge_alloc_discrete.py: the
// arrive ratio rounded to an integer, the alloc ratio rounded to 2 decimals, their mean rounded to
// 2 decimals; when no arrival rounds to the point, those within +-1 of it).
type checkpoint struct {
	at               float64
	sum, sumNear     float64
	count, countNear int
}

func (k *checkpoint) record(arrivePct, allocPct float64) {
	a := math.RoundToEven(arrivePct)
	v := math.Round(allocPct*100) / 100
	if a == k.at {
		k.sum += v
		k.count++
	}
	if a >= k.at-1 && a <= k.at+1 {
		k.sumNear += v
		k.countNear++
	}
}

// unallocated is 100 - the checkpoint's allocation ratio; ok is false when no arrival came near it.
func (k *checkpoint) unallocated() (float64, bool) {
	switch {
	case k.count > 0:
		return 100 - math.Round(k.sum/float64(k.count)*100)/100, true
	case k.countNear > 0:
		return 100 - math.Round(k.sumNear/float64(k.countNear)*100)/100, true
	}
	return 0, false
}

// Run replays one arrival order under one policy through the engine.
func (c *Cluster) Run(policy string, seed uint64, inflate float64) (Result, error) {
	pick, err := pickerFor(policy)
	if err != nil {
		return Result{}, err
	}
	nodes := c.buildNodes(seed)
	rng := rand.New(rand.NewPCG(seed, 7))
	// The typical shapes and model pressure come from the server's own ShapeStats snapshots: of the
	// whole pod list (oracle), or of the pods arrived so far, the current one included (in a cluster
	// it is pending, and the server counts pending pods). The pressure reads the cluster's free
	// compute, reported as the server's State reports it.
	st := placement.NewShapeStats()
	if c.oracle {
		for i := range c.Pods {
			st.Observe(c.Pods[i].Request(), 1)
		}
	}
	for _, n := range nodes {
		st.AddNodeFree(n, 1)
	}
	sc := &placement.ScoreContext{Rand: rng}
	res := Result{Policy: policy, Seed: seed, FailedMilli: map[string]int64{}}
	var arrived, allocated int64
	points := make([]checkpoint, len(Checkpoints))
	for i, at := range Checkpoints {
		points[i].at = at
	}
	last := len(Checkpoints) - 1
	shares := make([]int, placement.MilliPerGPU) // placed shares by compute
	for _, pod := range c.Arrivals(seed, inflate) {
		r := pod.Request()
		if !c.oracle && r.WantsGPU() {
			st.Observe(r, 1)
		}
		if fresh := st.ScoreContext(); fresh.Snapshot != sc.Snapshot {
			sc.Reuse(fresh)
			sc.Rand = rng
		}
		i, p := pick(sc, nodes, r)
		if i >= 0 {
			st.AddNodeFree(nodes[i], -1)
			nodes[i].Apply(r, &p)
			st.AddNodeFree(nodes[i], 1)
			allocated += int64(r.GPUMilli())
			if pod.GPUMilli > 0 && pod.GPUMilli < placement.MilliPerGPU {
				shares[pod.GPUMilli] += pod.NumGPU
			}
		} else {
			if !c.oracle && r.WantsGPU() {
				st.Observe(r, -1) // a pod that cannot run leaves the learned mix, as in the extender
			}
			res.Failed++
			if 100*float64(arrived) < Checkpoints[last]*float64(c.Capacity) {
				res.FailedMilli[podClass(&pod)] += int64(pod.GPURequest())
			}
		}
		res.Arrived++
		before := 100 * float64(arrived) / float64(c.Capacity)
		arrived += int64(pod.GPURequest())
		arrivePct, allocPct := 100*float64(arrived)/float64(c.Capacity), 100*float64(allocated)/float64(c.Capacity)
		for k := range points {
			points[k].record(arrivePct, allocPct)
		}
		if before < Checkpoints[last] && arrivePct >= Checkpoints[last] {
			res.Free100 = freeBreakdown(nodes)
			res.Free100["floor"] = packingFloor(shares)
			res.Free100["offline"] = offlineWaste(shares)
		}
	}
	for k := range points {
		u, ok := points[k].unallocated()
		if !ok { // the workload never came near this checkpoint (inflate < 1)
			u = 100 - 100*float64(allocated)/float64(c.Capacity)
		}
		res.Unallocated = append(res.Unallocated, u)
	}
	return res, nil
}

// UnallocatedAt scores a replay made elsewhere (the live placement benchmark) as Run does: for each
// arrival in order its GPU request (per-mille) and whether it was placed; the result is the
// unallocated GPU % at each checkpoint.
func UnallocatedAt(capacity int64, request []int, placed []bool) []float64 {
	points := make([]checkpoint, len(Checkpoints))
	for i, at := range Checkpoints {
		points[i].at = at
	}
	var arrived, allocated int64
	for i, r := range request {
		arrived += int64(r)
		if placed[i] {
			allocated += int64(r)
		}
		for k := range points {
			points[k].record(100*float64(arrived)/float64(capacity), 100*float64(allocated)/float64(capacity))
		}
	}
	out := make([]float64, len(points))
	for k := range points {
		u, ok := points[k].unallocated()
		if !ok {
			u = 100 - 100*float64(allocated)/float64(capacity)
		}
		out[k] = u
	}
	return out
}
