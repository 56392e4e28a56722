package placement

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestBoundWordsRoundUp: a bound kept in a table's word reads back no lower than it was (else a
// node whose bound equals its score could be pruned although it is the best), and only for the
// node bound data it was computed from; one of a score's form (an integer less at most 1e-3) reads
// back within ScoreEpsilon of it (else a node whose bound ties the best score is evaluated: a
// float32 read 44.99981 back 3e-6 higher), and -Inf (does not fit) and +Inf (no bound) as they were.
func TestBoundWordsRoundUp(t *testing.T) {
	tab := newEvalTable(nil, 4)
	rng := rand.New(rand.NewPCG(5, 6))
	nb, other := &nodeBoundSlot{gen: 7}, &nodeBoundSlot{gen: 8}
	for range 10000 {
		b := float64(rng.IntN(101)) - 1e-3*rng.Float64()*8000
		kind := ScoreBound + ScoreKind(rng.IntN(2))
		tab.storeBound(1, nb, b, kind)
		got, k, ok := tab.bound(1, nb)
		if !ok || got < b || k != kind {
			t.Fatalf("stored %v (kind %d), read %v (kind %d, ok %v)", b, kind, got, k, ok)
		}
		if _, _, ok := tab.bound(1, other); ok {
			t.Fatal("a bound read back for other node bound data")
		}
	}
	for range 10000 {
		g := 1 + rng.IntN(8)
		b := float64(rng.IntN(102)) - 1e-3*float64(rng.IntN(1000*g+1))/float64(1000*g)
		tab.storeBound(1, nb, b, ScoreBound)
		if got, _, _ := tab.bound(1, nb); got < b || got > b+ScoreEpsilon {
			t.Fatalf("stored the score-form bound %.12f, read %.12f: not within [b, b+%g]", b, got, ScoreEpsilon)
		}
	}
	for _, b := range []float64{math.Inf(-1), math.Inf(1)} {
		tab.storeBound(1, nb, b, ScoreCoarse)
		if got, _, _ := tab.bound(1, nb); got != b {
			t.Fatalf("stored %v, read %v", b, got)
		}
	}
}

// TestBoundWordMarginBelowZero: the one-unit margin of wordOfBound is what keeps a bound just below
// zero (a score of 0 less its tie-break, -1e-3..0) from reading back low. There the word keeps
// d = -b exactly and reads back -(num/boundDenom) with no integer part to absorb rounding, so where
// d·boundDenom rounds up to an integer k while the exact product is below it, a word of floor(k)
// reads back -k/boundDenom, one double below b. Such d are found, not drawn: the double just below
// k/boundDenom, where it times boundDenom rounds to k (a few in a hundred k); random scores near an
// integer c >= 1 never show it (c - num/boundDenom absorbs the error: 5,000,000 values did not).
func TestBoundWordMarginBelowZero(t *testing.T) {
	found := 0
	for k := 1; k <= boundFracMax && found < 1000; k++ {
		d := math.Nextafter(float64(k)/boundDenom, 0)
		if d*boundDenom != float64(k) || float64(k)/boundDenom <= d {
			continue
		}
		found++
		if b := -d; boundOfWord(wordOfBound(b)) < b {
			t.Fatalf("bound %g (d·%g rounds up to %d) read back as %g, below it", b, boundDenom, k, boundOfWord(wordOfBound(b)))
		}
	}
	if found == 0 {
		t.Fatal("no bound below zero whose product rounds up to an integer: the test checks nothing")
	}
}

// TestEvaluatorRemembersAndAgrees: an Evaluator's outcomes - exact (Exact), and bounded then made
// exact (Bound, Refine) - are a fresh evaluation's, step after step of random placements applied and
// released on 24 tracked nodes and a typical-shape snapshot rebuilt now and then; a node that did
// not change since a request's last call is not evaluated again, one that changed is (or is warmed:
// Warm), and a new snapshot evaluates every node again.
func TestEvaluatorRemembersAndAgrees(t *testing.T) {
	e, rng, palette, st := evaluatorFixture(t, 35, 1)
	nodes := make([]*NodeState, 24)
	for i := range nodes {
		nodes[i] = randomPlanNode(rng)
		nodes[i].TrackUsage()
	}
	var placed []applied
	var ev Evaluator
	// pass evaluates r on every node (bounded and refined where bound) and checks each outcome
	// against Evaluate; it returns how many nodes it evaluated.
	pass := func(step int, r *Request, bound bool) int64 {
		sc := st.ScoreContext()
		fresh := new(ScoreContext)
		fresh.Reuse(sc)
		before := ev.Counts()
		c := ev.Begin(e, sc, r, len(nodes), 1)
		defer c.Release()
		for i, n := range nodes {
			var o Outcome
			if bound {
				o = c.Refine(0, i, n, c.Bound(0, i, n), math.Inf(-1))
			} else {
				o = c.Exact(0, i, n, true)
			}
			agreeFresh(t, e, fresh, n, r, o, "step %d node %d (bound %v)", step, i, bound)
		}
		return ev.Counts().Evaluated - before.Evaluated
	}
	remembered := ev.Counts().Remembered
	for step := range 300 {
		r := &palette[rng.IntN(len(palette))].Req
		bound := step%2 == 1
		first := pass(step, r, bound)
		if again := pass(step, r, bound); again != 0 {
			t.Fatalf("step %d: nothing changed, %d nodes evaluated again", step, again)
		}
		// One node changes: a placement applied, or one released.
		k := rng.IntN(len(nodes))
		if rng.IntN(3) > 0 || len(placed) == 0 {
			q := &palette[rng.IntN(len(palette))].Req
			if p, _, u := e.Evaluate(st.ScoreContext(), nodes[k], q); u == nil {
				nodes[k].Apply(q, &p)
				placed = append(placed, applied{k, q, p})
			}
		} else {
			i := rng.IntN(len(placed))
			a := placed[i]
			nodes[a.node].Release(a.r, &a.p)
			placed = append(placed[:i], placed[i+1:]...)
			k = a.node
		}
		switch step % 3 {
		case 0: // the changed node alone is evaluated again (at most: it may be back where it was)
			if n := pass(step, r, false); n > 1 {
				t.Fatalf("step %d: one node changed, %d evaluated", step, n)
			}
		case 1: // the warmer fills the changed node, then the call evaluates nothing
			tables, _ := ev.WarmTables(st.ScoreContext(), len(nodes), 4)
			w0 := ev.Counts().Warmed
			for _, wt := range tables {
				ev.Warm(e, st.ScoreContext(), wt, k, nodes[k], false)
			}
			if w := ev.Counts().Warmed - w0; w > int64(len(tables)) {
				t.Fatalf("step %d: %d warmed for one node and %d tables", step, w, len(tables))
			}
			if n := pass(step, r, false); n != 0 {
				t.Fatalf("step %d: after Warm, %d evaluated", step, n)
			}
		}
		if step%50 == 49 { // the counts move: a new snapshot, every node evaluated again
			v := st.ScoreContext().Snapshot
			for i := range 20 {
				st.Observe(&palette[i%2].Req, 1)
			}
			if st.ScoreContext().Snapshot == v {
				t.Fatal("no new snapshot")
			}
			if n := pass(step, r, false); n != int64(len(nodes)) {
				t.Fatalf("step %d: new snapshot, %d of %d nodes evaluated", step, n, len(nodes))
			}
		}
		if step == 0 && first != int64(len(nodes)) && !bound {
			t.Fatalf("first call: %d of %d nodes evaluated", first, len(nodes))
		}
	}
	if ev.Counts().Remembered == remembered || ev.Counts().Bounded == 0 || ev.Counts().Warmed == 0 {
		t.Fatalf("counts %+v: the comparison proved little", ev.Counts())
	}
}

// TestScoreBuckets: ScoreBuckets order scores (a higher score never lands in a lower
// bucket) and every score is at most its bucket's top (else a bucket could be skipped that holds a
// node reaching the best score).
func TestScoreBuckets(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	scores := []float64{math.Inf(-1), math.Inf(1), -1, -0.5, 0, 1e-12, 0.999, 1, 100, 100.0001, 101, 101.5, 1e9, -1e9}
	for range 10000 {
		scores = append(scores, float64(rng.IntN(101))-1e-3*rng.Float64(), 110*rng.Float64()-5)
	}
	for _, s := range scores {
		b := ScoreBucket(s)
		if b < 0 || b >= ScoreBuckets {
			t.Fatalf("score %v: bucket %d out of 0..%d", s, b, ScoreBuckets-1)
		}
		if s > BucketTop(b) {
			t.Fatalf("score %v above its bucket %d's top %v", s, b, BucketTop(b))
		}
		if b > 0 && s <= BucketTop(b-1) {
			t.Fatalf("score %v in bucket %d although bucket %d's top %v holds it", s, b, b-1, BucketTop(b-1))
		}
	}
}

// TestEvaluatorTwinsAgree: nodes in the same state (equal TypeID and usage digest) share outcomes,
// bounds and bound data (twinKey), and every node's outcome - exact, or bounded then made exact - is
// still a fresh evaluation of that node: on copies of 4 random hardware classes (TypeIDs numbered by
// TypeKey, as the extender's State numbers them) with random placements applied to one copy or the
// same one to two, so that twins with usage, nodes of one class with other usage, and empty nodes of
// other classes (usage digest 0 alike) all meet.
func TestEvaluatorTwinsAgree(t *testing.T) {
	e, rng, palette, st := evaluatorFixture(t, 37, 3)
	ids := map[string]int{}
	var nodes []*NodeState
	for range 4 {
		proto := randomPlanNode(rng)
		proto.UsedCPU, proto.UsedMem = 0, 0 // empty: every class starts at usage digest 0
		for i := range proto.GPUs {
			g := &proto.GPUs[i]
			g.Shares, g.UsedMilli, g.UsedMemory, g.Whole, g.wholeApplied = 0, 0, 0, false, 0
		}
		for range 6 {
			n := &NodeState{CPUMilli: proto.CPUMilli, MemMiB: proto.MemMiB, GPUs: append([]GPUState(nil), proto.GPUs...), Dist: proto.Dist}
			n.Prepare()
			n.TrackUsage()
			k := n.TypeKey()
			if ids[k] == 0 {
				ids[k] = len(ids) + 1
			}
			n.TypeID = ids[k]
			nodes = append(nodes, n)
		}
	}
	if len(ids) < 2 {
		t.Fatalf("%d hardware classes: the test needs several", len(ids))
	}
	var placed []applied
	var ev Evaluator
	for step := range 200 {
		r := &palette[rng.IntN(len(palette))].Req
		sc := st.ScoreContext()
		fresh := new(ScoreContext)
		fresh.Reuse(sc)
		c := ev.Begin(e, sc, r, len(nodes), 1)
		for i, n := range nodes {
			var o Outcome
			if step%2 == 1 {
				o = c.Refine(0, i, n, c.Bound(0, i, n), math.Inf(-1))
			} else {
				o = c.Exact(0, i, n, true)
			}
			agreeFresh(t, e, fresh, n, r, o, "step %d node %d (class %d)", step, i, n.TypeID)
		}
		c.Release()
		// A placement on one node, and now and then the same on a twin of it (twins with usage).
		k := rng.IntN(len(nodes))
		q := &palette[rng.IntN(len(palette))].Req
		if p, _, u := e.Evaluate(st.ScoreContext(), nodes[k], q); u == nil {
			before := nodes[k].UsageDigest()
			nodes[k].Apply(q, &p)
			placed = append(placed, applied{k, q, p})
			for j, n := range nodes {
				if j != k && rng.IntN(2) == 0 && n.TypeID == nodes[k].TypeID && n.UsageDigest() == before {
					n.Apply(q, &p)
					placed = append(placed, applied{j, q, p})
					break
				}
			}
		}
		if step%40 == 39 { // all released: every class's copies are twins at usage 0 again
			for _, a := range placed {
				nodes[a.node].Release(a.r, &a.p)
			}
			placed = placed[:0]
		}
	}
	if ev.Counts().Twinned == 0 {
		t.Fatalf("counts %+v: no outcome taken from a twin, the comparison proved little", ev.Counts())
	}
}

// evaluatorFixture is the evaluator tests' engine (tessera), random generator (seeded a, b), a
// palette of at least 6 request shapes, and shape statistics that have seen 300 pods of them.
func evaluatorFixture(t *testing.T, a, b uint64) (*Engine, *rand.Rand, []Shape, *ShapeStats) {
	t.Helper()
	e, err := NewEngine(api.PolicyTessera)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(a, b))
	palette := randomPlanShapes(rng)
	for len(palette) < 6 {
		palette = append(palette, randomPlanShapes(rng)...)
	}
	st := NewShapeStats()
	for i := range 300 {
		st.Observe(&palette[i%len(palette)].Req, 1)
	}
	return e, rng, palette, st
}

// agreeFresh fails the test unless o is r's fresh evaluation on n (with fresh): the same Unfit
// message, or the same exact score; where (a format and its arguments) names the case.
func agreeFresh(t *testing.T, e *Engine, fresh *ScoreContext, n *NodeState, r *Request, o Outcome, where string, args ...any) {
	t.Helper()
	_, s, u := e.Evaluate(fresh, n, r)
	if (u == nil) != (o.Unfit == nil) || u != nil && u.Msg != o.Unfit.Msg || u == nil && (o.Kind != ScoreExact || o.Score != s) {
		t.Fatalf(where+": evaluator %+v, fresh score %v unfit %v", append(args, o, s, u)...)
	}
}

// applied is a placement a test applied: on which node, of which request.
type applied struct {
	node int
	r    *Request
	p    Placement
}

// TestTableTwinsBounded: a table keeps twins for at most one node state in twinShare of its slots
// (a cluster of distinct nodes would otherwise grow an entry per node and table beside the memo's
// budget); what it keeps can still be improved (a bound replaced by an outcome), and two keys that
// share a map word do not share an entry.
func TestTableTwinsBounded(t *testing.T) {
	tab := newEvalTable(nil, 200)
	limit := len(tab.slots)/twinShare + 1
	for i := range 3 * limit {
		tab.putTwin(twinKey{1, uint64(i + 1)}, true, twin{b: 1, kind: ScoreBound})
	}
	if n := len(tab.twins.m); n != limit {
		t.Fatalf("%d twins kept for %d slots, want %d", n, len(tab.slots), limit)
	}
	o := &evalOutcome{score: 3}
	tab.putTwin(twinKey{1, 1}, true, twin{o: o})
	if got := tab.twin(twinKey{1, 1}, true); got.o != o {
		t.Fatalf("kept twin not improved by an outcome: %+v", got)
	}
	a := twinKey{2, 5}
	b := twinKey{3, a.word() ^ mix64(3)} // the same word as a
	if a.word() != b.word() {
		t.Fatal("test keys do not share a word")
	}
	var m twins[int]
	m.put(a, 1, nil)
	m.put(b, 2, nil)
	if v, ok := m.get(b); ok {
		t.Fatalf("key %v read key %v's entry %d", b, a, v)
	}
}

// TestSnapshotChangesKeepRequestsPending: the requests a snapshot change leaves without a table
// (not staged) stay pending for the warmer across a second change that comes before it took them
// (a call moved the memo to a snapshot promoted at stageLimit, then the next one was promoted),
// most recently used first; dropped, their shapes' next calls would bound every node again.
func TestSnapshotChangesKeepRequestsPending(t *testing.T) {
	e, _, palette, st := evaluatorFixture(t, 41, 2)
	st.StageSnapshots(true)
	nodes := make([]*NodeState, 4)
	for i := range nodes {
		nodes[i] = randomPlanNode(rand.New(rand.NewPCG(uint64(i), 9)))
		nodes[i].TrackUsage()
	}
	var reqs []*Request
	seen := map[string]bool{}
	for i := range palette {
		if r := &palette[i].Req; !seen[r.Digest()] && len(reqs) < 4 {
			seen[r.Digest()] = true
			reqs = append(reqs, r)
		}
	}
	if len(reqs) < 4 {
		t.Fatalf("the palette has %d distinct requests, want 4", len(reqs))
	}
	var ev Evaluator
	call := func(r *Request) {
		c := ev.Begin(e, st.ScoreContext(), r, len(nodes), 1)
		for i, n := range nodes {
			c.Exact(0, i, n, true)
		}
		c.Release()
	}
	// stage moves the counts until a snapshot is staged, gives the most recently used request a
	// table there (not filled) and promotes it.
	stage := func() {
		t.Helper()
		for i := 0; st.StagedScoreContext() == nil; i++ {
			if i == 1000 {
				t.Fatal("no snapshot staged")
			}
			st.Observe(&palette[i%2].Req, 1)
		}
		next := st.StagedScoreContext()
		if got := ev.StagedTables(next, len(nodes), 1); len(got) != 1 {
			t.Fatalf("%d staged tables, want 1", len(got))
		}
		st.Promote(next.Snapshot)
	}
	call(reqs[0])
	call(reqs[1])
	call(reqs[2]) // the most recent: staged
	stage()
	call(reqs[3]) // moves the memo: 1 and 0 pending
	stage()       // 3 staged; the warmer has not taken 1 and 0 yet
	_, fresh := ev.WarmTables(st.ScoreContext(), len(nodes), 8)
	var got []int
	for _, wt := range fresh {
		got = append(got, slices.IndexFunc(reqs, func(r *Request) bool { return r.Digest() == wt.Request.Digest() }))
	}
	if want := []int{2, 1, 0}; !slices.Equal(got, want) {
		t.Fatalf("fresh tables for requests %v, want %v (most recently used first)", got, want)
	}
}
