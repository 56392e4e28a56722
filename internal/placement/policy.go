package placement

import (
	"fmt"
	"math/rand/v2"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// Policy scores one feasible placement of a request on a node; higher is better. Scores of one
// policy are compared across nodes and placements of the same request only.
type Policy interface {
	Name() string
	Score(sc *ScoreContext, n *NodeState, r *Request, p *Placement) float64
}

// ScoreContext carries what policies need beyond the node: the typical task shapes, a fragmentation
// cache (simulator only) and randomness. One context serves one goroutine.
type ScoreContext struct {
	Shapes []Shape
	Cache  *FragCache
	// Snapshot numbers the typical-shape snapshot Shapes and Cache belong to (later ones are larger).
	Snapshot uint64
	Rand     *rand.Rand
	// after is scratch space for a node's state after a placement; arena holds candidates.
	after NodeState
	arena arena
	// memo holds the outcome per node state for memoReq (Engine.EvaluateScratch).
	memo                  map[stateHash]memoEntry
	memoDevs              []Device // the memo's placements
	memoReq               *Request
	memoExplain           bool
	memoLookups, memoHits int
	// The last node fragBeforeAfter saw: its key and fragmentation (for its next candidates).
	lastNode    *NodeState
	lastMeasure measure
	lastCache   *FragCache
	lastKey     fragKey
	lastFrag    float64
	// plan is Shapes compiled for fragmentation; stBefore (valid when haveStats) are lastNode's
	// part stats (stOwn, or the cache's copy: read only), stAfter those of a state after a placement.
	plan                     *fragPlan
	masks                    fitMasks
	stBefore, stOwn, stAfter []partStats
	haveStats                bool
	// lastKeyed: lastNode's values go through the cache; the judges say whether it pays.
	lastKeyed               bool
	beforeJudge, afterJudge cacheJudge
	// pressure is the snapshot's model pressure (pressure.go; nil: none).
	pressure *modelPressure
	// HostBound is set when the cluster runs out of CPU or memory before its GPUs at the typical
	// shapes' mix (ShapeStats; tessera then scores shares with the stranded floor too).
	HostBound bool
}

// Fork returns a context for another goroutine on the same shapes, cache and compiled plan.
func (sc *ScoreContext) Fork() *ScoreContext {
	return &ScoreContext{Shapes: sc.Shapes, Cache: sc.Cache, Snapshot: sc.Snapshot, Rand: sc.Rand, plan: sc.plan, pressure: sc.pressure, HostBound: sc.HostBound}
}

// Reuse points sc at from's snapshot (shapes, cache, compiled plan, randomness) for another call,
// keeping only its scratch memory (candidate arena, memo map, part-stats slices, after-state, and
// fit masks, which count only while the plan is the same), so that a pooled context allocates nothing once warm.
// Everything else starts afresh, fields added later included: a new request or node state may sit
// at an old one's address (memoReq, lastNode), and the cache judges judged another call's cache.
func (sc *ScoreContext) Reuse(from *ScoreContext) {
	*sc = ScoreContext{
		Shapes: from.Shapes, Cache: from.Cache, Snapshot: from.Snapshot, Rand: from.Rand, plan: from.plan, pressure: from.pressure, HostBound: from.HostBound,
		after: sc.after, arena: sc.arena, memo: sc.memo, memoDevs: sc.memoDevs, stOwn: sc.stOwn, stAfter: sc.stAfter,
		masks: sc.masks, // fragBeforeAfter clears them when the plan differs
	}
}

// afterState returns the node as it would be after p (scratch memory, valid until the next call).
func (sc *ScoreContext) afterState(n *NodeState, r *Request, p *Placement) *NodeState {
	a := &sc.after
	gpus := a.GPUs[:0]
	*a = *n
	a.GPUs = append(gpus, n.GPUs...)
	a.tracked = false
	a.Apply(r, p)
	return a
}

// NewPolicy returns the named policy.
func NewPolicy(name string) (Policy, error) {
	switch name {
	case api.PolicyTessera:
		return tesseraPolicy{}, nil
	case api.PolicyFGD:
		return fgdPolicy{}, nil
	case api.PolicyBestFit:
		return bestFitPolicy{}, nil
	case api.PolicyBinpack:
		return binpackPolicy{}, nil
	case api.PolicySpread:
		return spreadPolicy{}, nil
	case api.PolicyRandom:
		return randomPolicy{}, nil
	}
	return nil, fmt.Errorf("unknown placement policy %q (known: %v)", name, api.KnownPolicies)
}

// gpuTightness is how much free compute the placement leaves on the GPUs it touches, per GPU
// (0 = it fills them exactly, 1 = they stay empty); used to prefer best-fit GPUs inside a node.
func gpuTightness(after *NodeState, p *Placement) float64 {
	if len(p.Devices) == 0 {
		return 0
	}
	s := 0
	for _, d := range p.Devices {
		s += after.GPUs[d.GPU].FreeMilli()
	}
	return float64(s) / float64(MilliPerGPU*len(p.Devices))
}

// gpuTightnessAfter is gpuTightness of n after p, computed from n without applying p.
func gpuTightnessAfter(n *NodeState, p *Placement) float64 {
	if len(p.Devices) == 0 {
		return 0
	}
	s := 0
	for _, d := range p.Devices {
		g := &n.GPUs[d.GPU]
		free := g.FreeMilli()
		for _, o := range p.Devices {
			if o.GPU != d.GPU {
				continue
			}
			if o.Whole {
				free = 0
				break
			}
			free -= o.Milli
		}
		s += free
	}
	return float64(s) / float64(MilliPerGPU*len(p.Devices))
}

func frac(a, b int64) float64 {
	if b <= 0 {
		return 0
	}
	return float64(a) / float64(b)
}

// bestFitPolicy is the BestFit baseline of the FGD paper: the node left with the least free
// resources (GPU and CPU, equally weighted), and inside it the fullest GPU that fits.
type bestFitPolicy struct{}

func (bestFitPolicy) Name() string { return api.PolicyBestFit }
func (bestFitPolicy) Score(sc *ScoreContext, n *NodeState, r *Request, p *Placement) float64 {
	a := sc.afterState(n, r, p)
	left := frac(int64(a.FreeMilli()), int64(a.CapacityMilli()))
	if a.CPUMilli > 0 {
		left = (left + frac(a.CPUMilli-a.UsedCPU, a.CPUMilli)) / 2
	}
	return -left - 1e-3*gpuTightness(a, p)
}

// binpackPolicy fills a node before the next (seed 002 "优先凑整"): the node with the most GPU
// compute in use after placement, the fullest fitting GPU inside it, closest GPUs for multi-GPU pods.
type binpackPolicy struct{}

func (binpackPolicy) Name() string { return api.PolicyBinpack }
func (binpackPolicy) Score(sc *ScoreContext, n *NodeState, r *Request, p *Placement) float64 {
	a := sc.afterState(n, r, p)
	used := 1 - frac(int64(a.FreeMilli()), int64(a.CapacityMilli()))
	return used - 1e-3*gpuTightness(a, p) - 1e-5*float64(TopologyCost(n, p))
}

// spreadPolicy balances load: the emptiest node, and the emptiest GPU inside it.
type spreadPolicy struct{}

func (spreadPolicy) Name() string { return api.PolicySpread }
func (spreadPolicy) Score(sc *ScoreContext, n *NodeState, r *Request, p *Placement) float64 {
	a := sc.afterState(n, r, p)
	free := frac(int64(a.FreeMilli()), int64(a.CapacityMilli()))
	return free + 1e-3*gpuTightness(a, p) - 1e-5*float64(TopologyCost(n, p))
}

// randomPolicy scores uniformly at random (the paper's Random baseline).
type randomPolicy struct{}

func (randomPolicy) Name() string { return api.PolicyRandom }
func (randomPolicy) Score(sc *ScoreContext, _ *NodeState, _ *Request, _ *Placement) float64 {
	if sc.Rand == nil {
		return 0
	}
	return sc.Rand.Float64()
}
