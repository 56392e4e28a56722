package placement

import (
	"maps"
	"math"
	"math/bits"
	"strings"
	"sync"
	"sync/atomic"
)

// fragPlan is a set of typical shapes compiled for computing fragmentation fast. Shapes that test a
// GPU the same way (whole, or a share of one compute and memory size; the same allowed models) share
// one "part": a node's fragmentation costs one pass over its GPUs per part, not per shape (the openb
// mix has several CPU sizes per GPU need), and the state after a placement is derived from the
// node's by testing again only the GPUs the placement touches. The result is exactly shapeFrag's,
// summed in shape order, so scores do not move by a bit.
//
// A GPU's test results depend only on its state (model, size, usage, mode), and GPU states repeat
// across nodes (every free GPU of a model is one state), so each state's results are kept as a fit
// mask, one bit per part: a node's stats then cost a lookup per distinct GPU state and a branch-free
// pass over the parts instead of a test per part and GPU (with 160 parts, as where every share pod
// asks its own memory and compute, that test was most of a cold evaluation).
type fragPlan struct {
	shapes []Shape
	parts  []fragPart
	// items are the shapes as the sums read them, in shape order (flat, for the hot loop); fedItems
	// are those that ask for a GPU, in the same order, weighted by reach (weighByReach): what
	// tessera's measure and the score bound read.
	items, fedItems []shapeItem
	// unrestricted is the weight of the GPU shapes that may use any model (failWeight of a GPU that
	// serves none).
	unrestricted float64
	// servable[x] is the weight of the share shapes that ask x per-mille of compute or less: all that
	// a GPU left with x free may still serve (the score bound's lower bound of what it stops serving).
	servable []float64
	// words is the length of a fit mask; zeroMilli is set when a share part asks no compute (a GPU
	// without free compute can then still pass its test).
	words     int
	zeroMilli bool
	// masks are the fit masks of GPU states, shared by every goroutine scoring with this plan:
	// copy-on-write, so that lookups take no lock. A goroutine keeps the states it tested in its
	// own map (fitMasks) and publishes them in batches.
	masks   atomic.Pointer[map[gpuState][]uint64]
	masksMu sync.Mutex
	// mix is the weighted CPU, memory and GPU of the GPU shapes (stranded's ratio) when no shape is
	// restricted to GPU models; with restricted shapes it depends on the node (mixFixed false).
	mix      strandedMix
	mixFixed bool
}

// shapeItem is what fragmentation reads of one shape.
type shapeItem struct {
	weight   float64
	cpu, mem int64
	// part is the shape's part (-1: it asks for no GPU); need is how many GPUs must pass its test;
	// shape is its index in the plan's shapes.
	part, need, shape int32
	// restricted: the shape may use only some GPU models.
	restricted bool
}

// gpuState is everything a part's test reads of a GPU (the model by its number: GPUs of nodes not
// prepared have none, and their masks are neither kept nor grouped).
type gpuState struct {
	memory, usedMemory       int64
	usedMilli                int
	model                    int32
	usable, whole, hasShares bool
}

func stateOfGPU(g *GPUState) gpuState {
	return gpuState{model: g.modelID, memory: g.Memory, usedMemory: g.UsedMemory, usedMilli: g.UsedMilli,
		usable: g.Usable, whole: g.Whole, hasShares: g.Shares > 0}
}

// fitMasks is one goroutine's view of a plan's fit masks: the shared ones, then those it tested
// itself since it last published.
type fitMasks struct {
	pl    *fragPlan
	local map[gpuState][]uint64
}

// Publishing copies the shared map, so a goroutine publishes once its own states are a quarter of
// the shared ones (at least publishMin): the copies cost O(states) in all. Past maxFitMasks states
// nothing more is shared (masks are then tested per goroutine, and its own map is bounded too).
const (
	publishMin  = 16
	maxFitMasks = 1 << 16
)

// mask returns g's fit mask.
func (fm *fitMasks) mask(g *GPUState) []uint64 {
	if g.modelID == 0 {
		return fm.pl.test(g)
	}
	k := stateOfGPU(g)
	shared := fm.pl.masks.Load()
	if shared != nil {
		if m, ok := (*shared)[k]; ok {
			return m
		}
	}
	if m, ok := fm.local[k]; ok {
		return m
	}
	m := fm.pl.test(g)
	if fm.local == nil || len(fm.local) >= maxFitMasks {
		fm.local = map[gpuState][]uint64{}
	}
	fm.local[k] = m
	if n := len(fm.local); n >= publishMin && (shared == nil || 4*n >= len(*shared)) {
		if fm.pl.publish(fm.local) {
			fm.local = nil
		}
	}
	return m
}

// test runs every part's test on g. The mask has one word more than the parts need: failWeight.
func (pl *fragPlan) test(g *GPUState) []uint64 {
	m := make([]uint64, pl.words+1)
	for j := range pl.parts {
		if pl.parts[j].fits(g) {
			m[j>>6] |= 1 << (j & 63)
		}
	}
	fail := 0.0
	for i := range pl.fedItems {
		if it := &pl.fedItems[i]; !it.restricted && m[it.part>>6]>>(it.part&63)&1 == 0 {
			fail += it.weight
		}
	}
	m[pl.words] = math.Float64bits(fail)
	return m
}

// failWeight is the weight of the shapes that may use any GPU model and that a GPU of fit mask m
// cannot serve (kept in the mask's last word, computed once per GPU state like the mask).
func (pl *fragPlan) failWeight(m []uint64) float64 { return math.Float64frombits(m[pl.words]) }

// publish adds masks to the shared map (false: it is full).
func (pl *fragPlan) publish(masks map[gpuState][]uint64) bool {
	pl.masksMu.Lock()
	defer pl.masksMu.Unlock()
	old := pl.masks.Load()
	n := len(masks)
	if old != nil {
		n += len(*old)
	}
	if n > maxFitMasks {
		return false
	}
	m := make(map[gpuState][]uint64, n)
	if old != nil {
		maps.Copy(m, *old)
	}
	maps.Copy(m, masks)
	pl.masks.Store(&m)
	return true
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
	pl := &fragPlan{shapes: shapes, items: make([]shapeItem, len(shapes))}
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
		pl.items[i] = shapeItem{weight: shapes[i].Weight, cpu: r.CPUMilli, mem: r.MemMiB, part: -1, shape: int32(i), restricted: r.modelRestricted()}
		if !r.WantsGPU() {
			continue
		}
		c := &r.Containers[0]
		k := testKey{whole: c.Whole > 0, models: strings.Join(r.Models, "\x00") + "\x01" + strings.Join(r.ExcludeModels, "\x00")}
		if !k.whole {
			k.milli, k.memory, k.memoryPercent = c.Milli, c.Memory, c.MemoryPercent
		}
		j, ok := index[k]
		if !ok {
			j = len(pl.parts)
			index[k] = j
			pl.parts = append(pl.parts, fragPart{r: r, c: c})
		}
		pl.items[i].part, pl.items[i].need = int32(j), int32(c.Whole+c.Shares)
		if !k.whole && c.Milli == 0 {
			pl.zeroMilli = true
		}
	}
	pl.words = (len(pl.parts) + 63) / 64
	pl.servable = make([]float64, MilliPerGPU+1)
	for _, it := range pl.items {
		if it.part >= 0 {
			pl.fedItems = append(pl.fedItems, it)
		}
	}
	pl.weighByReach()
	for _, it := range pl.fedItems {
		if !it.restricted {
			pl.unrestricted += it.weight
		}
		if c := pl.parts[it.part].c; c.Whole == 0 && c.Milli <= MilliPerGPU {
			pl.servable[max(0, c.Milli)] += it.weight
		}
	}
	for x := 1; x <= MilliPerGPU; x++ {
		pl.servable[x] += pl.servable[x-1]
	}
	pl.mixFixed = true
	for i := range shapes {
		if shapes[i].Req.WantsGPU() && shapes[i].Req.modelRestricted() {
			pl.mixFixed = false
		}
	}
	if pl.mixFixed {
		pl.mix = mixOf(nil, shapes)
	}
	return pl
}

// weighByReach scales the GPU shapes' weights in tessera's measure by 1/Reach (Shape.Reach: the
// share of the free GPU compute on nodes that could host the shape now), their total kept. A
// fragment of a shape is the compute it cannot use on a node; what it costs the shape is that
// compute's share of all the free compute that could still serve it. FGD weighs by popularity alone, so
// where few nodes can host a shape (8-GPU pods on a cluster of mostly 2-GPU nodes, CPU-heavy pods
// on a CPU-starved one) its few homes are given away to pods that fit anywhere. Shapes that fit
// every node (reach 1, most of the openb traces' weight) keep their relative weights; a reach not
// known (0: no capacity reported, or no node fits) counts as 1.
func (pl *fragPlan) weighByReach() {
	var raw, scaled float64
	for i := range pl.fedItems {
		it := &pl.fedItems[i]
		raw += it.weight
		if r := pl.shapes[it.shape].Reach; r > 0 {
			it.weight /= r
		}
		scaled += it.weight
	}
	if scaled == 0 {
		return
	}
	for i := range pl.fedItems {
		pl.fedItems[i].weight *= raw / scaled
	}
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
	return shareRoomOn(g, p.r, p.c)
}

// addMask adds (sign -1: removes) cnt GPUs of free compute free and fit mask m to st.
func addMask(st []partStats, m []uint64, cnt, free int) {
	for j := range st {
		b := int(m[j>>6] >> (j & 63) & 1)
		st[j].fit += cnt * b
		st[j].rest += cnt * free * (1 - b)
	}
}

// counts reports whether g can change any part's stats: a GPU without free compute passes no
// test (unless a share part asks no compute) and adds nothing to the rest.
func (pl *fragPlan) counts(g *GPUState) bool { return pl.zeroMilli || g.FreeMilli() > 0 }

// gpuGroup is one distinct state among a node's counted GPUs: its first GPU and how many share it.
type gpuGroup struct {
	g   *GPUState
	k   gpuState
	cnt int
}

// groupGPUs appends n's counted GPUs to groups, GPUs in one state (of a numbered model) as one
// group; of, when not nil, gets each GPU's group (-1: not counted).
func (pl *fragPlan) groupGPUs(n *NodeState, groups []gpuGroup, of []int8) []gpuGroup {
next:
	for i := range n.GPUs {
		g := &n.GPUs[i]
		if of != nil {
			of[i] = -1
		}
		if !pl.counts(g) {
			continue
		}
		k := stateOfGPU(g)
		for x := range groups {
			if groups[x].k == k && k.model != 0 {
				groups[x].cnt++
				if of != nil {
					of[i] = int8(x)
				}
				continue next
			}
		}
		if of != nil {
			of[i] = int8(len(groups))
		}
		groups = append(groups, gpuGroup{g: g, k: k, cnt: 1})
	}
	return groups
}

// stats fills st (one entry per part) for n: once per distinct GPU state of the node.
func (pl *fragPlan) stats(n *NodeState, st []partStats, fm *fitMasks) {
	clear(st)
	var buf [8]gpuGroup
	for _, gr := range pl.groupGPUs(n, buf[:0], nil) {
		addMask(st, fm.mask(gr.g), gr.cnt, gr.g.FreeMilli())
	}
}

// statsAfter fills st for after, which is n with only the GPUs in touched changed, from n's stats.
func (pl *fragPlan) statsAfter(n, after *NodeState, touched uint64, before, st []partStats, fm *fitMasks) {
	copy(st, before)
	for m := touched; m != 0; m &= m - 1 {
		i := bits.TrailingZeros64(m)
		g, a := &n.GPUs[i], &after.GPUs[i]
		switch counted, countedAfter := pl.counts(g), pl.counts(a); {
		case counted && countedAfter:
			swapMask(st, fm.mask(g), g.FreeMilli(), fm.mask(a), a.FreeMilli())
		case counted:
			addMask(st, fm.mask(g), -1, g.FreeMilli())
		case countedAfter:
			addMask(st, fm.mask(a), 1, a.FreeMilli())
		}
	}
}

// swapMask replaces one GPU (free compute free, mask m) by another in st, in one pass.
func swapMask(st []partStats, m []uint64, free int, m2 []uint64, free2 int) {
	for j := range st {
		b, b2 := int(m[j>>6]>>(j&63)&1), int(m2[j>>6]>>(j&63)&1)
		st[j].fit += b2 - b
		st[j].rest += free2*(1-b2) - free*(1-b)
	}
}

// shapeFrag is the free compute (per-mille) of n that a task of shape it cannot use, from n's part
// stats; hostMem makes host memory a condition of fitting too (tessera's measure; the reference's
// ignores it). Follows frag.go GetNodePodFrag's quadrants.
func shapeFrag(it *shapeItem, n *NodeState, st []partStats, total int, hostMem bool) int {
	if it.part < 0 {
		return total // MilliGpu == 0 is XL/XR, never Q3: every free GPU counts
	}
	if lacks(it, n, st, hostMem) {
		return total
	}
	return st[it.part].rest // Q3: the GPUs with less free compute than the task's share
}

// lacks reports whether a task of GPU shape it cannot run on n at all: not enough CPU (Q1 / Q4),
// host memory (where hostMem) or GPUs that pass its test (Q2, or no GPU of an allowed model fits).
func lacks(it *shapeItem, n *NodeState, st []partStats, hostMem bool) bool {
	return (n.CPUMilli > 0 && n.UsedCPU+it.cpu > n.CPUMilli) ||
		(hostMem && n.MemMiB > 0 && n.UsedMem+it.mem > n.MemMiB) ||
		st[it.part].fit < int(it.need)
}

// countsAt reports whether shape it is part of n's multi-resource measure: a shape restricted to
// GPU models n lacks never asks n for anything (policy_tessera.go).
func (pl *fragPlan) countsAt(it *shapeItem, n *NodeState) bool {
	return !it.restricted || pl.restrictedCountsAt(it, n)
}

// restrictedCountsAt is countsAt for a restricted shape: kept out of line so that countsAt, in the
// fragmentation sums' loops, inlines (restricted shapes are the rare case).
//
//go:noinline
func (pl *fragPlan) restrictedCountsAt(it *shapeItem, n *NodeState) bool {
	return canUseModel(n, &pl.shapes[it.shape].Req)
}

// mixAt is the stranded-compute ratio of the GPU shapes that may run on n.
func (pl *fragPlan) mixAt(n *NodeState) strandedMix {
	if pl.mixFixed {
		return pl.mix
	}
	return mixOf(n, pl.shapes)
}

// frag is n's expected fragmentation under measure m, from its part stats: FGD's, or tessera's
// multi-resource one over the GPU shapes that may use one of n's GPU models (with the stranded floor,
// or without it: the measure a share's placement is scored by, policy_tessera.go).
func (pl *fragPlan) frag(n *NodeState, st []partStats, m measure) float64 {
	total := n.FreeMilli()
	if total == 0 {
		return 0
	}
	f := 0.0
	if m == measureFGD {
		for i := range pl.items {
			f += pl.items[i].weight * float64(shapeFrag(&pl.items[i], n, st, total, false))
		}
		return f
	}
	floor := 0.0
	switch m {
	case measureFed:
		floor = pl.mixAt(n).stranded(n, total)
	case measureFedBalanced:
		floor = pl.mixAt(n).balanced(n, total)
	}
	// CPU-only shapes are left out: every free GPU is a fragment to them wherever a pod goes.
	for i := range pl.fedItems {
		it := &pl.fedItems[i]
		if !pl.countsAt(it, n) {
			continue
		}
		v := float64(shapeFrag(it, n, st, total, true))
		if v < floor { // max(floor, v) without the built-in's NaN and signed-zero cases (neither occurs)
			v = floor
		}
		f += it.weight * v
	}
	return f
}

// fragmentation computes n's fragmentation with a plan compiled for this call only.
func fragmentation(n *NodeState, shapes []Shape, m measure) float64 {
	pl := compileFragPlan(shapes)
	st := make([]partStats, len(pl.parts))
	pl.stats(n, st, &fitMasks{pl: pl})
	return pl.frag(n, st, m)
}
