package placement

import (
	"math"
	"sync"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// Evaluator evaluates requests node by node for a caller that meets the same nodes and request
// shapes again and again (the scheduler extender's filter and prioritize calls): it remembers each
// node's outcome per request shape (the memo, evalmemo.go), keeps each node's bound data
// (NodeBound) for the score bounds, and answers one call per node - an exact score (Exact), an upper
// bound of it (Bound) or the one made exact where it can still be the best (Refine) - and for its
// warmer (Warm). The caller owns the node states and their slots (a node's index in per-node
// tables, reused once the node is gone) and iterates the nodes; the zero value is ready to use.
type Evaluator struct {
	memo evalMemo
}

// ScoreKind says what an Outcome's score is: the policy score, or an upper bound of it.
type ScoreKind uint8

const (
	// ScoreExact is the policy's score of the node's best placement (Evaluate's).
	ScoreExact ScoreKind = iota
	// ScoreBound is Bound's upper bound: the node fits.
	ScoreBound
	// ScoreCoarse is CoarseBound's upper bound: whether the node fits is not known yet (-Inf where
	// it knows the node does not fit).
	ScoreCoarse
)

// Score buckets order nodes by score or bound, highest first, by a count sort (the extender's
// pick-one refineBounds): a score is an integer 0..100 less a tie-break below 1 (an upper bound is
// one too), -Inf where a coarse bound knows the node does not fit, +Inf where there is no bound;
// bucket b holds the scores whose ceiling is b-1, clamped to -1..101 (the last bucket has no top).
const ScoreBuckets = 103

// ScoreBucket is the bucket of score s.
func ScoreBucket(s float64) int {
	return int(min(max(math.Ceil(s), -1), 101)) + 1
}

// BucketTop is the highest score bucket b holds.
func BucketTop(b int) float64 {
	if b == ScoreBuckets-1 {
		return math.Inf(1)
	}
	return float64(b - 1)
}

// Outcome is a request's outcome on one node: its score (Kind says whether exact or an upper bound)
// and, where exact, the newest GPU generation of the best placement; or why the request does not fit
// (Unfit).
type Outcome struct {
	Score float64
	Gen   float64
	Unfit *Unfit
	Kind  ScoreKind
}

// EvalCounts are an Evaluator's counters: the node outcomes taken from the memo (Remembered) and
// evaluated afresh (Evaluated) by calls, the nodes bounded instead of evaluated (Bounded), the outcomes
// Warm computed off the request path (Warmed), and the node bound data computed (BoundData: once per
// node state and snapshot, whoever asks first, a call or the warmer).
type EvalCounts struct {
	Remembered, Evaluated, Bounded, Warmed, BoundData int64
	// Twinned counts the outcomes and bounds taken from another node in the same state (twinKey)
	// instead of computed, within the other counts.
	Twinned int64
}

// Counts returns the evaluator's counters (for metrics and tests).
func (ev *Evaluator) Counts() EvalCounts {
	m := &ev.memo
	return EvalCounts{m.remembered.Load(), m.evaluated.Load(), m.bounded.Load(), m.warmed.Load(), m.boundData.Load(), m.twinned.Load()}
}

// Reset forgets every remembered outcome and kept bound data (benchmarks of the evaluation itself,
// tests comparing with a fresh evaluation).
func (ev *Evaluator) Reset() { ev.memo.reset() }

// NodeBound returns the bound data kept for n (in slot, with its current usage) under the serving
// snapshot (nil: none).
func (ev *Evaluator) NodeBound(slot int, n *NodeState) *NodeBound {
	ev.memo.mu.Lock()
	b := ev.memo.bounds
	ev.memo.mu.Unlock()
	if s := b.get(slot, n, n.UsageDigest()); s != nil {
		return s.nb
	}
	return nil
}

// Evaluation is one call's evaluation of a request: a score context per worker, all on one shape
// snapshot (scores stay comparable), and the request's memo table under that snapshot (none for the
// random policy, whose outcomes must not be remembered). Release it once its outcomes are read.
type Evaluation struct {
	memo *evalMemo
	e    *Engine
	req  *Request
	t    *evalTable
	scs  []*ScoreContext
}

// Begin starts an evaluation of r with e on snapshot's shapes (ShapeStats.ScoreContext) for node
// slots 0..slots-1, from workers goroutines (worker w uses its own context).
func (ev *Evaluator) Begin(e *Engine, snapshot *ScoreContext, r *Request, slots, workers int) *Evaluation {
	c := evaluations.Get().(*Evaluation)
	scs := c.scs[:0]
	for range workers {
		scs = append(scs, pooledScoreContext(snapshot))
	}
	*c = Evaluation{memo: &ev.memo, e: e, req: r, scs: scs}
	if e.PolicyFor(r).Name() != api.PolicyRandom {
		c.t = ev.memo.table(snapshot, r.Digest(), r, slots)
	}
	return c
}

// Release gives the evaluation and its score contexts back: the Outcomes it returned stay valid,
// the evaluation is not used again.
func (c *Evaluation) Release() {
	for _, sc := range c.scs {
		scoreContexts.Put(sc)
	}
	clear(c.scs)
	*c = Evaluation{scs: c.scs[:0]}
	evaluations.Put(c)
}

// evaluations keeps Evaluations (and their context lists) between calls.
var evaluations = sync.Pool{New: func() any { return new(Evaluation) }}

// Exact is the request's outcome on node n (in slot): remembered when n has not changed since,
// else evaluated with worker w's context and remembered (with the Unfit message when explain).
func (c *Evaluation) Exact(w, slot int, n *NodeState, explain bool) Outcome {
	if o := c.t.lookup(slot, n, explain); o != nil {
		c.memo.remembered.Add(1)
		return o.outcome()
	}
	c.memo.evaluated.Add(1)
	return c.memo.store(c.e, c.t, c.scs[w], slot, n, c.req, explain).outcome()
}

// Bound is Exact for a pick-one first pass: a remembered outcome (evaluated, or why the node does
// not fit) or bound, else the coarse bound of the node's score where there is one, else its bound
// (or why it does not fit); remembered too, so that a shape's next call reads the nodes that did not
// change. Nodes whose bound cannot reach the best score need never be evaluated (Refine). Only for
// requests whose policy is Bounded.
func (c *Evaluation) Bound(w, slot int, n *NodeState) Outcome {
	o, remembered := c.memo.boundOutcome(c.e, c.t, c.scs[w], slot, n, c.req, true)
	if remembered {
		c.memo.remembered.Add(1)
	} else {
		c.memo.bounded.Add(1)
	}
	return o
}

// Refine makes Bound's outcome o of node n (in slot) exact where it can still be the best: a coarse
// bound is first made a Bound (which also says whether the node fits), and the node evaluated only
// where that reaches least (the least score that can still be the caller's choice). The result is
// exact, or a Bound below least, or why the node does not fit.
func (c *Evaluation) Refine(w, slot int, n *NodeState, o Outcome, least float64) Outcome {
	if o.Kind == ScoreCoarse {
		o, _ = c.memo.boundOutcome(c.e, c.t, c.scs[w], slot, n, c.req, false)
		if o.Unfit != nil || o.Kind == ScoreBound && o.Score < least {
			return o
		}
	}
	if o.Kind == ScoreBound {
		return c.Exact(w, slot, n, true) // fits: the bound pass saw the same state fit
	}
	return o
}

// WarmTable is a memo table the warmer fills (Warm) and the request it evaluates.
type WarmTable struct {
	t       *evalTable
	Request *Request
}

// StagedTables returns tables under the staged snapshot sc for the warmer to fill for every node:
// one for each of the limit most recently used requests of the serving snapshot (nil when sc is
// not newer than the serving snapshot).
func (ev *Evaluator) StagedTables(sc *ScoreContext, slots, limit int) []WarmTable {
	return ev.memo.stagedTables(sc, slots, limit)
}

// WarmTables returns the tables under the snapshot of sc for the warmer, most recently used first:
// every table in use, and fresh ones made for (at most freshLimit of) the requests a snapshot change
// left pending, to be filled for every node.
func (ev *Evaluator) WarmTables(sc *ScoreContext, slots, freshLimit int) (tables, fresh []WarmTable) {
	return ev.memo.warmTables(sc, slots, freshLimit)
}

// Expect returns fresh tables under sc's snapshot for the warmer to fill, for each of reqs that
// has none (a pod of a shape not met lately arrived: its Filter call comes after the scheduler's
// own filters, which at thousands of nodes take longer than the fill), counted as used now. The
// random policy's requests get none (their outcomes are not remembered).
func (ev *Evaluator) Expect(e *Engine, sc *ScoreContext, slots int, reqs []*Request) []WarmTable {
	return ev.memo.expect(e, sc, slots, reqs)
}

// Warm fills wt for node n (in slot) with e on sc where its outcome is not remembered: its bound
// where bound (what a pick-one call reads first; the node bound data it computes serves every
// shape), else its exact outcome.
func (ev *Evaluator) Warm(e *Engine, sc *ScoreContext, wt WarmTable, slot int, n *NodeState, bound bool) {
	m := &ev.memo
	switch {
	case bound:
		if _, remembered := m.boundOutcome(e, wt.t, sc, slot, n, wt.Request, false); !remembered {
			m.warmed.Add(1)
		}
	case wt.t.lookup(slot, n, true) == nil:
		m.warmed.Add(1)
		m.store(e, wt.t, sc, slot, n, wt.Request, true)
	}
}

// boundOutcome is Bound without the metrics (coarse: a coarse bound will do; Refine and the warmer
// ask for Bound's); remembered: nothing was computed.
func (m *evalMemo) boundOutcome(e *Engine, t *evalTable, sc *ScoreContext, slot int, n *NodeState, req *Request, coarse bool) (o Outcome, remembered bool) {
	if r := t.lookup(slot, n, true); r != nil {
		return r.outcome(), true
	}
	usage := n.UsageDigest()
	var bounds *nodeBounds
	if t != nil {
		bounds = t.bounds.Load()
	}
	kept := bounds.get(slot, n, usage)
	if b, kind, ok := t.bound(slot, kept); ok && (coarse || kind == ScoreBound) {
		return Outcome{Score: b, Kind: kind}, true
	}
	// Twins (twinKey) are asked only for what costs more than asking: the node bound data, and
	// bounds and outcomes that read the node's GPUs; a coarse bound from kept data costs less.
	k, twinable := twinKeyOf(n, usage)
	var nb *NodeBound
	if kept != nil {
		nb = kept.nb
	} else if nb = bounds.twin(k, twinable); nb != nil {
		kept = bounds.put(slot, n, usage, nb) // a twin's data, not computed: not counted
	}
	if coarse {
		b, got, ok := e.CoarseBound(sc, n, req, nb)
		if got != nb {
			bounds.putTwin(k, twinable, got)
		}
		kept, nb = m.keepNodeBound(bounds, kept, slot, n, usage, got), got
		if ok {
			t.storeBound(slot, kept, b, ScoreCoarse)
			return Outcome{Score: b, Kind: ScoreCoarse}, false
		}
	}
	switch tw := t.twin(k, twinable); {
	case tw.o != nil && (tw.o.u == nil || tw.o.explained):
		return m.adoptTwin(t, slot, n, usage, tw.o).outcome(), true
	case tw.kind == ScoreBound && kept != nil:
		m.twinned.Add(1)
		t.storeBound(slot, kept, tw.b, ScoreBound)
		return Outcome{Score: tw.b, Kind: ScoreBound}, true
	}
	b, got, u := e.Bound(sc, n, req, nb, true)
	if got != nb {
		bounds.putTwin(k, twinable, got)
	}
	kept = m.keepNodeBound(bounds, kept, slot, n, usage, got)
	if u != nil {
		r := &evalOutcome{state: n, usage: usage, u: u, explained: true}
		t.store(slot, r)
		t.putTwin(k, twinable, twin{o: r})
		return r.outcome(), false
	}
	t.storeBound(slot, kept, b, ScoreBound)
	t.putTwin(k, twinable, twin{b: b, kind: ScoreBound})
	return Outcome{Score: b, Kind: ScoreBound}, false
}

// adoptTwin remembers twin's outcome (another node state's with n's content) as n's (in slot).
func (m *evalMemo) adoptTwin(t *evalTable, slot int, n *NodeState, usage uint64, twin *evalOutcome) *evalOutcome {
	m.twinned.Add(1)
	o := *twin
	o.state, o.usage = n, usage
	t.store(slot, &o)
	return &o
}

// keepNodeBound keeps nb for node slot where it is new (not kept's) and returns what is kept.
func (m *evalMemo) keepNodeBound(bounds *nodeBounds, kept *nodeBoundSlot, slot int, n *NodeState, usage uint64, nb *NodeBound) *nodeBoundSlot {
	if nb == nil || (kept != nil && kept.nb == nb) {
		return kept
	}
	m.boundData.Add(1)
	return bounds.put(slot, n, usage, nb)
}

// store evaluates req on node n (in slot) with e and sc and remembers the outcome in t.
func (m *evalMemo) store(e *Engine, t *evalTable, sc *ScoreContext, slot int, n *NodeState, req *Request, explain bool) *evalOutcome {
	usage := n.UsageDigest()
	k, twinable := twinKeyOf(n, usage)
	if tw := t.twin(k, twinable); tw.o != nil && (!explain || tw.o.u == nil || tw.o.explained) {
		return m.adoptTwin(t, slot, n, usage, tw.o)
	}
	o := &evalOutcome{state: n, usage: usage, explained: explain}
	p, s, u := e.EvaluateScratch(sc, n, req, explain)
	if u != nil {
		o.u = u
	} else {
		o.score, o.gen = s, placementGeneration(n, &p)
	}
	t.store(slot, o)
	t.putTwin(k, twinable, twin{o: o})
	return o
}

// placementGeneration is the newest compute capability among the GPUs a placement uses.
func placementGeneration(n *NodeState, p *Placement) float64 {
	g := 0
	for _, d := range p.Devices {
		g = max(g, n.GPUs[d.GPU].Gen)
	}
	return float64(g)
}

// scoreContexts keeps score contexts between calls: a fresh one allocates its scratch memory
// (candidate arena, memo map, part stats, fit masks: over 10 KB) again on first use, and garbage
// collection is much of the latency tail on small control-plane nodes. A pooled context keeps its
// last snapshot's cache reachable until it is reused (or the pool drops it after two GC cycles).
var scoreContexts = sync.Pool{New: func() any { return new(ScoreContext) }}

// pooledScoreContext returns a context of the pool on from's snapshot; give it back once no
// placement it returned is read any more (they live in its arena).
func pooledScoreContext(from *ScoreContext) *ScoreContext {
	sc := scoreContexts.Get().(*ScoreContext)
	sc.Reuse(from)
	return sc
}

// EvaluateOn is Evaluate with a pooled context on snapshot's shapes (snapshot's own scratch memory
// is not touched): for one node evaluation outside an Evaluation (a bind, a pick-one hold).
func (e *Engine) EvaluateOn(snapshot *ScoreContext, n *NodeState, r *Request) (Placement, float64, *Unfit) {
	sc := pooledScoreContext(snapshot)
	defer scoreContexts.Put(sc)
	return e.Evaluate(sc, n, r)
}
