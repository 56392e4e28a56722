package extender

import (
	"math"
	"runtime"
	"sync"

	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// classWeight is the share of the 0..10 score given to the workload-class preference (older GPUs
// for experiment and inference pods, seed 002) when a pod has such a class.
const classWeight = 0.3

// Prioritize scores the nodes 0..10 with the pod's policy (normalised over the candidates), blended
// with the seed's preferences: experiment and inference pods prefer older, lower-compute GPUs.
func (x *Extender) Prioritize(args *extenderv1.ExtenderArgs) (*extenderv1.HostPriorityList, error) {
	x.calls.Add(1)
	defer x.calls.Add(-1)
	names := nodeNames(args)
	out := make(extenderv1.HostPriorityList, 0, len(names))
	if args.Pod == nil {
		return &out, nil
	}
	req, err := x.State.request(args.Pod, x.Class)
	if err != nil {
		for _, n := range names {
			out = append(out, extenderv1.HostPriority{Host: n, Score: 0})
		}
		return &out, nil
	}
	raw := make([]float64, len(names))
	gen := make([]float64, len(names))
	fits := make([]bool, len(names))
	workers := runtime.GOMAXPROCS(0)
	scs, tab := x.evalSetup(req, workers)
	defer releaseScoreContexts(scs...)
	x.State.viewIndexed(names, workers, func(w, i, slot int, n *placement.NodeState, _ string) {
		if n == nil {
			return
		}
		if o := x.evaluate(tab, scs[w], slot, n, req, false); o.u == nil {
			raw[i], fits[i], gen[i] = o.score, true, o.gen
		}
	})
	pol := normalise(raw, fits, false)
	var pref []float64
	if req.Class == api.WorkloadExperiment || req.Class == api.WorkloadInference {
		pref = normalise(gen, fits, true)
	}
	for j, n := range names {
		s := pol[j]
		if pref != nil {
			s = (1-classWeight)*s + classWeight*pref[j]
		}
		out = append(out, extenderv1.HostPriority{Host: n, Score: int64(math.Round(s))})
	}
	return &out, nil
}

// evalSetup returns one score context per worker on one shape snapshot (scores stay comparable)
// and the request's memo table for that snapshot (nil for the random policy, whose outcomes must
// not be remembered). The contexts are pooled: give them back with releaseScoreContexts.
func (x *Extender) evalSetup(req *placement.Request, workers int) ([]*placement.ScoreContext, *evalTable) {
	sc0 := x.State.Shapes().ScoreContext()
	scs := make([]*placement.ScoreContext, workers)
	for w := range scs {
		scs[w] = pooledScoreContext(sc0)
	}
	if x.Engine.PolicyFor(req).Name() == api.PolicyRandom {
		return scs, nil
	}
	return scs, x.memo.table(sc0, req.Digest(), req, x.State.nodeSlots())
}

// scoreContexts keeps score contexts between calls: a fresh one allocates its scratch memory
// (candidate arena, memo map, part stats, fit masks: over 10 KB) again on first use, and garbage
// collection is much of the latency tail on small control-plane nodes. A pooled context keeps its
// last snapshot's cache reachable until it is reused (or the pool drops it after two GC cycles).
var scoreContexts = sync.Pool{New: func() any { return new(placement.ScoreContext) }}

// pooledScoreContext returns a context of the pool on from's snapshot; give it back with
// releaseScoreContexts once no placement it returned is read any more (they live in its arena).
func pooledScoreContext(from *placement.ScoreContext) *placement.ScoreContext {
	sc := scoreContexts.Get().(*placement.ScoreContext)
	sc.Reuse(from)
	return sc
}

// scoreContext returns a pooled context on the current shape snapshot.
func (x *Extender) scoreContext() *placement.ScoreContext {
	return pooledScoreContext(x.State.Shapes().ScoreContext())
}

func releaseScoreContexts(scs ...*placement.ScoreContext) {
	for _, sc := range scs {
		scoreContexts.Put(sc)
	}
}

// Evaluations counts the node outcomes filter and prioritize took from the evaluation memo and
// those they evaluated (the memo's hit rate, for metrics).
func (x *Extender) Evaluations() (remembered, evaluated int64) {
	return x.memo.remembered.Load(), x.memo.evaluated.Load()
}

// Bounded counts the nodes pick-one Filter bounded instead of evaluating (most are never evaluated).
func (x *Extender) Bounded() int64 { return x.memo.bounded.Load() }

// Warmed counts the node outcomes the warmer evaluated off the request path (warm.go).
func (x *Extender) Warmed() int64 { return x.memo.warmed.Load() }

// evaluate is req's outcome on node n (in slot): remembered in t when n has not changed since,
// else evaluated with sc and remembered.
func (x *Extender) evaluate(t *evalTable, sc *placement.ScoreContext, slot int, n *placement.NodeState, req *placement.Request, explain bool) *evalOutcome {
	if o := t.lookup(slot, n, explain); o != nil {
		x.memo.remembered.Add(1)
		return o
	}
	x.memo.evaluated.Add(1)
	return x.store(t, sc, slot, n, req, explain)
}

// A node's outcome in pick-one Filter: its score, or an upper bound of it.
const (
	scoreExact  = iota
	scoreBound  // placement.Engine.Bound's: the node fits
	scoreCoarse // placement.Engine.CoarseBound's: whether the node fits is not known yet
)

// evaluateBound is evaluate for pick-one Filter's first pass: a remembered outcome (evaluated, or
// why the node does not fit) or bound, else the coarse bound of the node's score where there is
// one, else its bound (or why it does not fit); remembered too, so that a shape's next pod reads
// the nodes that did not change. Nodes whose bound cannot reach the best score are then never
// evaluated (refineBounds).
func (x *Extender) evaluateBound(t *evalTable, sc *placement.ScoreContext, slot int, n *placement.NodeState, req *placement.Request) (evalOutcome, uint8) {
	o, kind, remembered := x.boundOutcome(t, sc, slot, n, req, true)
	if remembered {
		x.memo.remembered.Add(1)
	} else {
		x.memo.bounded.Add(1)
	}
	return o, kind
}

// boundOutcome is evaluateBound without the metrics (coarse: a coarse bound will do; refineBounds
// and the warmer ask for Bound's); remembered: nothing was computed.
func (x *Extender) boundOutcome(t *evalTable, sc *placement.ScoreContext, slot int, n *placement.NodeState, req *placement.Request, coarse bool) (o evalOutcome, kind uint8, remembered bool) {
	if r := t.lookup(slot, n, true); r != nil {
		return *r, scoreExact, true
	}
	usage := n.UsageDigest()
	var bounds *nodeBounds
	if t != nil {
		bounds = t.bounds.Load()
	}
	kept := bounds.get(slot, n, usage)
	if b, kind, ok := t.bound(slot, kept); ok && (coarse || kind == scoreBound) {
		return evalOutcome{state: n, usage: usage, score: b}, kind, true
	}
	var nb *placement.NodeBound
	if kept != nil {
		nb = kept.nb
	}
	if coarse {
		b, got, ok := x.Engine.CoarseBound(sc, n, req, nb)
		kept, nb = x.keepNodeBound(bounds, kept, slot, n, usage, got), got
		if ok {
			t.storeBound(slot, kept, b, scoreCoarse)
			return evalOutcome{state: n, usage: usage, score: b}, scoreCoarse, false
		}
	}
	b, got, u := x.Engine.Bound(sc, n, req, nb, true)
	kept = x.keepNodeBound(bounds, kept, slot, n, usage, got)
	if u != nil {
		r := &evalOutcome{state: n, usage: usage, u: u, explained: true}
		t.store(slot, r)
		return *r, scoreExact, false
	}
	t.storeBound(slot, kept, b, scoreBound)
	return evalOutcome{state: n, usage: usage, score: b}, scoreBound, false
}

// keepNodeBound keeps nb for node slot where it is new (not kept's) and returns what is kept.
func (x *Extender) keepNodeBound(bounds *nodeBounds, kept *nodeBoundSlot, slot int, n *placement.NodeState, usage uint64, nb *placement.NodeBound) *nodeBoundSlot {
	if nb == nil || (kept != nil && kept.nb == nb) {
		return kept
	}
	x.memo.boundData.Add(1)
	return bounds.put(slot, n, usage, nb)
}

// store evaluates req on node n (in slot) with sc and remembers the outcome in t.
func (x *Extender) store(t *evalTable, sc *placement.ScoreContext, slot int, n *placement.NodeState, req *placement.Request, explain bool) *evalOutcome {
	o := &evalOutcome{state: n, usage: n.UsageDigest(), explained: explain}
	p, s, u := x.Engine.EvaluateScratch(sc, n, req, explain)
	if u != nil {
		o.u = u
	} else {
		o.score, o.gen = s, placementGeneration(n, &p)
	}
	t.store(slot, o)
	return o
}

// placementGeneration is the newest compute capability among the GPUs a placement uses.
func placementGeneration(n *placement.NodeState, p *placement.Placement) float64 {
	g := 0
	for _, d := range p.Devices {
		g = max(g, n.GPUs[d.GPU].Gen)
	}
	return float64(g)
}

// normalise maps the fitting entries' values linearly onto 0..10 (10 = best; lowest value best when
// invert); non-fitting entries get 0, and all-equal values get 10.
func normalise(v []float64, fits []bool, invert bool) []float64 {
	lo, hi := math.Inf(1), math.Inf(-1)
	for i, x := range v {
		if fits[i] {
			lo, hi = min(lo, x), max(hi, x)
		}
	}
	out := make([]float64, len(v))
	for i, x := range v {
		switch {
		case !fits[i]:
		case hi-lo < placement.ScoreEpsilon:
			out[i] = float64(extenderv1.MaxExtenderPriority)
		case invert:
			out[i] = float64(extenderv1.MaxExtenderPriority) * (hi - x) / (hi - lo)
		default:
			out[i] = float64(extenderv1.MaxExtenderPriority) * (x - lo) / (hi - lo)
		}
	}
	return out
}
