package extender

import (
	"math"
	"runtime"

	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// classWeight is the share of the 0..10 score given to the workload-class preference (older GPUs
// for experiment and inference pods, seed 002) when a pod has such a class.
const classWeight = 0.3

// Prioritize scores the nodes 0..10 with the pod's policy (normalised over the candidates), blended
// with the seed's preferences: experiment and inference pods prefer older, lower-compute GPUs.
func (x *Extender) Prioritize(args *extenderv1.ExtenderArgs) (*extenderv1.HostPriorityList, error) {
	x.calls.Add(1)
	defer x.calls.Add(-1)
	names := nodeNames(args)
	out := make(extenderv1.HostPriorityList, 0, len(names))
	if args.Pod == nil {
		return &out, nil
	}
	req, err := x.State.request(args.Pod, x.Class)
	if err == nil {
		req, err = x.withClaims(args.Pod, req)
	}
	if err != nil {
		for _, n := range names {
			out = append(out, extenderv1.HostPriority{Host: n, Score: 0})
		}
		return &out, nil
	}
	raw := make([]float64, len(names))
	gen := make([]float64, len(names))
	fits := make([]bool, len(names))
	workers := runtime.GOMAXPROCS(0)
	ev := x.evaluation(req, workers)
	defer ev.Release()
	x.State.viewIndexed(names, workers, func(w, i, slot int, n *placement.NodeState, _ string) {
		if n == nil {
			return
		}
		if o := ev.Exact(w, slot, n, false); o.Unfit == nil {
			raw[i], fits[i], gen[i] = o.Score, true, o.Gen
		}
	})
	pol := normalise(raw, fits, false)
	var pref []float64
	if req.Class == api.WorkloadExperiment || req.Class == api.WorkloadInference {
		pref = normalise(gen, fits, true)
	}
	for j, n := range names {
		s := pol[j]
		if pref != nil {
			s = (1-classWeight)*s + classWeight*pref[j]
		}
		out = append(out, extenderv1.HostPriority{Host: n, Score: int64(math.Round(s))})
	}
	return &out, nil
}

// evaluation starts req's evaluation on the current shape snapshot for workers goroutines (the
// evaluator's memo serves it: see placement.Evaluator).
func (x *Extender) evaluation(req *placement.Request, workers int) *placement.Evaluation {
	return x.eval.Begin(x.Engine, x.State.Shapes().ScoreContext(), req, x.State.nodeSlots(), workers)
}

// Evaluations counts the node outcomes filter and prioritize took from the evaluation memo and
// those they evaluated (the memo's hit rate, for metrics).
func (x *Extender) Evaluations() (remembered, evaluated int64) {
	c := x.eval.Counts()
	return c.Remembered, c.Evaluated
}

// Bounded counts the nodes pick-one Filter bounded instead of evaluating (most are never evaluated).
func (x *Extender) Bounded() int64 { return x.eval.Counts().Bounded }

// Warmed counts the node outcomes the warmer evaluated off the request path (warm.go).
func (x *Extender) Warmed() int64 { return x.eval.Counts().Warmed }

// normalise maps the fitting entries' values linearly onto 0..10 (10 = best; lowest value best when
// invert); non-fitting entries get 0, and all-equal values get 10.
func normalise(v []float64, fits []bool, invert bool) []float64 {
	lo, hi := math.Inf(1), math.Inf(-1)
	for i, x := range v {
		if fits[i] {
			lo, hi = min(lo, x), max(hi, x)
		}
	}
	out := make([]float64, len(v))
	for i, x := range v {
		switch {
		case !fits[i]:
		case hi-lo < placement.ScoreEpsilon:
			out[i] = float64(extenderv1.MaxExtenderPriority)
		case invert:
			out[i] = float64(extenderv1.MaxExtenderPriority) * (hi - x) / (hi - lo)
		default:
			out[i] = float64(extenderv1.MaxExtenderPriority) * (x - lo) / (hi - lo)
		}
	}
	return out
}
