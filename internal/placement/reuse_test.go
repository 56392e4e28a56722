package placement

import (
	"math/rand/v2"
	"slices"
	"testing"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestReusedContextMatchesFresh: one context reused (ScoreContext.Reuse) call after call, across
// shape snapshots (older ones again too, as concurrent calls may hold them), requests (a new one
// sometimes at the old one's address), policies and nodes that change in place, gives every
// outcome a fresh context of the same snapshot gives: placement, score and reason.
func TestReusedContextMatchesFresh(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 22))
	e, err := NewEngine(api.PolicyTessera)
	if err != nil {
		t.Fatal(err)
	}
	// Nodes of a few hardware types in few states (memo and cache hits), each type numbered as
	// State numbers them; clones are the same hardware in the same state.
	types := map[string]int{}
	var nodes []*NodeState
	for len(nodes) < 120 {
		n := randomPlanNode(rng)
		n.UsedCPU, n.UsedMem = 0, 0
		if k := n.TypeKey(); types[k] == 0 {
			types[k] = len(types) + 1
		}
		n.TypeID = types[n.TypeKey()]
		nodes = append(nodes, n)
		for range rng.IntN(4) {
			nodes = append(nodes, n.Clone())
		}
	}
	// The fresh contexts have their own caches and compile their own plans: a wrong value the
	// reused context stored in a shared cache or plan would otherwise be read back as the reference.
	var snapshots []*ScoreContext
	freshCaches := map[*ScoreContext]*FragCache{}
	st := NewShapeStats()
	for len(snapshots) < 6 {
		for _, sh := range randomPlanShapes(rng) {
			st.Observe(&sh.Req, 1+rng.IntN(50))
		}
		if sc := st.ScoreContext(); len(snapshots) == 0 || sc.Cache != snapshots[len(snapshots)-1].Cache {
			snapshots = append(snapshots, sc)
			freshCaches[sc] = NewFragCache()
		}
	}
	policies := []string{"", api.PolicyFGD, api.PolicyBestFit, api.PolicyBinpack, api.PolicySpread}
	reused := &ScoreContext{}
	req := &Request{}
	compared := 0
	for call := range 400 {
		from := snapshots[rng.IntN(len(snapshots))]
		if call%2 == 0 {
			from = snapshots[min(call/60, len(snapshots)-1)] // runs of calls on one snapshot
		}
		reused.Reuse(from)
		fresh := &ScoreContext{Shapes: from.Shapes, Cache: freshCaches[from], Snapshot: from.Snapshot}
		if rng.IntN(3) > 0 {
			req = &Request{} // else: the next request at the last one's address
		}
		*req = from.Shapes[rng.IntN(len(from.Shapes))].Req
		req.Policy = policies[rng.IntN(len(policies))]
		explain := rng.IntN(2) == 0
		for range 30 {
			n := nodes[rng.IntN(len(nodes))]
			p, s, u := e.EvaluateScratch(reused, n, req, explain)
			wp, ws, wu := e.EvaluateScratch(fresh, n, req, explain)
			if (u == nil) != (wu == nil) || u != nil && *u != *wu || u == nil && (s != ws || !slices.Equal(p.Devices, wp.Devices)) {
				t.Fatalf("call %d node %p: reused context %v %v %v, fresh %v %v %v", call, n, p.Devices, s, u, wp.Devices, ws, wu)
			}
			compared++
			if u == nil && rng.IntN(8) == 0 {
				n.Apply(req, &p) // the node changes in place (a bind)
			}
		}
	}
	if compared == 0 {
		t.Fatal("nothing compared")
	}
}
