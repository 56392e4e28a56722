package simulate

import (
	"fmt"
	"math/rand/v2"

	"github.com/tessera-gpu/tessera/extender"
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
}

// Cluster is a loaded trace.
type Cluster struct {
	Nodes []Node
	Pods  []Pod
	// Capacity is the cluster's GPU compute in per-mille.
	Capacity int64
	shapes   []extender.Shape
}

// NewCluster prepares a trace for runs. The typical shapes come from the pod list itself (as in
// the FGD paper), not from an arrival order, so every policy and seed sees the same distribution.
func NewCluster(nodes []Node, pods []Pod) *Cluster {
	c := &Cluster{Nodes: nodes, Pods: pods}
	for _, n := range nodes {
		c.Capacity += int64(n.GPUs) * extender.MilliPerGPU
	}
	st := extender.NewShapeStats()
	for i := range pods {
		st.Observe(pods[i].Request(), 1)
	}
	c.shapes = st.Typical()
	return c
}

// buildNodes returns fresh node states; nodes with identical hardware share a TypeID.
func (c *Cluster) buildNodes() []*extender.NodeState {
	types := map[string]int{}
	out := make([]*extender.NodeState, len(c.Nodes))
	for i, n := range c.Nodes {
		key := fmt.Sprintf("%d/%s/%d/%d", n.GPUs, n.Model, n.CPUMilli, n.MemMiB)
		if types[key] == 0 {
			types[key] = len(types) + 1
		}
		ns := &extender.NodeState{Name: n.Name, CPUMilli: n.CPUMilli, MemMiB: n.MemMiB, TypeID: types[key]}
		for g := 0; g < n.GPUs; g++ {
			ns.GPUs = append(ns.GPUs, extender.GPUState{Index: g, Model: n.Model, Usable: true})
		}
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
	eng, err := extender.NewEngine(policy)
	if err != nil {
		return Result{}, err
	}
	nodes := c.buildNodes()
	sc := &extender.ScoreContext{Shapes: c.shapes, Cache: extender.NewFragCache(), Rand: rand.New(rand.NewPCG(seed, 7))}
	res := Result{Policy: policy, Seed: seed}
	var arrived, allocated int64
	next := 0
	for _, pod := range c.Arrivals(seed, inflate) {
		r := pod.Request()
		i, p := eng.Pick(sc, nodes, r, nil)
		if i >= 0 {
			nodes[i].Apply(r, &p)
			allocated += int64(r.GPUMilli())
		} else {
			res.Failed++
		}
		res.Arrived++
		arrived += int64(pod.GPURequest())
		for next < len(Checkpoints) && float64(arrived)*100 >= Checkpoints[next]*float64(c.Capacity) {
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
