package simulate

import (
	"fmt"
	"math/rand/v2"

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
	// already shared, "whole" free GPUs, and of those "whole-cpu<4" on nodes with under 4 free CPUs.
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
	shapes   []placement.Shape
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
func (c *Cluster) UseOracleShapes() {
	st := placement.NewShapeStats()
	for i := range c.Pods {
		st.Observe(c.Pods[i].Request(), 1)
	}
	c.shapes = st.Typical()
}

// buildNodes returns fresh node states; nodes with identical hardware share a TypeID.
func (c *Cluster) buildNodes() []*placement.NodeState {
	types := map[string]int{}
	out := make([]*placement.NodeState, len(c.Nodes))
	for i, n := range c.Nodes {
		key := fmt.Sprintf("%d/%s/%d/%d", n.GPUs, n.Model, n.CPUMilli, n.MemMiB)
		if types[key] == 0 {
			types[key] = len(types) + 1
		}
		ns := &placement.NodeState{Name: n.Name, CPUMilli: n.CPUMilli, MemMiB: n.MemMiB, TypeID: types[key]}
		for g := 0; g < n.GPUs; g++ {
			ns.GPUs = append(ns.GPUs, placement.GPUState{Index: g, Model: n.Model, Usable: true})
		}
		ns.Prepare()
		out[i] = ns
	}
	return out
}

// Arrivals is the published protocol's arrival order: the pod list shuffled with the seed, then
// inflated by resampling its own pods until the GPU request reaches inflate x capacity.
func (c *Cluster) Arrivals(seed uint64, inflate float64) []Pod {
	rng := rand.New(rand.NewPCG(seed, seed^0x5eed))
	out := make([]Pod, len(c.Pods))
	copy(out, c.Pods)
	rng.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	var total int64
	for i := range out {
		total += int64(out[i].GPURequest())
	}
	target := int64(inflate * float64(c.Capacity))
	for total < target && len(c.Pods) > 0 {
		p := c.Pods[rng.IntN(len(c.Pods))]
		out = append(out, p)
		total += int64(p.GPURequest())
	}
	return out
}

// Run replays one arrival order under one policy through the engine.
func (c *Cluster) Run(policy string, seed uint64, inflate float64) (Result, error) {
	eng, err := placement.NewEngine(policy)
	if err != nil {
		return Result{}, err
	}
	nodes := c.buildNodes()
	rng := rand.New(rand.NewPCG(seed, 7))
	sc := &placement.ScoreContext{Shapes: c.shapes, Cache: placement.NewFragCache(), Rand: rng}
	// Online: the shapes of the pods arrived so far, the current one included (in a cluster it is
	// pending, and the server counts pending pods), through the server's own ShapeStats snapshots.
	st := placement.NewShapeStats()
	res := Result{Policy: policy, Seed: seed, FailedMilli: map[string]int64{}}
	var arrived, allocated int64
	next := 0
	for _, pod := range c.Arrivals(seed, inflate) {
		r := pod.Request()
		if c.shapes == nil {
			if r.WantsGPU() {
				st.Observe(r, 1)
			}
			fresh := st.ScoreContext()
			sc.Shapes, sc.Cache = fresh.Shapes, fresh.Cache
		}
		i, p := eng.Pick(sc, nodes, r, nil)
		if i >= 0 {
			nodes[i].Apply(r, &p)
			allocated += int64(r.GPUMilli())
		} else {
			res.Failed++
			if next < len(Checkpoints) {
				res.FailedMilli[podClass(&pod)] += int64(pod.GPURequest())
			}
		}
		res.Arrived++
		arrived += int64(pod.GPURequest())
		for next < len(Checkpoints) && float64(arrived)*100 >= Checkpoints[next]*float64(c.Capacity) {
			if next == len(Checkpoints)-1 {
				res.Free100 = freeBreakdown(nodes)
			}
			res.Unallocated = append(res.Unallocated, 100-100*float64(allocated)/float64(c.Capacity))
			next++
		}
	}
	for next < len(Checkpoints) { // the workload never reached this checkpoint (inflate < 1)
		res.Unallocated = append(res.Unallocated, 100-100*float64(allocated)/float64(c.Capacity))
		next++
	}
	return res, nil
}
