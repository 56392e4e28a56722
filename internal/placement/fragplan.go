package placement

import (
	"math/bits"
	"strings"
)

// fragPlan is a set of typical shapes compiled for computing fragmentation fast. Shapes that test a
// GPU the same way (whole, or a share of one compute and memory size; the same allowed models) share
// one "part": a node's fragmentation costs one pass over its GPUs per part, not per shape (the openb
// mix has several CPU sizes per GPU need), and the state after a placement is derived from the
// node's by testing again only the GPUs the placement touches. The result is exactly shapeFrag's,
// summed in shape order, so scores do not move by a bit.
type fragPlan struct {
	shapes []Shape
	parts  []fragPart
	// partOf is each shape's part; -1 for a shape that asks for no GPU.
	partOf []int
}

// fragPart is one GPU test: the first shape's request and container that has it.
type fragPart struct {
	r *Request
	c *ContainerShape
}

// partStats is what a part's test finds on a node: how many GPUs pass, and the free compute
// (per-mille) of the others.
type partStats struct{ fit, rest int }

func compileFragPlan(shapes []Shape) *fragPlan {
	pl := &fragPlan{shapes: shapes, partOf: make([]int, len(shapes))}
	// A part is identified by what its GPU test reads (testKey); shapes of one key share it.
	type testKey struct {
		whole                bool
		milli, memoryPercent int
		memory               int64
		models               string
	}
	index := map[testKey]int{}
	for i := range shapes {
		r := &shapes[i].Req
		if !r.WantsGPU() {
			pl.partOf[i] = -1
			continue
		}
		c := &r.Containers[0]
		k := testKey{whole: c.Whole > 0, models: strings.Join(r.Models, "\x00")}
		if !k.whole {
			k.milli, k.memory, k.memoryPercent = c.Milli, c.Memory, c.MemoryPercent
		}
		j, ok := index[k]
		if !ok {
			j = len(pl.parts)
			index[k] = j
			pl.parts = append(pl.parts, fragPart{r: r, c: c})
		}
		pl.partOf[i] = j
	}
	return pl
}

// compiledFor reports whether pl was compiled from exactly this shape slice.
func (pl *fragPlan) compiledFor(shapes []Shape) bool {
	return pl != nil && len(pl.shapes) == len(shapes) && (len(shapes) == 0 || &pl.shapes[0] == &shapes[0])
}

// fits is shapeFrag's per-GPU test: a free whole GPU of an allowed model, or room for one share.
func (p *fragPart) fits(g *GPUState) bool {
	if p.c.Whole > 0 {
		return g.FreeWhole() && p.r.modelAllowed(g.Model)
	}
	return shareFits(g, p.r, p.c)
}

func (p *fragPart) add(g *GPUState, s *partStats, sign int) {
	if p.fits(g) {
		s.fit += sign
	} else {
		s.rest += sign * g.FreeMilli()
	}
}

// stats fills st (one entry per part) for n.
func (pl *fragPlan) stats(n *NodeState, st []partStats) {
	for j := range pl.parts {
		st[j] = partStats{}
		for i := range n.GPUs {
			pl.parts[j].add(&n.GPUs[i], &st[j], 1)
		}
	}
}

// statsAfter fills st for after, which is n with only the GPUs in touched changed, from n's stats.
func (pl *fragPlan) statsAfter(n, after *NodeState, touched uint64, before, st []partStats) {
	copy(st, before)
	for j := range pl.parts {
		p := &pl.parts[j]
		for m := touched; m != 0; m &= m - 1 {
			i := bits.TrailingZeros64(m)
			p.add(&n.GPUs[i], &st[j], -1)
			p.add(&after.GPUs[i], &st[j], 1)
		}
	}
}

// shapeFrag is the free compute (per-mille) of n that a task of shape i cannot use, from n's part
// stats; hostMem makes host memory a condition of fitting too (tessera's measure; the reference's
// ignores it). Follows frag.go GetNodePodFrag's quadrants.
func (pl *fragPlan) shapeFrag(i int, n *NodeState, st []partStats, total int, hostMem bool) int {
	j := pl.partOf[i]
	if j < 0 {
		return total // MilliGpu == 0 is XL/XR, never Q3: every free GPU counts
	}
	r := &pl.shapes[i].Req
	if n.CPUMilli > 0 && n.UsedCPU+r.CPUMilli > n.CPUMilli {
		return total // Q1 / Q4: lacks CPU
	}
	if hostMem && n.MemMiB > 0 && n.UsedMem+r.MemMiB > n.MemMiB {
		return total
	}
	if c := &r.Containers[0]; st[j].fit < c.Whole+c.Shares {
		return total // Q2 (or no access: no GPU of an allowed model fits)
	}
	return st[j].rest // Q3: the GPUs with less free compute than the task's share
}

// frag is FGD's expected fragmentation of n (fed: tessera's multi-resource one, over the GPU shapes
// that may use one of n's GPU models) from its part stats.
func (pl *fragPlan) frag(n *NodeState, st []partStats, fed bool) float64 {
	total := n.FreeMilli()
	if total == 0 {
		return 0
	}
	f := 0.0
	if !fed {
		for i := range pl.shapes {
			f += pl.shapes[i].Weight * float64(pl.shapeFrag(i, n, st, total, false))
		}
		return f
	}
	floor := stranded(n, pl.shapes, total)
	for i := range pl.shapes {
		if pl.partOf[i] < 0 {
			continue // CPU-only shapes: every free GPU is a fragment to them wherever a pod goes
		}
		if !canUseModel(n, &pl.shapes[i].Req) {
			continue // restricted to GPU models n lacks: never asks n for anything (policy_tessera.go)
		}
		f += pl.shapes[i].Weight * max(floor, float64(pl.shapeFrag(i, n, st, total, true)))
	}
	return f
}

// fragmentation computes n's fragmentation with a plan compiled for this call only.
func fragmentation(n *NodeState, shapes []Shape, fed bool) float64 {
	pl := compileFragPlan(shapes)
	st := make([]partStats, len(pl.parts))
	pl.stats(n, st)
	return pl.frag(n, st, fed)
}
