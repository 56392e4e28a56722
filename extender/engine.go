package extender

import (
	"fmt"
	"math"
	"slices"

	"github.com/tessera-gpu/tessera/api"
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
	p, s, u := e.evaluate(sc, n, r, true)
	return p.clone(), s, u
}

// evaluate is Evaluate; without explain, an Unfit carries no message (cheaper when most nodes do
// not fit and nobody reads why). The placement lives in sc's arena: valid until sc's next evaluate.
func (e *Engine) evaluate(sc *ScoreContext, n *NodeState, r *Request, explain bool) (Placement, float64, *Unfit) {
	sc.arena.reset()
	cands, u := candidates(&sc.arena, n, r, explain)
	if u != nil {
		return Placement{}, 0, u
	}
	pol := e.PolicyFor(r)
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
	for i, n := range nodes {
		p, s, u := e.evaluate(sc, n, r, unfitFn != nil)
		if u != nil {
			if unfitFn != nil {
				unfitFn(i, u)
			}
			continue
		}
		if best < 0 || s > bestScore+scoreEpsilon {
			best, bestScore = i, s
			bestP.Devices = append(bestP.Devices[:0], p.Devices...)
		}
	}
	return best, bestP
}

func (p Placement) clone() Placement {
	return Placement{Devices: slices.Clone(p.Devices)}
}

// scoreEpsilon treats scores this close as equal (floating-point noise of weighted sums).
const scoreEpsilon = 1e-9
