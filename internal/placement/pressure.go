package placement

import (
	"math"
	"slices"
	"strings"
)

// Model pressure: where pods restricted to GPU models are many, a pod that may use any model should
// go where the restricted ones need the capacity least. FGD gets a version of this from its measure
// (a model's free compute is a fragment for every shape that may not use it), but that term weighs
// the restricted pods by count only, not against each model's capacity: with the restrictions spread
// over the models in proportion to their GPUs it pulls unrestricted pods onto the small models and
// starves the pods that can only run there, which is why tessera's measure leaves it out
// (policy_tessera.go). Without it, though, nothing keeps unrestricted pods off a small model that
// restricted pods crowd: on the FGD paper's gpuspec20 trace (T4-only pods 9% of the pods, T4 14% of
// the GPUs) tessera left 10.8% of the GPUs unallocated against FGD's 5.6 (docs/placement.md).
//
// The pressure of a model M is the share of the GPU request that only M (with the other models of
// its allowed set) can serve, against M's share of the free GPU compute, summed over the allowed
// sets S that contain M:
//
//	r(M) = Σ_{S ∋ M} request(S) / request(all GPU pods) · free(all) / free(S)
//
// where free(S) is the free compute of S's models: r(M) = 1 means that if the cluster filled with the
// arrival mix, the pods restricted to M's sets would take all the compute left there. tessera's gain
// for placing compute on M adds coef(M) = W·(1 - min(1, r(M))) per per-mille taken, W the share of pods
// that are restricted: unrestricted pods fill the models with the most room beyond their restricted
// demand first, and as those fill, their pressure rises, so the models' free compute settles in
// proportion to the demand only they can serve. Free compute is the cluster's now, so the pressure
// follows the cluster (fill, drain, nodes added); it is held in the typical-shape snapshot and
// recomputed once a coefficient moved by pressureMove of W, so that everything keyed by the snapshot
// (fragmentation cache, evaluation memo, score bounds) stays exact. With no restricted pods W is 0
// and the score is FGD-with-multi-resource as before.

// pressureMove is how far a coefficient may drift (relative to W) before the snapshot takes new ones:
// on the six traces the pressure was explored on (seeds 42..45) the simulator's results with
// coefficients recomputed at every arrival, or past 0.03, 0.05 or 0.1 of W, are within 0.08 points.
const pressureMove = 0.05

// setDemand is what the pods restricted to one set of GPU models ask for.
type setDemand struct {
	models []string // sorted, without repeats
	pods   int
	milli  int64 // GPU request (per-mille) of those pods
}

// modelPressure is the score's per-model coefficients (gain per per-mille of compute taken).
type modelPressure struct {
	w    float64 // the share of GPU pods that are restricted: the largest coefficient
	coef map[string]float64
	// byID is coef by GPUState.modelID (numbered models), for the scoring loop.
	byID []float64
}

// pressureOf computes the coefficients from the restricted demand, the observed pods (count and GPU
// request) and the free compute per model; nil when no pod is restricted or nothing is known free.
func pressureOf(demand map[string]*setDemand, pods int, milli int64, free map[string]int64) *modelPressure {
	if len(demand) == 0 || pods <= 0 || milli <= 0 || len(free) == 0 {
		return nil
	}
	var total float64
	for _, f := range free {
		total += float64(max(f, 0))
	}
	restricted := 0
	r := make(map[string]float64, len(free))
	for _, d := range demand {
		restricted += d.pods
		fs := 0.0
		for _, m := range d.models {
			fs += float64(max(free[m], 0))
		}
		if fs <= 0 {
			continue // every model it may use is full: no room left to protect
		}
		for _, m := range d.models {
			r[m] += float64(d.milli) / float64(milli) * total / fs
		}
	}
	w := float64(restricted) / float64(pods)
	coef := make(map[string]float64, len(free))
	for m := range free {
		coef[m] = w * (1 - min(1, r[m]))
	}
	return newModelPressure(w, coef)
}

func newModelPressure(w float64, coef map[string]float64) *modelPressure {
	mp := &modelPressure{w: w, coef: coef}
	for m, c := range coef {
		id := int(numberModel(m))
		if id >= len(mp.byID) {
			mp.byID = slices.Grow(mp.byID, id+1-len(mp.byID))[:id+1]
		}
		mp.byID[id] = c
	}
	return mp
}

// moved reports whether q's coefficients differ from p's by more than pressureMove of W.
func (p *modelPressure) moved(q *modelPressure) bool {
	if (p == nil) != (q == nil) {
		return true
	}
	if p == nil {
		return false
	}
	scale := max(p.w, q.w)
	for m, c := range q.coef {
		if math.Abs(c-p.coef[m]) > pressureMove*scale {
			return true
		}
	}
	return len(p.coef) != len(q.coef)
}

// of is g's coefficient.
func (p *modelPressure) of(g *GPUState) float64 {
	if g.modelID > 0 && int(g.modelID) < len(p.byID) {
		return p.byID[g.modelID]
	}
	return p.coef[g.Model]
}

// pressureGain is the pressure term of p's gain on n: every device's compute taken times its
// model's coefficient.
func (sc *ScoreContext) pressureGain(n *NodeState, p *Placement) float64 {
	if sc.pressure == nil {
		return 0
	}
	g := 0.0
	for _, d := range p.Devices {
		take := d.Milli
		if d.Whole {
			take = MilliPerGPU
		}
		g += sc.pressure.of(&n.GPUs[d.GPU]) * float64(take)
	}
	return g
}

// maxPressure is the largest coefficient of n's GPUs' models (0 without pressure).
func (sc *ScoreContext) maxPressure(n *NodeState) float64 {
	if sc.pressure == nil {
		return 0
	}
	m := 0.0
	for i := range n.GPUs {
		m = max(m, sc.pressure.of(&n.GPUs[i]))
	}
	return m
}

// modelSetKey is a request's allowed models as a demand key: sorted, without repeats ("" for none).
func modelSetKey(models []string) (string, []string) {
	if len(models) == 0 {
		return "", nil
	}
	ms := slices.Clone(models)
	slices.Sort(ms)
	ms = slices.Compact(ms)
	return strings.Join(ms, "|"), ms
}
