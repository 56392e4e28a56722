package extender

import "github.com/tessera-gpu/tessera/api"

// tesseraPolicy: placeholder, FGD with best-fit tie-breaking.
type tesseraPolicy struct{}

func (tesseraPolicy) Name() string { return api.PolicyTessera }
func (tesseraPolicy) Score(sc *ScoreContext, n *NodeState, r *Request, p *Placement) float64 {
	frag := func(x *NodeState) float64 { return NodeFragmentation(x, sc.Shapes) }
	before := sc.fragOf(1, n, frag)
	a := sc.afterState(n, r, p)
	after := sc.fragOf(1, a, frag)
	left := frac(int64(a.FreeMilli()), int64(a.CapacityMilli()))
	return before - after - 1e-3*left
}
