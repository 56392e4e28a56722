package placement

import (
	"math"
	"math/bits"
	"slices"
	"sync"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// Fragmentation follows the FGD paper (Weng et al., USENIX ATC 2023) as its reference simulator
// computes it (github.com/hkust-adsl/kubernetes-scheduler-simulator, pkg/utils/frag.go:
// NodeGpuShareFragAmount, GetNodePodFrag, CanNodeHostPodOnGpuMemory, GetGpuFragMilliByNodeResAndPodRes).
// The fragmentation of a node for a task shape is the node's free GPU compute that a task of that shape
// cannot use there: all of it when the task does not fit the node at all (a CPU-only shape, a GPU model
// the task may not use, too little CPU, too few GPUs with room), otherwise the free compute of the GPUs
// too full for the task. The node's expected fragmentation weights this over the typical shapes by
// popularity. Host memory plays no part in the reference's measure.

// NodeFragmentation is FGD's expected fragmentation of n over the shapes (CPU-only shapes included,
// host memory ignored), in per-mille of a GPU: frag.go NodeGpuShareFragAmountScore.
func NodeFragmentation(n *NodeState, shapes []Shape) float64 {
	return fragmentation(n, shapes, measureFGD)
}

// NodeFragmentationFed is tessera's multi-resource fragmentation: for every GPU shape, at least the
// node's stranded GPU compute is a fragment. Stranded is the free compute beyond what the node's free
// CPU and memory can feed at the arrival mix's ratio (the shapes' weighted CPU and memory per GPU
// per-mille): tasks arrive in that mix, so a node with less CPU per free GPU than the mix runs out of
// CPU before its GPUs fill. A node whose free resources are in the mix's proportion (an empty,
// balanced node) has none. CPU-only shapes are left out: every free GPU is a fragment to them wherever
// a pod goes.
func NodeFragmentationFed(n *NodeState, shapes []Shape) float64 {
	return fragmentation(n, shapes, measureFed)
}

// measure names a fragmentation measure; it is part of the fragmentation cache's key.
type measure uint8

const (
	// measureNone keys a node state without a measure (the evaluation memo, engine.go).
	measureNone measure = iota
	// measureFGD is FGD's (NodeFragmentation).
	measureFGD
	// measureFed is tessera's (NodeFragmentationFed).
	measureFed
	// measureFedNoFloor is tessera's without the stranded floor: what a share's placement is scored
	// by (policy_tessera.go).
	measureFedNoFloor
	// measureFedBalanced is tessera's with the two-sided floor (strandedMix.balanced): what every
	// placement is scored by where the cluster is host-bound (policy_tessera.go).
	measureFedBalanced
)

// strandedMix is the weighted CPU, memory and GPU need of the mix that can run on a node.
type strandedMix struct{ cpu, mem, gpu float64 }

// mixOf sums the GPU shapes that may use a GPU model of n (n nil: every GPU shape), in shape order.
func mixOf(n *NodeState, shapes []Shape) strandedMix {
	var m strandedMix
	for i := range shapes {
		if r := &shapes[i].Req; r.WantsGPU() && (n == nil || canUseModel(n, r)) {
			m.cpu += shapes[i].Weight * float64(r.CPUMilli)
			m.mem += shapes[i].Weight * float64(r.MemMiB)
			m.gpu += shapes[i].Weight * float64(r.GPUMilli())
		}
	}
	return m
}

// stranded is the free GPU compute of n that its free CPU and memory cannot feed at the ratio of the
// mix that can run on n (shapes restricted to other GPU models never ask this node for CPU).
func stranded(n *NodeState, shapes []Shape, total int) float64 {
	return mixOf(n, shapes).stranded(n, total)
}

func (m strandedMix) stranded(n *NodeState, total int) float64 {
	return float64(total) - min(float64(total), m.feed(n))
}

// feed is the GPU compute (per-mille) n's free CPU and memory can feed at the mix's ratio (+Inf: n
// tracks neither, or the mix asks for neither).
func (m strandedMix) feed(n *NodeState) float64 {
	feed := math.Inf(1)
	if n.CPUMilli > 0 && m.cpu > 0 {
		feed = min(feed, float64(n.CPUMilli-n.UsedCPU)*m.gpu/m.cpu)
	}
	if n.MemMiB > 0 && m.mem > 0 {
		feed = min(feed, float64(n.MemMiB-n.UsedMem)*m.gpu/m.mem)
	}
	return feed
}

// balanced is the two-sided floor of a host-bound cluster: how far apart n's free GPU compute and
// the compute its free CPU and memory can feed at the mix's ratio are, either way (the stranded
// compute where CPU or memory is short; where they are to spare, the compute they could feed beyond
// the free GPUs). Where the cluster has less CPU or memory per GPU than the mix asks, GPU compute is
// left over whatever the placement, and the one-sided floor is the same linear term on every short
// node (W·(g - c·k) for a task of g compute and c CPU at the mix's k compute per CPU), so it tells no
// short node from another, and none of the nodes with CPU to spare. The two-sided floor also counts
// a node's spare CPU and memory while it has free GPUs: CPU-hungry tasks go where CPU is to spare,
// GPU-hungry ones where it is short, and a node with CPU to spare is finished by a task that takes
// its last GPUs rather than an empty node being broken up (a node without free compute counts
// nothing, as in every measure; counting its spare CPU too was worse, docs/placement.md).
func (m strandedMix) balanced(n *NodeState, total int) float64 {
	feed := m.feed(n)
	if math.IsInf(feed, 1) {
		return 0
	}
	return math.Abs(float64(total) - feed)
}

// canUseModel reports whether r may use some GPU model of n.
func canUseModel(n *NodeState, r *Request) bool {
	if !r.modelRestricted() {
		return true
	}
	for i := range n.GPUs {
		if r.modelAllowed(n.GPUs[i].Model) {
			return true
		}
	}
	return false
}

// fragKey identifies a node state for the fragmentation cache (nodes of up to 8 GPUs): the
// hardware type, the CPU and memory in use, and per GPU the free compute, the memory in use
// and whether it is held whole or shared.
type fragKey struct {
	measure       measure
	whole, shared uint8
	typ           int32
	cpu, mem      int64
	free          [8]int16
	usedMem       [8]int64
}

// FragCache memoises node fragmentation by node state for one fixed set of shapes. Nodes in the same
// state (same hardware type, same usage) score the same, and a cluster has few such states. A cache
// from NewFragCache serves one goroutine (the simulator gives each run its own); NewSharedFragCache
// is safe for concurrent use (the server's, one per typical-shape snapshot).
type FragCache struct {
	mu *sync.RWMutex
	m  map[stateHash]fragValue
}

// fragValue is a state's fragmentation and, for a node's own state (not one after a placement),
// its part stats: a shape never seen then derives its after-states without testing the node again.
type fragValue struct {
	v  float64
	st []partStats
}

// stateHash is a 128-bit digest of a fragKey: map keys of 16 bytes instead of ~110 keep the cache
// small and fast. Two distinct states colliding needs a 128-bit collision (about 2^-128 per pair).
type stateHash [2]uint64

func (k *fragKey) hash() stateHash {
	words := [...]uint64{
		uint64(k.measure) | uint64(k.whole)<<8 | uint64(k.shared)<<16 | uint64(uint32(k.typ))<<32,
		uint64(k.cpu), uint64(k.mem),
		uint64(uint16(k.free[0])) | uint64(uint16(k.free[1]))<<16 | uint64(uint16(k.free[2]))<<32 | uint64(uint16(k.free[3]))<<48,
		uint64(uint16(k.free[4])) | uint64(uint16(k.free[5]))<<16 | uint64(uint16(k.free[6]))<<32 | uint64(uint16(k.free[7]))<<48,
		uint64(k.usedMem[0]), uint64(k.usedMem[1]), uint64(k.usedMem[2]), uint64(k.usedMem[3]),
		uint64(k.usedMem[4]), uint64(k.usedMem[5]), uint64(k.usedMem[6]), uint64(k.usedMem[7]),
	}
	// a is a strong 64-bit chain; b an independent cheap one (multiply-rotate), finalised.
	a, b := uint64(0x243f6a8885a308d3), uint64(0x13198a2e03707344)
	for _, w := range words {
		a = mix64(a ^ w)
		b = bits.RotateLeft64(b^(w*0xc2b2ae3d27d4eb4f), 31) * 0x9e3779b97f4a7c15
	}
	return stateHash{a, mix64(b)}
}

// mix64 is the splitmix64 finaliser (a bijection with full avalanche).
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

// maxFragCacheEntries bounds a cache; a full cache is emptied and refilled.
const maxFragCacheEntries = 1 << 20

// NewFragCache returns an empty cache for one goroutine; it must be dropped when the shapes change.
func NewFragCache() *FragCache { return &FragCache{m: map[stateHash]fragValue{}} }

// NewSharedFragCache returns an empty cache safe for concurrent use.
func NewSharedFragCache() *FragCache {
	return &FragCache{mu: &sync.RWMutex{}, m: map[stateHash]fragValue{}}
}

func (c *FragCache) get(k *fragKey) (fragValue, bool) {
	h := k.hash()
	if c.mu != nil {
		c.mu.RLock()
		defer c.mu.RUnlock()
	}
	v, ok := c.m[h]
	return v, ok
}

func (c *FragCache) put(k *fragKey, v fragValue) {
	h := k.hash()
	if c.mu != nil {
		c.mu.Lock()
		defer c.mu.Unlock()
	}
	if len(c.m) >= maxFragCacheEntries {
		clear(c.m)
	}
	c.m[h] = v
}

// stateKey fills k with n's state; false when n cannot be keyed (no TypeID, more than 8 GPUs).
func (sc *ScoreContext) stateKey(m measure, n *NodeState, k *fragKey) bool {
	if n.TypeID == 0 || len(n.GPUs) > 8 {
		return false
	}
	*k = fragKey{measure: m, typ: int32(n.TypeID), cpu: n.UsedCPU, mem: n.UsedMem}
	for i := range n.GPUs {
		g := &n.GPUs[i]
		k.free[i] = int16(g.FreeMilli())
		k.usedMem[i] = g.UsedMemory
		if g.Whole {
			k.whole |= 1 << i
		}
		if g.Shares > 0 {
			k.shared |= 1 << i
		}
	}
	return true
}

// fragBeforeAfter returns the fragmentation (under measure m) of n and of n after p, memoised when
// possible. The state key after p is derived from n's by changing only the GPUs p touches, so a cached
// placement costs one lookup and no copy of the node; n's own key, value and part stats are
// remembered for the node's next candidate, and an uncached after-state re-tests only the GPUs p
// touches (fragPlan).
func (sc *ScoreContext) fragBeforeAfter(m measure, n *NodeState, r *Request, p *Placement) (float64, float64) {
	pl := sc.loadBefore(m, n, true)
	// After-states are judged on their own: a shape never seen meets before-states the cache knows
	// and after-states it does not.
	keyed := sc.lastKeyed && sc.afterJudge.pays()
	var k fragKey
	if keyed {
		k = sc.lastKey
		afterKey(&k, n, r, p)
		fv, ok := sc.Cache.get(&k)
		sc.afterJudge.record(ok)
		if ok {
			return sc.lastFrag, fv.v
		}
	}
	before := sc.beforeStats(n)
	after := sc.afterState(n, r, p)
	sc.stAfter = slices.Grow(sc.stAfter[:0], len(pl.parts))[:len(pl.parts)]
	if touched, ok := touchedGPUs(p); ok {
		pl.statsAfter(n, after, touched, before, sc.stAfter, &sc.masks)
	} else {
		pl.stats(after, sc.stAfter, &sc.masks)
	}
	v := pl.frag(after, sc.stAfter, m)
	if keyed {
		sc.Cache.put(&k, fragValue{v: v})
	}
	return sc.lastFrag, v
}

// compiledPlan returns the context's shapes compiled (fragPlan), with the fit masks set to it.
func (sc *ScoreContext) compiledPlan() *fragPlan {
	if !sc.plan.compiledFor(sc.Shapes) {
		sc.plan = compileFragPlan(sc.Shapes)
		sc.lastNode = nil
	}
	if sc.masks.pl != sc.plan {
		clear(sc.masks.local) // tested against another plan's parts (the map is kept: Reuse)
		sc.masks.pl = sc.plan
	}
	return sc.plan
}

// loadBefore makes n the context's node for measure m (its fragmentation in lastFrag, its part stats
// through beforeStats), through the fragmentation cache where that pays (and cached is set: the
// score bound keeps what it needs itself), and returns the compiled plan.
func (sc *ScoreContext) loadBefore(m measure, n *NodeState, cached bool) *fragPlan {
	pl := sc.compiledPlan()
	if sc.lastNode != n || sc.lastMeasure != m || sc.lastCache != sc.Cache {
		sc.lastNode, sc.lastMeasure, sc.lastCache, sc.haveStats = n, m, sc.Cache, false
		sc.lastKeyed = cached && sc.Cache != nil && n.TypeID != 0 && len(n.GPUs) <= 8 && sc.beforeJudge.pays()
		var fv fragValue
		ok := false
		if sc.lastKeyed {
			sc.stateKey(m, n, &sc.lastKey)
			fv, ok = sc.Cache.get(&sc.lastKey)
			sc.beforeJudge.record(ok)
		}
		if ok && fv.st != nil {
			sc.stBefore, sc.haveStats = fv.st, true // shared: read only
		}
		if !ok {
			fv.v = pl.frag(n, sc.beforeStats(n), m)
			if sc.lastKeyed {
				fv.st = slices.Clone(sc.stBefore)
				sc.Cache.put(&sc.lastKey, fv)
			}
		}
		sc.lastFrag = fv.v
	}
	return pl
}

// cacheJudge decides whether a context should use the fragmentation cache for the next node (or
// after-state). The cache pays where many nodes share states (an empty or uniform cluster, the
// simulator's node types); where nearly every node is in its own state (CPU and memory in use differ
// from node to node) almost every lookup misses, and lookups plus inserts into a map of up to a
// million states cost more than the computation they would save. The judge sees windows of
// cacheProbe lookups: below one hit in four it says no for the next cacheRest, then probes again.
// Values are the same either way (the cache only remembers exact results).
type cacheJudge struct{ lookups, hits, skip int }

func (j *cacheJudge) pays() bool {
	if j.skip > 0 {
		j.skip--
		return false
	}
	if j.lookups >= cacheProbe {
		if 4*j.hits < j.lookups {
			j.skip = cacheRest
		}
		j.lookups, j.hits = 0, 0
		return j.skip == 0
	}
	return true
}

func (j *cacheJudge) record(hit bool) {
	j.lookups++
	if hit {
		j.hits++
	}
}

const (
	cacheProbe = 256
	cacheRest  = 4096
)

// beforeStats returns the part stats of n (sc.lastNode), computed once per node.
func (sc *ScoreContext) beforeStats(n *NodeState) []partStats {
	if !sc.haveStats {
		sc.stOwn = slices.Grow(sc.stOwn[:0], len(sc.plan.parts))[:len(sc.plan.parts)]
		sc.plan.stats(n, sc.stOwn, &sc.masks)
		sc.stBefore, sc.haveStats = sc.stOwn, true
	}
	return sc.stBefore
}

// touchedGPUs is the set of GPUs p places on (false: a GPU index beyond the mask's 64).
func touchedGPUs(p *Placement) (uint64, bool) {
	var m uint64
	for _, d := range p.Devices {
		if d.GPU >= 64 {
			return 0, false
		}
		m |= 1 << d.GPU
	}
	return m, true
}

// afterKey turns n's state key into the key of n after p (what NodeState.Apply would do to the key).
func afterKey(k *fragKey, n *NodeState, r *Request, p *Placement) {
	k.cpu += r.CPUMilli
	k.mem += r.MemMiB
	for _, d := range p.Devices {
		g := &n.GPUs[d.GPU]
		if d.Whole {
			k.whole |= 1 << d.GPU
			k.free[d.GPU] = 0
			continue
		}
		k.shared |= 1 << d.GPU
		k.usedMem[d.GPU] += d.Memory
		if g.Usable && k.whole&(1<<d.GPU) == 0 {
			k.free[d.GPU] -= int16(d.Milli)
		}
	}
}

// fgdPolicy is FGD: the placement that increases the node's expected fragmentation least.
type fgdPolicy struct{}

func (fgdPolicy) Name() string { return api.PolicyFGD }
func (fgdPolicy) Score(sc *ScoreContext, n *NodeState, r *Request, p *Placement) float64 {
	before, after := sc.fragBeforeAfter(measureFGD, n, r, p)
	// The paper's implementation squashes the gain (in GPUs) through a sigmoid into an integer
	// 0..100 node score; the truncation makes near-equal placements tie (broken at random), which
	// the published numbers include, so the baseline keeps it.
	return squash(before - after)
}
