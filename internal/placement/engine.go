package placement

import (
	"fmt"
	"math"
	"slices"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// Engine holds the placement policies and picks placements with them. It is stateless apart from
// its policy table: callers own the node states and the ScoreContext.
type Engine struct {
	defaultPolicy string
	policies      map[string]Policy
}

// NewEngine returns an engine whose default policy is def.
func NewEngine(def string) (*Engine, error) {
	e := &Engine{defaultPolicy: def, policies: map[string]Policy{}}
	for _, name := range api.KnownPolicies {
		p, err := NewPolicy(name)
		if err != nil {
			return nil, err
		}
		e.policies[name] = p
	}
	if _, ok := e.policies[def]; !ok {
		return nil, fmt.Errorf("default placement policy: unknown policy %q (known: %v)", def, api.KnownPolicies)
	}
	return e, nil
}

// PolicyFor returns the request's override when set, else the default policy.
func (e *Engine) PolicyFor(r *Request) Policy {
	if p, ok := e.policies[r.Policy]; ok {
		return p
	}
	return e.policies[e.defaultPolicy]
}

// Evaluate returns the best placement of r on n and its policy score, or why r does not fit n.
func (e *Engine) Evaluate(sc *ScoreContext, n *NodeState, r *Request) (Placement, float64, *Unfit) {
	sc.memoReq = nil
	p, s, u := e.EvaluateScratch(sc, n, r, true)
	return p.clone(), s, u
}

// EvaluateScratch is Evaluate for hot loops; without explain, an Unfit carries no message (cheaper when most nodes do
// not fit and nobody reads why). The placement lives in sc's arena: valid until sc's next evaluate.
func (e *Engine) EvaluateScratch(sc *ScoreContext, n *NodeState, r *Request, explain bool) (Placement, float64, *Unfit) {
	sc.arena.reset()
	pol := e.PolicyFor(r)
	// Nodes in the same state (same hardware type, same usage) evaluate the same: remember each
	// state's outcome for this request (clusters have far fewer states than nodes).
	// The memo stops itself for a request when its first memoProbe lookups hit less than half the
	// time (every node in its own state: remembering would only cost).
	var key fragKey
	var h stateHash
	memo := false
	if sc.memoReq != r || sc.memoExplain != explain {
		if sc.memo == nil {
			sc.memo = map[stateHash]memoEntry{}
		}
		clear(sc.memo)
		sc.memoDevs = sc.memoDevs[:0]
		sc.memoReq, sc.memoExplain, sc.memoLookups, sc.memoHits = r, explain, 0, 0
	}
	if _, random := pol.(randomPolicy); !random && (sc.memoLookups < memoProbe || 2*sc.memoHits >= sc.memoLookups) && sc.stateKey(measureNone, n, &key) {
		sc.memoLookups++
		h = key.hash()
		if m, ok := sc.memo[h]; ok {
			sc.memoHits++
			return Placement{Devices: m.devs}, m.score, m.u
		}
		memo = true
	}
	p, s, u := e.evaluateAll(sc, pol, n, r, explain)
	if memo {
		// The memo's placements share one backing array (earlier ones keep an outgrown one).
		sc.memoDevs = append(sc.memoDevs, p.Devices...)
		k := len(sc.memoDevs)
		sc.memo[h] = memoEntry{devs: sc.memoDevs[k-len(p.Devices) : k : k], score: s, u: u}
	}
	return p, s, u
}

// memoProbe is how many nodes the evaluation memo is tried on before it judges its hit rate.
const memoProbe = 256

// memoEntry is one node state's outcome for the request being evaluated.
type memoEntry struct {
	devs  []Device
	score float64
	u     *Unfit
}

// evaluateAll scores every candidate placement of r on n.
func (e *Engine) evaluateAll(sc *ScoreContext, pol Policy, n *NodeState, r *Request, explain bool) (Placement, float64, *Unfit) {
	cands, u := candidates(&sc.arena, n, r, explain)
	if u != nil {
		return Placement{}, 0, u
	}
	sc.lastNode = nil // n may have changed since it was last seen (fragBeforeAfter)
	best, bestScore := 0, math.Inf(-1)
	for i := range cands {
		if s := pol.Score(sc, n, r, &cands[i]); s > bestScore {
			best, bestScore = i, s
		}
	}
	return cands[best], bestScore, nil
}

// Pick evaluates r on every node and returns the best node's index and placement (-1 when none
// fits). Ties go to the first node in list order: deterministic, and it fills nodes in order when
// a policy is indifferent (the FGD paper's simulator behaves the same way). unfitFn, when not nil,
// receives the reason of every node that does not fit.
func (e *Engine) Pick(sc *ScoreContext, nodes []*NodeState, r *Request, unfitFn func(i int, u *Unfit)) (int, Placement) {
	best := -1
	var bestP Placement
	bestScore := math.Inf(-1)
	sc.memoReq = nil // a new request: forget outcomes memoised for an earlier one
	for i, n := range nodes {
		p, s, u := e.EvaluateScratch(sc, n, r, unfitFn != nil)
		if u != nil {
			if unfitFn != nil {
				unfitFn(i, u)
			}
			continue
		}
		if best < 0 || s > bestScore+ScoreEpsilon {
			best, bestScore = i, s
			bestP.Devices = append(bestP.Devices[:0], p.Devices...)
		}
	}
	return best, bestP
}

func (p Placement) clone() Placement {
	return Placement{Devices: slices.Clone(p.Devices)}
}

// ScoreEpsilon treats scores this close as equal (floating-point noise of weighted sums).
const ScoreEpsilon = 1e-9
