package placement

import (
	"math"
	"math/bits"
)

// Score bounds. Filter with --filter-pick-one needs the best node, not every node's score: with an
// upper bound of each node's tessera score that costs a few operations per candidate, only the
// nodes whose bound reaches the best exact score found so far are evaluated (branch and bound), and
// the choice is the one exhaustive evaluation makes (same score, same ties). The bound is cheap
// because everything it reads about the node is independent of the request, computed once per node
// state and typical-shape snapshot (NodeBound, which callers keep: the extender per node slot), and
// what it reads about a GPU state is kept with the GPU state's fit mask (failWeight).
//
// Why it holds. tessera's gain is the node's fragmentation before minus after, a weighted sum over
// the GPU shapes that count at the node of max(floor, v): v is all free compute where the shape
// lacks CPU, memory or GPUs there ("lacks", L), else the free compute of the GPUs that cannot serve
// its share. A placement takes d of free compute (d_k from GPU k) and only makes GPUs fuller (their
// tests pass for fewer parts), so per shape:
//   - a shape in L stays in L: v falls by exactly d;
//   - a shape not in L that a touched GPU k cannot serve before (B0(k)) loses d_k from v at most;
//   - a shape not in L that every touched GPU serves does not lose anything; one that the single
//     touched GPU served before and cannot serve after (B01) gains that GPU's remaining compute fa
//     (as its fragment, or more where it now lacks);
//   - the floor (stranded compute) falls by D at most, and max(f, v) - max(f', v') <=
//     max(f - f', v - v').
//
// So, with W the weight of the shapes that count, U(k) = weight of L ∪ B0(k) (per node and GPU,
// exact), and B a lower bound of the weight of B01 \ L (failWeight of the GPU after minus before,
// minus L's weight), the gain is at most
//
//	one GPU:   max(D, d)·U + max(D, -fa)·B + max(D, 0)·(W - U - B)
//	more GPUs: max(D, 0)·W + d·W(L) + Σ_k d_k·(U(k) - W(L))
//
// and at most the fragmentation before (the one after is not negative). The score is monotone in
// the gain, and its tie-break term (how full the placement leaves the GPUs) is exact.
// TestScoreBoundHolds checks bound >= score on random nodes and shapes.

// boundSlack absorbs floating-point rounding between the bound's sums and the exact ones (in
// per-mille of a GPU: far below one step of the quantised score).
const boundSlack = 1e-3

// NodeBound is what the score bound reads of a node state under one typical-shape snapshot, for
// any request: keep it while the node's state (its usage digest) and the snapshot are the same.
type NodeBound struct {
	frag float64 // the node's fragmentation (tessera's)
	mix  strandedMix
	// w is the weight of the GPU shapes that count at the node, wl of those that lack CPU, memory or
	// GPUs there; u[i] the weight of those that lack or that GPU i cannot serve.
	w, wl float64
	u     [8]float64
}

// Bounded reports whether bounding pays for r under sc's typical shapes: r's policy has a score
// bound (Bound), and the GPU shapes are many (boundMinShapes).
func (e *Engine) Bounded(sc *ScoreContext, r *Request) bool {
	if _, ok := e.PolicyFor(r).(tesseraPolicy); !ok {
		return false
	}
	return len(sc.compiledPlan().fedItems) >= boundMinShapes
}

// boundMinShapes is where bounding starts to pay. A bound costs a few operations per candidate plus
// one pass over the shapes per node state and snapshot; an exact evaluation one pass per candidate.
// With few shapes the exact pass is as cheap as the bound and bounding only adds work: on the openb
// default trace's 31 shapes (benchmark SchedulingStream) bounding made a cold call 1.7x slower and
// a warm one 1.3x; on the varied cluster's 164 parts (FilterPrioritizeHTTP) it made a shape never
// seen 4x cheaper. Speed only: the choice is the same either way.
const boundMinShapes = 64

// Bound returns an upper bound of r's best score on n (Evaluate's score), or why r does not fit n
// (as Evaluate would say it); +Inf where the node has more GPUs than the bound keeps (no pruning).
// nb is n's NodeBound when the caller kept one (nil: computed, and returned for keeping). Only for
// requests whose policy is Bounded.
func (e *Engine) Bound(sc *ScoreContext, n *NodeState, r *Request, nb *NodeBound, explain bool) (float64, *NodeBound, *Unfit) {
	sc.arena.reset()
	cands, u := candidates(&sc.arena, n, r, explain)
	if u != nil {
		return 0, nb, u
	}
	sc.lastNode = nil // n may have changed since it was last seen (loadBefore)
	sc.compiledPlan()
	if nb == nil {
		nb = sc.nodeBound(n)
	}
	if nb == nil {
		return math.Inf(1), nil, nil
	}
	best := math.Inf(-1)
	for i := range cands {
		best = max(best, sc.scoreBound(nb, n, r, &cands[i]))
	}
	return best, nb, nil
}

// nodeBound computes n's NodeBound (nil: more than 8 GPUs).
func (sc *ScoreContext) nodeBound(n *NodeState) *NodeBound {
	if len(n.GPUs) > len(NodeBound{}.u) {
		return nil
	}
	pl := sc.loadBefore(2, n, false)
	st := sc.beforeStats(n)
	nb := &NodeBound{frag: sc.lastFrag, mix: pl.mixAt(n)}
	// The node's distinct GPU states (counted ones: a GPU without free compute takes nothing).
	var buf [8]gpuGroup
	var group [8]int8
	groups := pl.groupGPUs(n, buf[:0], group[:len(n.GPUs)])
	var masks [8][]uint64
	var adjust [8]float64
	for k := range groups {
		masks[k] = sc.masks.mask(groups[k].g)
	}
	// u[i] - wl is the weight of the shapes outside L that GPU i cannot serve: its failWeight (the
	// unrestricted shapes it cannot serve, kept with its mask) less those in L, plus the restricted
	// ones counted here and outside L. Only those two kinds need a pass over the GPU states.
	for i := range pl.fedItems {
		it := &pl.fedItems[i]
		if !pl.countsAt(it, n) {
			continue // not counted at n (frag)
		}
		nb.w += it.weight
		inL := lacks(it, n, st, true)
		if inL {
			nb.wl += it.weight
		}
		if inL == it.restricted {
			continue // unrestricted outside L: in failWeight; restricted in L: in neither
		}
		w := it.weight
		if inL {
			w = -w
		}
		for k := range len(groups) {
			if masks[k][it.part>>6]>>(it.part&63)&1 == 0 {
				adjust[k] += w
			}
		}
	}
	for i := range n.GPUs {
		nb.u[i] = nb.wl
		if k := group[i]; k >= 0 {
			nb.u[i] += max(0, pl.failWeight(masks[k])+adjust[k])
		}
	}
	return nb
}

// scoreBound is an upper bound of tessera's score of p on the node of nb (see above).
func (sc *ScoreContext) scoreBound(nb *NodeBound, n *NodeState, r *Request, p *Placement) float64 {
	after := sc.afterState(n, r, p)
	total, total2 := n.FreeMilli(), after.FreeMilli()
	gain := nb.frag
	touched, ok := touchedGPUs(p)
	if total > 0 && total2 > 0 && ok && touched < 1<<len(nb.u) {
		d := float64(total - total2)
		D := nb.mix.stranded(n, total) - nb.mix.stranded(after, total2)
		if bits.OnesCount64(touched) == 1 {
			i := bits.TrailingZeros64(touched)
			u := nb.u[i]
			wg, wa, fa := sc.plan.unrestricted, sc.plan.unrestricted, 0.0
			if g := &n.GPUs[i]; sc.plan.counts(g) {
				wg = sc.plan.failWeight(sc.masks.mask(g))
			}
			if a := &after.GPUs[i]; sc.plan.counts(a) {
				wa, fa = sc.plan.failWeight(sc.masks.mask(a)), float64(a.FreeMilli())
			}
			b := min(max(0, wa-wg-nb.wl), nb.w-u)
			gain = min(gain, max(D, d)*u+max(D, -fa)*b+max(D, 0)*(nb.w-u-b))
		} else {
			g := max(D, 0)*nb.w + d*nb.wl
			for m := touched; m != 0; m &= m - 1 {
				i := bits.TrailingZeros64(m)
				g += float64(n.GPUs[i].FreeMilli()-after.GPUs[i].FreeMilli()) * (nb.u[i] - nb.wl)
			}
			gain = min(gain, g)
		}
	}
	gain += boundSlack
	return math.Trunc(100/(1+math.Exp(-gain/MilliPerGPU))) - 1e-3*gpuTightnessAfter(n, p)
}
