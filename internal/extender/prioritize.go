package extender

import (
	"maps"
	"math"
	"runtime"
	"slices"

	"k8s.io/apimachinery/pkg/types"
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
	names := nodeNames(args)
	out := make(extenderv1.HostPriorityList, 0, len(names))
	if args.Pod == nil {
		return &out, nil
	}
	req, err := RequestFromPod(args.Pod, x.Class)
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
	scs, snapshot := x.scoreContexts(workers)
	ev := x.lastEval.Load()
	if ev != nil && (ev.uid != args.Pod.UID || ev.snapshot != snapshot || !sameRequest(ev.req, req) || !slices.Equal(ev.names, names)) {
		ev = nil // another pod, shape snapshot or node list: evaluate afresh
	}
	x.State.viewIndexed(names, workers, func(w, i int, n *placement.NodeState, _ string) {
		if n == nil {
			return
		}
		if ev != nil {
			if e := &ev.entries[i]; e.state == n && e.version == n.Version() {
				raw[i], fits[i], gen[i] = e.score, true, e.gen
				return
			}
		}
		p, s, u := x.Engine.EvaluateScratch(scs[w], n, req, false)
		if u != nil {
			return
		}
		raw[i], fits[i] = s, true
		gen[i] = placementGeneration(n, &p)
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

// filterEval is what Filter computed for the pod's fitting nodes, for the Prioritize call that
// follows it in the same scheduling cycle with the nodes Filter kept (names): per node, the score and
// placement generation, valid while the node state is the same object at the same version and the
// shape snapshot and the request are unchanged.
type filterEval struct {
	uid      types.UID
	req      *placement.Request
	snapshot *placement.FragCache
	names    []string
	entries  []evalEntry // by position in names
}

type evalEntry struct {
	state      *placement.NodeState
	version    uint64
	score, gen float64
}

// scoreContexts returns one context per worker on one shape snapshot (scores stay comparable), and
// the snapshot's identity (its cache).
func (x *Extender) scoreContexts(workers int) ([]*placement.ScoreContext, *placement.FragCache) {
	sc0 := x.State.Shapes().ScoreContext()
	scs := make([]*placement.ScoreContext, workers)
	for w := range scs {
		scs[w] = &placement.ScoreContext{Shapes: sc0.Shapes, Cache: sc0.Cache}
	}
	return scs, sc0.Cache
}

// sameRequest reports whether two parsed requests place the same way.
func sameRequest(a, b *placement.Request) bool {
	if a.CPUMilli != b.CPUMilli || a.MemMiB != b.MemMiB || a.Class != b.Class || a.Policy != b.Policy ||
		!slices.Equal(a.Models, b.Models) || len(a.Containers) != len(b.Containers) {
		return false
	}
	for i := range a.Containers {
		ca, cb := &a.Containers[i], &b.Containers[i]
		if ca.Name != cb.Name || ca.Whole != cb.Whole || ca.Shares != cb.Shares || ca.Memory != cb.Memory ||
			ca.MemoryPercent != cb.MemoryPercent || ca.Milli != cb.Milli || !maps.Equal(ca.MIG, cb.MIG) || !maps.Equal(ca.Mdev, cb.Mdev) {
			return false
		}
	}
	return true
}

// placementGeneration is the newest compute capability among the GPUs a placement uses.
func placementGeneration(n *placement.NodeState, p *placement.Placement) float64 {
	g := 0
	for _, d := range p.Devices {
		g = max(g, n.GPUs[d.GPU].Gen)
	}
	return float64(g)
}

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
