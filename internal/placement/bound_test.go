package placement

import (
	"math"
	"math/rand/v2"
	"testing"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestScoreBoundHolds: Bound is at least the best score Evaluate finds, on random nodes (CPU,
// memory, mixed GPU models and usage; some of more than 8 GPUs, where there is no bound: +Inf) for
// requests of random typical shapes (whole, share, memory-only, model-restricted, CPU-only) and of
// two share containers (which may share a GPU), with and without the fragmentation cache and model
// pressure, with NodeBounds kept from call to call; it refuses exactly the nodes Evaluate refuses. It must also
// prune: on a third of the nodes at least the bound is below the best score of the population (a
// bound of +Inf everywhere would hold and be worthless). CoarseBound, where it bounds, is at least
// the score too, -Inf only where Evaluate refuses, and must prune a fifth.
func TestScoreBoundHolds(t *testing.T) {
	e, err := NewEngine(api.PolicyTessera)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(21, 22))
	pruned, fitting := 0, 0
	coarsePruned, coarseFitting := 0, 0
	floored := [2]int{} // nodes bounded with nothing stranded (the linear sums) and with a floor
	for iter := range 300 {
		shapes := randomPlanShapes(rng)
		for len(shapes) < 6 {
			shapes = append(shapes, randomPlanShapes(rng)...)
		}
		var cache *FragCache
		if iter%2 == 0 {
			cache = NewFragCache()
		}
		// A host-bound cluster in a fifth of the iterations (shares scored with the floor).
		sc := &ScoreContext{Shapes: shapes, Cache: cache, HostBound: iter%5 == 1}
		if iter%3 != 0 { // model pressure (a term exact in the bounds, at most the largest in the coarse one)
			sc.pressure = newModelPressure(0.5, map[string]float64{"A": 0.5 * rng.Float64(), "B": 0.5 * rng.Float64()})
		}
		kept := map[*NodeState]*NodeBound{}
		r := &shapes[rng.IntN(len(shapes))].Req
		if iter%4 == 3 { // two containers (each share may land on the other's GPU), CPU besides
			r = &Request{CPUMilli: 2000, Containers: []ContainerShape{
				{Name: "a", Shares: 1, Milli: 100 * (1 + rng.IntN(5)), Memory: 1 << 30},
				{Name: "b", Shares: 1 + rng.IntN(2), Milli: 100 * (1 + rng.IntN(5)), Memory: 2 << 30}}}
		}
		nodes := make([]*NodeState, 40)
		best := math.Inf(-1)
		bounds := make([]float64, len(nodes))
		coarse := make([]float64, len(nodes))
		for i := range nodes {
			nodes[i] = randomPlanNode(rng)
			nodes[i].TypeID = 1 + rng.IntN(3)         // some share states (cache hits)
			for i%8 == 0 && len(nodes[i].GPUs) <= 8 { // more GPUs than the bound keeps: no pruning there
				nodes[i].GPUs = append(nodes[i].GPUs, GPUState{Index: len(nodes[i].GPUs), Model: "A", Usable: true, Memory: 16 << 30})
				nodes[i].Prepare()
			}
			for range 2 { // the second pass reads the NodeBound kept from the first
				_, s, u := e.Evaluate(sc, nodes[i], r)
				b, nb, ub := e.Bound(sc, nodes[i], r, kept[nodes[i]], true)
				kept[nodes[i]] = nb
				if (u == nil) != (ub == nil) || (u != nil && u.Msg != ub.Msg) {
					t.Fatalf("iter %d node %d: Evaluate unfit %v, Bound unfit %v", iter, i, u, ub)
				}
				if u != nil {
					bounds[i] = math.NaN()
					break
				}
				if b < s {
					t.Fatalf("iter %d node %d: bound %v below the score %v", iter, i, b, s)
				}
				best, bounds[i] = max(best, s), b
			}
			cb, nb, ok := e.CoarseBound(sc, nodes[i], r, kept[nodes[i]])
			coarse[i] = math.NaN()
			if !ok {
				continue
			}
			if nb == nil || (kept[nodes[i]] != nil && nb != kept[nodes[i]]) {
				t.Fatalf("iter %d node %d: CoarseBound returned node bound data %p, kept %p", iter, i, nb, kept[nodes[i]])
			}
			floored[min(1, int(math.Ceil(nb.stranded)))]++
			_, s, u := e.Evaluate(sc, nodes[i], r)
			switch {
			case u != nil && cb > math.Inf(-1):
				coarse[i] = cb // refused by Evaluate, bounded by CoarseBound: allowed (the fit is checked later)
			case u != nil:
			case cb < s:
				t.Fatalf("iter %d node %d (GPUs %+v) request %+v: coarse bound %v below the score %v", iter, i, nodes[i].GPUs, r, cb, s)
			default:
				coarse[i] = cb
			}
		}
		for i, b := range bounds {
			if !math.IsNaN(b) {
				fitting++
				if b < best-ScoreEpsilon {
					pruned++
				}
			}
			if !math.IsNaN(coarse[i]) {
				coarseFitting++
				if coarse[i] < best-ScoreEpsilon {
					coarsePruned++
				}
			}
		}
	}
	if floored[0]*10 < floored[1] || floored[1]*10 < floored[0] {
		t.Fatalf("nodes without and with stranded compute: %v; the test should see both often", floored)
	}
	if coarseFitting == 0 || coarsePruned*5 < coarseFitting {
		t.Fatalf("the coarse bound pruned %d of %d nodes it bounded: it should prune a fifth at least", coarsePruned, coarseFitting)
	}
	t.Logf("coarse bound pruned %d of %d nodes it bounded (nothing stranded / stranded: %v)", coarsePruned, coarseFitting, floored)
	if fitting == 0 || pruned*3 < fitting {
		t.Fatalf("the bound pruned %d of %d fitting nodes: it should prune a third at least", pruned, fitting)
	}
	t.Logf("pruned %d of %d fitting nodes", pruned, fitting)
}

// TestBoundedForTessera: bounding is offered for tessera's requests (whatever the number of typical
// shapes), never for another policy's.
func TestBoundedForTessera(t *testing.T) {
	for policy, want := range map[string]bool{api.PolicyTessera: true, api.PolicyFGD: false, api.PolicyBestFit: false} {
		e, err := NewEngine(policy)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range []*Request{{Containers: []ContainerShape{{Shares: 1, Milli: 300, Memory: 1 << 30}}}, {Containers: []ContainerShape{{Whole: 2}}}} {
			if got := e.Bounded(r); got != want {
				t.Errorf("%s, request %+v: Bounded %v, want %v", policy, r.Containers, got, want)
			}
		}
	}
	e, err := NewEngine(api.PolicyTessera)
	if err != nil {
		t.Fatal(err)
	}
	if r := (&Request{Policy: api.PolicyFGD, Containers: []ContainerShape{{Whole: 1}}}); e.Bounded(r) {
		t.Error("a request that names fgd is bounded under the tessera engine")
	}
}
