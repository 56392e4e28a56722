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
// state and typical-shape snapshot (NodeBound, which callers keep: the Evaluator per node slot), and
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
// and at most the fragmentation before (the one after is not negative). Where nothing is stranded
// before (f = 0, the common case where CPU and memory are not short), max(f, v) - max(f', v') <=
// v - v' for every shape, and the sum is linear: Σ_k d_k·U(k) - fa_k·B(k) over the touched GPUs
// (each shape that GPU k stops serving gains fa_k). A share is scored without the floor
// (tesseraMeasure, unless the cluster is host-bound), so its gain is bounded by that linear sum on
// every node, and by the node's fragmentation without the floor (NodeBound.fragNoFloor). The score is monotone in the gain, and its
// tie-break term (how full the placement leaves the GPUs) is exact, and so is the model pressure's
// term (pressure.go: each device's compute times its model's coefficient), added as it is; CoarseBound
// takes the largest coefficient of the node's models for all the compute. TestScoreBoundHolds checks
// bound >= score on random nodes and shapes.
//
// CoarseBound is the same sums with what they read of the state after a placement replaced by
// extremes, for a request of one kind of part (whole GPUs or shares): a pass over the node's GPUs,
// no candidate placements. Pick-one Filter ranks every node by it and bounds (and evaluates) only
// the nodes whose coarse bound reaches the best score (Evaluation.Bound and Refine, driven by the
// extender's refineBounds).

// boundSlack absorbs floating-point rounding between the bound's sums and the exact ones (in
// per-mille of a GPU: far below one step of the quantised score).
const boundSlack = 1e-3

// NodeBound is what the score bound reads of a node state under one typical-shape snapshot, for
// any request: keep it while the node's state (its usage digest) and the snapshot are the same.
type NodeBound struct {
	// frag is the node's fragmentation (tessera's), fragNoFloor the same without the stranded floor
	// (what a share's placement is scored by).
	frag, fragNoFloor float64
	mix               strandedMix
	// stranded is the node's floor (the stranded compute; the two-sided floor where balanced):
	// what a placement can lower it by at most.
	stranded float64
	// balanced: the floor is the two-sided one (ScoreContext.HostBound). A placement can then lower
	// it by more than the compute it takes (a CPU-hungry task on a node with CPU to spare).
	balanced bool
	// pressure is the largest model-pressure coefficient of the node's GPUs (pressure.go).
	pressure float64
	// w is the weight of the GPU shapes that count at the node, wl of those that lack CPU, memory or
	// GPUs there; u[i] the weight of those that lack or that GPU i cannot serve.
	w, wl float64
	u     [8]float64
	// What CoarseBound reads of the node state, so that it reads no GPUState (most of its cost was
	// loading them): the CPU and memory free (MaxInt64 where not tracked), the free compute, and
	// per GPU what a share's or a whole GPU's test reads but the model.
	cpuFree, memFree int64
	total            int
	gpus             [8]boundGPU
	ngpus            int
}

// boundGPU is what CoarseBound reads of one GPU.
type boundGPU struct {
	memory, usedMemory int64
	free               int32 // FreeMilli
	shareable          bool  // usable and not held whole
	freeWhole          bool  // FreeWhole
}

// Bounded reports whether r's policy has a score bound (Bound, CoarseBound): tessera's.
//
// It pays whatever the number of typical shapes since the coarse bound and ties by name (extender
// refineBounds): on the openb default trace's 31 shapes (benchmark SchedulingStream) bounding took
// the steady stream's p99 from 5.1-5.5 to 2.4-3.1 ms without the warmer and from 3.3-3.7 to 2.8-2.9
// with it, the paced stream's from 9.4-10.5 to 4.1-4.4 and the drifting one's from 10.8-12.3 to
// 6.2-6.7, at 10-15% more CPU for a call that finds a rebuilt snapshot unwarmed (every node's bound
// data). Before them (candidates and a bound per fitting node) it had made a cold call 1.7x slower
// there, and was used only from 64 shapes on. Speed only: the choice is the same either way.
func (e *Engine) Bounded(r *Request) bool {
	_, ok := e.PolicyFor(r).(tesseraPolicy)
	return ok
}

// Bound returns an upper bound of r's best score on n (Evaluate's score), or why r does not fit n
// (as Evaluate would say it); +Inf where the node has more GPUs than the bound keeps (no pruning).
// nb is n's NodeBound when the caller kept one (nil: computed, and returned for keeping). Only for
// requests whose policy is Bounded.
func (e *Engine) Bound(sc *ScoreContext, n *NodeState, r *Request, nb *NodeBound, explain bool) (float64, *NodeBound, *Unfit) {
	sc.lastNode = nil // n may have changed since it was last seen (loadBefore)
	sc.compiledPlan()
	if nb == nil { // first: kept, it serves every request, also those that do not fit n
		nb = sc.nodeBound(n)
	}
	sc.arena.reset()
	cands, u := candidates(&sc.arena, n, r, explain)
	if u != nil {
		return 0, nb, u
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
	pl := sc.loadBefore(sc.floorMeasure(), n, false)
	st := sc.beforeStats(n)
	nb := &NodeBound{frag: sc.lastFrag, mix: pl.mixAt(n), cpuFree: math.MaxInt64, memFree: math.MaxInt64, total: n.FreeMilli(), ngpus: len(n.GPUs), balanced: sc.HostBound}
	nb.stranded = max(0, sc.floorOf(nb.mix, n, nb.total))
	nb.fragNoFloor = nb.frag // the same where nothing is stranded (max(0, v) = v): no second pass
	if nb.stranded > 0 {
		nb.fragNoFloor = pl.frag(n, st, measureFedNoFloor)
	}
	nb.pressure = sc.maxPressure(n)
	if n.CPUMilli > 0 {
		nb.cpuFree = n.CPUMilli - n.UsedCPU
	}
	if n.MemMiB > 0 {
		nb.memFree = n.MemMiB - n.UsedMem
	}
	for i := range n.GPUs {
		g := &n.GPUs[i]
		nb.gpus[i] = boundGPU{memory: g.Memory, usedMemory: g.UsedMemory, free: int32(g.FreeMilli()), shareable: g.Usable && !g.Whole, freeWhole: g.FreeWhole()}
	}
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
	gain, floor := nb.frag, nb.stranded > 0
	if sc.tesseraMeasure(r) == measureFedNoFloor {
		gain, floor = nb.fragNoFloor, false
	}
	touched, ok := touchedGPUs(p)
	if total > 0 && total2 > 0 && ok && touched < 1<<len(nb.u) {
		d := float64(total - total2)
		if !floor {
			// No floor before (nothing stranded, or a share's measure): each shape's gain is at
			// most its fragment's change, Σ_k d_k·U(k) - fa_k·B(k) over the touched GPUs.
			g := 0.0
			for m := touched; m != 0; m &= m - 1 {
				i := bits.TrailingZeros64(m)
				fa, b := sc.stopsServing(nb, &n.GPUs[i], &after.GPUs[i], nb.u[i])
				g += float64(n.GPUs[i].FreeMilli()-after.GPUs[i].FreeMilli())*nb.u[i] - fa*b
			}
			gain = min(gain, g)
		} else {
			D := nb.stranded - sc.floorOf(nb.mix, after, total2) // how far the floor falls
			if bits.OnesCount64(touched) == 1 {
				i := bits.TrailingZeros64(touched)
				u := nb.u[i]
				fa, b := sc.stopsServing(nb, &n.GPUs[i], &after.GPUs[i], u)
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
	}
	gain += boundSlack + sc.pressureGain(n, p) // exact
	return squash(gain) - 1e-3*gpuTightnessAfter(n, p)
}

// stopsServing returns the free compute fa a placement leaves on GPU g (a after it) and B, a lower
// bound of the weight of the shapes outside L that g served before and a does not (u is g's U).
func (sc *ScoreContext) stopsServing(nb *NodeBound, g, a *GPUState, u float64) (fa, b float64) {
	wg, wa := sc.plan.unrestricted, sc.plan.unrestricted
	if sc.plan.counts(g) {
		wg = sc.plan.failWeight(sc.masks.mask(g))
	}
	if sc.plan.counts(a) {
		wa, fa = sc.plan.failWeight(sc.masks.mask(a)), float64(a.FreeMilli())
	}
	return fa, min(max(0, wa-wg-nb.wl), nb.w-u)
}

// CoarseBound is an upper bound of r's best score on n, mostly looser than Bound's, that costs a
// pass over n's GPUs only: no candidate placements, no state after a placement. It is for requests of
// one container of whole GPUs or shares (ok false otherwise, and for nodes of more than 8 GPUs: use
// Bound). It checks only what is cheap of the fit (CPU, memory, enough GPUs that could take a share
// or be given whole: -Inf where they are missing); a node it bounds may still not fit (Bound and
// Evaluate say why). nb as for Bound.
//
// Why it holds: Bound's sums with what they read of the state after a placement replaced by its
// extremes. The floor falls by D <= min(d, stranded before): the stranded compute after is not
// negative, and the placement takes d of the free compute and CPU and memory, never gives any. So
// with one GPU i touched, max(D, d)·U + max(D, -fa)·B + max(D, 0)·(W - U - B) <= d·U(i) + min(d,
// stranded)·(W - U(i)); with more, max(D, 0)·W + Σ_k d_k·U(k) <= min(d, stranded)·W + d·max U.
// With the two-sided floor (host-bound) D is at most the floor before, which may exceed d: max(D, d)
// replaces d. A share (scored without the floor: the linear sum) on GPU k leaves fa_k = free_k - d_k, and
// every shape it served (W - U(k)) that asks more compute than fa_k it serves no more: B(k) >= W -
// U(k) - servable(fa_k); the sum over the touched GPUs is at most that of the k largest terms. The
// tie-break (how full the placement leaves its GPUs) is at least the least a fitting GPU leaves.
func (e *Engine) CoarseBound(sc *ScoreContext, n *NodeState, r *Request, nb *NodeBound) (float64, *NodeBound, bool) {
	if len(r.Containers) != 1 || len(n.GPUs) > len(NodeBound{}.u) {
		return 0, nb, false
	}
	c := &r.Containers[0]
	k := c.Whole + c.Shares
	if (c.Whole > 0) == (c.Shares > 0) || len(c.MIG) > 0 || len(c.Mdev) > 0 {
		return 0, nb, false
	}
	if nb == nil {
		sc.lastNode = nil
		sc.compiledPlan()
		if nb = sc.nodeBound(n); nb == nil {
			return 0, nil, false
		}
	}
	if r.CPUMilli > nb.cpuFree || r.MemMiB > nb.memFree {
		return math.Inf(-1), nb, true
	}
	var free [8]int
	var fits uint8 // the GPUs that could take a part of r (shareFits, FreeWhole)
	total := nb.total
	for i := range nb.ngpus {
		g := &nb.gpus[i]
		free[i] = int(g.free)
		ok := g.freeWhole
		if c.Shares > 0 {
			ok = g.shareable && shareRoom(free[i], g.memory, g.usedMemory, c)
		}
		if ok && (!r.modelRestricted() || r.modelAllowed(n.GPUs[i].Model)) {
			fits |= 1 << i
		}
	}
	if bits.OnesCount8(fits) < k {
		return math.Inf(-1), nb, true
	}
	// Where a share placement's measure has no floor (tesseraMeasure), or nothing is stranded, its
	// gain is at most the sum of its GPUs' d·U - fa·B (as in scoreBound), with B at least what a GPU
	// served before (W - U) less all that asks no more compute than fa (servable).
	noFloor := sc.tesseraMeasure(r) == measureFedNoFloor
	linear := c.Shares > 0 && (nb.stranded == 0 || noFloor)
	frag := nb.frag
	if noFloor {
		frag = nb.fragNoFloor
	}
	pl := sc.compiledPlan()
	var gain, left, term [8]float64 // per GPU in fits: the gain bound, the compute it leaves free, its linear term
	dmax, umax, leftMin, best := 0, 0.0, math.Inf(1), math.Inf(-1)
	for m := fits; m != 0; m &= m - 1 {
		i := bits.TrailingZeros8(m)
		d := c.Milli
		if c.Whole > 0 {
			d = free[i]
		}
		dmax, umax = max(dmax, d), max(umax, nb.u[i])
		left[i] = float64(free[i]-d) / MilliPerGPU
		leftMin = min(leftMin, left[i])
		df := float64(d)
		if linear {
			fa := min(max(free[i]-d, 0), MilliPerGPU)
			term[i] = df*nb.u[i] - float64(fa)*max(0, nb.w-nb.u[i]-pl.servable[fa])
		} else {
			fall := nb.floorFall(df)
			term[i] = max(df, fall)*nb.u[i] + fall*max(0, nb.w-nb.u[i])
		}
		gain[i] = frag
		if d < total {
			gain[i] = min(frag, term[i])
		}
		gain[i] += df * nb.pressure // at least the pressure term: d on models of at most that coefficient
		best = max(best, gain[i])
	}
	if k > 1 {
		g := frag
		if d := k * dmax; d < total && linear {
			g = min(frag, largest(term, fits, k))
		} else if d < total {
			df := float64(d)
			g = min(frag, df*umax+nb.floorFall(df)*nb.w)
		}
		g += float64(k*dmax) * nb.pressure
		return squash(g+boundSlack) - 1e-3*leftMin, nb, true
	}
	// One squash for the node: only the GPUs whose gain reaches best's integer score can set the
	// tie-break (any other is a whole point lower); from a threshold a little below, to be safe.
	q := squash(best + 2*boundSlack)
	from := squashFrom[int(q)]
	tie := math.Inf(1)
	for m := fits; m != 0; m &= m - 1 {
		if i := bits.TrailingZeros8(m); gain[i]+boundSlack >= from {
			tie = min(tie, left[i])
		}
	}
	return q - 1e-3*tie, nb, true
}

// floorFall is how far a placement that takes d of the free compute can lower the node's floor at
// most: the stranded compute by d at most, the two-sided floor by all of it (it is not negative).
func (nb *NodeBound) floorFall(d float64) float64 {
	if nb.balanced {
		return nb.stranded
	}
	return min(d, nb.stranded)
}

// largest is the sum of the k largest of t's entries in set.
func largest(t [8]float64, set uint8, k int) float64 {
	var top [8]float64 // descending
	n := 0
	for m := set; m != 0; m &= m - 1 {
		v := t[bits.TrailingZeros8(m)]
		j := min(n, k-1)
		if j < n && top[j] >= v {
			continue
		}
		for ; j > 0 && top[j-1] < v; j-- {
			top[j] = top[j-1]
		}
		top[j] = v
		n = min(n+1, k)
	}
	s := 0.0
	for _, v := range top[:n] {
		s += v
	}
	return s
}

// squash is the integer score 0..100 of a fragmentation gain (FGD's; tessera's before its tie-break).
func squash(gain float64) float64 { return math.Trunc(100 / (1 + math.Exp(-gain/MilliPerGPU))) }

// squashFrom[q] is a little below the least gain squash takes to q (q = 1..100; -Inf for 0).
var squashFrom = func() (t [101]float64) {
	t[0] = math.Inf(-1)
	for q := 1; q < 100; q++ {
		g := -MilliPerGPU * math.Log(100/float64(q)-1)
		t[q] = g - 1e-6*(1+math.Abs(g))
	}
	t[100] = t[99]
	return t
}()
