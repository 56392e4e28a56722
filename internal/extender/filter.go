package extender

import (
	"cmp"
	"fmt"
	"math"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
	"github.com/tessera-gpu/tessera/internal/telemetry"
)

// nodeNames returns the candidate node names of an extender call (nodeCacheCapable or not).
func nodeNames(args *extenderv1.ExtenderArgs) []string {
	if args.NodeNames != nil {
		return *args.NodeNames
	}
	if args.Nodes == nil {
		return nil
	}
	out := make([]string, len(args.Nodes.Items))
	for i := range args.Nodes.Items {
		out[i] = args.Nodes.Items[i].Name
	}
	return out
}

// Filter keeps the nodes where the pod's GPU request really fits - a GPU for each share, whole
// GPUs not locked to shares, allowed models, its pool - and says why for every other node.
func (x *Extender) Filter(args *extenderv1.ExtenderArgs) *extenderv1.ExtenderFilterResult {
	fr := x.filter(args)
	defer fr.release()
	return fr.result()
}

// A node's verdict in a filter call.
const (
	verdictFits = iota
	verdictFailed
	verdictUnresolvable
)

// filterReply is a filter call's answer before it is an ExtenderFilterResult: the refused nodes'
// reasons stay in the call's per-node slices (the HTTP reply is written from them), as the result's
// maps of thousands of refused nodes were most of what a call allocated.
type filterReply struct {
	// res has the kept nodes (NodeNames or Nodes) and Error; its reason maps are not filled.
	res     extenderv1.ExtenderFilterResult
	names   []string
	verdict []uint8
	reason  []string
	scratch *filterScratch
}

// result is the reply as the extender API's type.
func (fr *filterReply) result() *extenderv1.ExtenderFilterResult {
	res := fr.res
	res.FailedNodes, res.FailedAndUnresolvableNodes = extenderv1.FailedNodesMap{}, extenderv1.FailedNodesMap{}
	for i, name := range fr.names {
		switch fr.verdict[i] {
		case verdictFailed:
			res.FailedNodes[name] = fr.reason[i]
		case verdictUnresolvable:
			res.FailedAndUnresolvableNodes[name] = fr.reason[i]
		}
	}
	return &res
}

// outcome is the reply's result for CallObserver: an error, unschedulable (no node kept and some
// refused: an empty node list alone is no refusal), or ok.
func (fr *filterReply) outcome() string {
	if fr.res.Error != "" {
		return telemetry.ResultError
	}
	if keptAny(&fr.res) {
		return telemetry.ResultOK
	}
	for _, v := range fr.verdict {
		if v != verdictFits {
			return ResultUnschedulable
		}
	}
	return telemetry.ResultOK
}

// keptAny: the result keeps at least one node (by name, or as a Node where the scheduler is not
// nodeCacheCapable).
func keptAny(res *extenderv1.ExtenderFilterResult) bool {
	return res.NodeNames != nil && len(*res.NodeNames) > 0 || res.Nodes != nil && len(res.Nodes.Items) > 0
}

// replyOf turns a result (one the leader answered) into a reply.
func replyOf(res *extenderv1.ExtenderFilterResult) *filterReply {
	fr := &filterReply{res: *res}
	fr.res.FailedNodes, fr.res.FailedAndUnresolvableNodes = nil, nil
	for v, m := range map[uint8]extenderv1.FailedNodesMap{verdictFailed: res.FailedNodes, verdictUnresolvable: res.FailedAndUnresolvableNodes} {
		for name, reason := range m {
			fr.names, fr.verdict, fr.reason = append(fr.names, name), append(fr.verdict, v), append(fr.reason, reason)
		}
	}
	return fr
}

// release gives the per-node slices back (the reply is not read afterwards).
func (fr *filterReply) release() {
	if fr.scratch != nil {
		filterScratches.Put(fr.scratch)
		fr.scratch = nil
	}
}

func (x *Extender) filter(args *extenderv1.ExtenderArgs) *filterReply {
	x.calls.Add(1)
	defer x.calls.Add(-1)
	pod := args.Pod
	names := nodeNames(args)
	sc := getFilterScratch(len(names))
	verdict, reason, scores, gens, bounded := sc.verdict, sc.reason, sc.scores, sc.gens, sc.bounded
	fr := &filterReply{names: names, verdict: verdict, reason: reason, scratch: sc}
	if pod == nil {
		fr.res.Error = "filter: no pod in the request"
		return fr
	}
	failAll := func(why string, unresolvable bool) *filterReply {
		for i := range names {
			verdict[i], reason[i] = verdictFailed, why
			if unresolvable {
				verdict[i] = verdictUnresolvable
			}
		}
		x.finishFilter(args, &fr.res, nil)
		x.event(pod, corev1.EventTypeWarning, "GPUPlacementRefused", "%s", why)
		return fr
	}
	base, err := x.State.request(pod, x.Class)
	if err != nil {
		return failAll(err.Error(), true)
	}
	req, err := x.withClaims(pod, base)
	if err != nil {
		return failAll(err.Error(), true)
	}
	if x.PickOne && pod.UID != "" {
		x.State.unreserve(pod.UID) // an earlier cycle's hold of this pod is not capacity taken from it
	}
	if x.Quotas != nil {
		// Quotas on the device-plugin resources charge those alone (claims have their own quota).
		if why := CheckQuota(x.Quotas(pod.Namespace), x.State.namespaceUsage(pod.Namespace), base); why != "" {
			return failAll(why, false)
		}
	}
	pool, hasPool := pod.Spec.NodeSelector[api.LabelPool]
	// Each node's verdict goes to its own slot (nodes are checked in parallel).
	workers := runtime.GOMAXPROCS(0)
	ev := x.evaluation(req, workers)
	defer ev.Release()
	// Pick-one needs the best node only: nodes are bounded first and evaluated only where the bound
	// reaches the best score (refineBounds).
	bound := x.bounds(req)
	var refine func(again revisit)
	if bound {
		refine = func(again revisit) {
			x.refineBounds(again, ev, req, names, verdict, reason, scores, gens, bounded, &sc.order)
		}
	}
	x.State.viewIndexedThen(names, workers, func(w, i int, slot int, n *placement.NodeState, missing string) {
		switch {
		case n == nil && req.WantsGPU():
			verdict[i], reason[i] = verdictFailed, missing
		case n == nil:
		case hasPool && n.Labels[api.LabelPool] != pool:
			verdict[i], reason[i] = verdictUnresolvable, fmt.Sprintf("node is in GPU pool %q, pod asks for pool %q", n.Labels[api.LabelPool], pool)
		default:
			var o placement.Outcome
			if bound {
				o = ev.Bound(w, slot, n)
			} else {
				o = ev.Exact(w, slot, n, true)
			}
			if o.Unfit != nil {
				verdict[i], reason[i] = refusal(o.Unfit), o.Unfit.Msg
				return
			}
			scores[i], gens[i], bounded[i] = o.Score, o.Gen, o.Kind
		}
	}, refine)
	nfit := 0
	for i := range names {
		if verdict[i] == verdictFits {
			nfit++
		}
	}
	var ok []string
	if x.PickOne && nfit > 1 {
		ok = x.keepBest(req, names, verdict, scores, gens)
	} else {
		ok = make([]string, 0, nfit)
		for i, name := range names {
			if verdict[i] == verdictFits {
				ok = append(ok, name)
			}
		}
	}
	if x.PickOne && len(ok) == 1 && pod.UID != "" {
		x.holdChoice(pod, base, req, ok[0])
	}
	x.finishFilter(args, &fr.res, ok)
	if len(ok) == 0 && len(names) > 0 {
		x.event(pod, corev1.EventTypeWarning, "GPUPlacementRefused", "0/%d nodes can hold the GPU request: %s", len(names), fr.summarize())
	}
	x.log().Debug("filter", "pod", req.Key, "nodes", len(names), "fit", len(ok))
	return fr
}

// filterScratch is Filter's per-node working memory (5,000 nodes: about 170 KB), reused across
// calls so that a call allocates little beyond its reply (fewer GC cycles under a steady stream).
type filterScratch struct {
	verdict      []uint8
	reason       []string
	scores, gens []float64
	bounded      []placement.ScoreKind // ScoreExact, or scores[i] is an upper bound (pick-one's first pass)
	order        []int                 // refineBounds' nodes to evaluate
}

var filterScratches = sync.Pool{New: func() any { return new(filterScratch) }}

// getFilterScratch returns zeroed scratch for n nodes (every verdict "fits", no reasons, scores 0).
func getFilterScratch(n int) *filterScratch {
	sc := filterScratches.Get().(*filterScratch)
	if cap(sc.verdict) < n {
		*sc = filterScratch{verdict: make([]uint8, n), reason: make([]string, n), scores: make([]float64, n), gens: make([]float64, n), bounded: make([]placement.ScoreKind, n)}
		return sc
	}
	sc.verdict, sc.reason, sc.scores, sc.gens, sc.bounded = sc.verdict[:n], sc.reason[:n], sc.scores[:n], sc.gens[:n], sc.bounded[:n]
	clear(sc.verdict)
	clear(sc.bounded)
	clear(sc.reason)
	clear(sc.scores)
	clear(sc.gens)
	return sc
}

// finishFilter fills the result's node list in the form the scheduler sent.
func (x *Extender) finishFilter(args *extenderv1.ExtenderArgs, res *extenderv1.ExtenderFilterResult, ok []string) {
	if args.NodeNames != nil || args.Nodes == nil {
		if ok == nil {
			ok = []string{}
		}
		res.NodeNames = &ok
		return
	}
	keep := map[string]bool{}
	for _, n := range ok {
		keep[n] = true
	}
	list := &corev1.NodeList{}
	for i := range args.Nodes.Items {
		if keep[args.Nodes.Items[i].Name] {
			list.Items = append(list.Items, args.Nodes.Items[i])
		}
	}
	res.Nodes = list
}

// summarize counts the distinct reasons of a filter reply, most frequent first (for Events).
func (fr *filterReply) summarize() string {
	counts := map[string]int{}
	for i, v := range fr.verdict {
		if v != verdictFits {
			counts[fr.reason[i]]++
		}
	}
	reasons := make([]string, 0, len(counts))
	for r := range counts {
		reasons = append(reasons, r)
	}
	sort.Slice(reasons, func(i, j int) bool {
		if counts[reasons[i]] != counts[reasons[j]] {
			return counts[reasons[i]] > counts[reasons[j]]
		}
		return reasons[i] < reasons[j]
	})
	parts := make([]string, 0, len(reasons))
	for i, r := range reasons {
		if i == 5 {
			parts = append(parts, fmt.Sprintf("and %d more reasons", len(reasons)-5))
			break
		}
		parts = append(parts, fmt.Sprintf("%d x %s", counts[r], r))
	}
	return strings.Join(parts, "; ")
}

// choiceTTL is how long Filter's choice is held for the bind that should follow within milliseconds.
const choiceTTL = 15 * time.Second

// keepBest reduces the fitting nodes to the policy's choice: the best score, then (experiment and
// inference pods) the oldest GPU generation, then the smallest name, which is how the FGD paper's
// simulator breaks ties. The kube-scheduler then has one node to bind, whatever its own scores and
// random tie-breaking would prefer. The other fitting nodes are left out of the reply, not listed as
// failed: the scheduler gives a node it does not hear of no status (kube-scheduler's
// findNodesThatPassExtenders), and with one feasible node it skips scoring, so naming thousands of
// nodes "fits, but not chosen" would only cost JSON on both sides (about 300 KB at 5,000 nodes).
func (x *Extender) keepBest(req *placement.Request, names []string, verdict []uint8, scores, gens []float64) []string {
	prefOld := req.Class == api.WorkloadExperiment || req.Class == api.WorkloadInference
	best := -1
	for i := range names {
		if verdict[i] != 0 {
			continue
		}
		switch {
		case best < 0, scores[i] > scores[best]+placement.ScoreEpsilon:
			best = i
		case scores[i] < scores[best]-placement.ScoreEpsilon:
		case prefOld && gens[i] != gens[best]:
			if gens[i] < gens[best] {
				best = i
			}
		case names[i] < names[best]:
			best = i
		}
	}
	return []string{names[best]}
}

// bounds reports whether pick-one Filter bounds req's nodes (and so the warmer too): pick-one, not
// ExhaustivePickOne, and req's policy has a bound (placement.Engine.Bounded).
func (x *Extender) bounds(req *placement.Request) bool {
	return x.PickOne && !x.ExhaustivePickOne && x.Engine.Bounded(req)
}

// refineBounds is pick-one Filter's second pass: it evaluates the bounded nodes (bounded[i]) whose
// bound reaches the best score known, highest bound first, and stops where the next bound is below
// the best score found (by more than keepBest's tie margin: nodes that may tie are evaluated, so
// that its tie-breaks see their scores, unless the tie would go to the leader by name). A coarse
// bound that reaches it is first made a Bound (which also says whether the node fits), and the
// node evaluated only if that reaches it too. Every node left bounded then scores below the choice
// or loses the tie to it, so keepBest picks what it picks after evaluating every node.
func (x *Extender) refineBounds(again revisit, ev *placement.Evaluation, req *placement.Request, names []string, verdict []uint8, reason []string, scores, gens []float64, bounded []placement.ScoreKind, orderBuf *[]int) {
	// The leader is the best exact score found and, where keepBest breaks ties by name (not for
	// experiment or inference pods: GPU generations first), the smallest name among its ties: a
	// node whose bound can at most tie it and whose name is greater cannot be kept either. (An exact
	// score is an integer less k·1e-6/(GPUs placed), k an integer: two that differ, differ by far
	// more than the tie margin, so a tie is an equal score.)
	byName := req.Class != api.WorkloadExperiment && req.Class != api.WorkloadInference
	var lead atomic.Pointer[leader]
	offer := func(score float64, name string) {
		for {
			cur := lead.Load()
			if cur != nil && (score < cur.score-placement.ScoreEpsilon || score <= cur.score+placement.ScoreEpsilon && name >= cur.name) {
				return
			}
			if lead.CompareAndSwap(cur, &leader{score, name}) {
				return
			}
		}
	}
	for i := range verdict {
		if verdict[i] == verdictFits && bounded[i] == placement.ScoreExact {
			offer(scores[i], names[i])
		}
	}
	best := math.Inf(-1)
	if l := lead.Load(); l != nil {
		best = l.score
	}
	// Highest bound first, by integer score (a count sort) and then sorted within each integer only
	// as far as the best score found reaches (most nodes' bounds end far below it).
	pending := func(i int) bool {
		return verdict[i] == verdictFits && bounded[i] != placement.ScoreExact && scores[i] >= best-placement.ScoreEpsilon
	}
	var count [placement.ScoreBuckets + 1]int
	for i := range verdict {
		if pending(i) {
			count[placement.ScoreBucket(scores[i])]++
		}
	}
	for b := placement.ScoreBuckets - 1; b >= 0; b-- {
		count[b] += count[b+1] // count[b]: how many are in buckets b and above
	}
	order := slices.Grow((*orderBuf)[:0], count[0])[:count[0]]
	next := count // next[b+1]: the next free position of bucket b
	for i := range verdict {
		if pending(i) {
			b := placement.ScoreBucket(scores[i])
			order[next[b+1]] = i
			next[b+1]++
		}
	}
	// least is the least bound that can make node i keepBest's choice over the leader l.
	least := func(l *leader, i int) float64 {
		switch {
		case l == nil:
			return math.Inf(-1)
		case byName && names[i] > l.name:
			return math.Nextafter(l.score+placement.ScoreEpsilon, math.Inf(1)) // a tie loses by name
		}
		return l.score - placement.ScoreEpsilon
	}
	refine := func(w, i, slot int, n *placement.NodeState) bool {
		l := lead.Load()
		if scores[i] < least(l, i) {
			// Beaten; sorted by bound: below the leader's score, so is every later bound (stop).
			return scores[i] >= l.score-placement.ScoreEpsilon
		}
		// A coarse bound made a Bound that is beaten stays one: a later node's coarse bound may
		// still reach the leader.
		o := ev.Refine(w, slot, n, placement.Outcome{Score: scores[i], Kind: bounded[i]}, least(lead.Load(), i))
		if o.Unfit != nil {
			verdict[i], reason[i] = refusal(o.Unfit), o.Unfit.Msg
			return true
		}
		scores[i], gens[i], bounded[i] = o.Score, o.Gen, o.Kind
		if o.Kind == placement.ScoreExact {
			offer(scores[i], names[i])
		}
		return true
	}
	for b := placement.ScoreBuckets - 1; b >= 0; b-- {
		if l := lead.Load(); l != nil && placement.BucketTop(b) < l.score-placement.ScoreEpsilon {
			break // this bucket and every lower one
		}
		seg := order[count[b+1]:count[b]]
		// Ties in index order, not by name: which tied node is refined first changes only how many
		// are (offer keeps the smallest name among equal exact scores, least skips the rest), and
		// nodes in one state (placement's twins) share their bound, so a bucket can hold thousands
		// of ties whose names cost more to sort than the few extra refinements.
		slices.SortFunc(seg, func(a, b int) int {
			if c := cmp.Compare(scores[b], scores[a]); c != 0 {
				return c
			}
			return cmp.Compare(a, b)
		})
		again(seg, refine)
	}
	*orderBuf = order
}

// refusal is the verdict of a node that u refuses.
func refusal(u *placement.Unfit) uint8 {
	if u.Unresolvable {
		return verdictUnresolvable
	}
	return verdictFailed
}

// leader is refineBounds' best node so far: its exact score and name.
type leader struct {
	score float64
	name  string
}

// holdChoice reserves Filter's choice (GPUs, CPU and memory) until the bind lands, so that the pods
// the scheduler filters meanwhile see it, as the simulator places pods one after another; only for a
// pod that is pending as the informer shows it (state_pending.go), else the answer stands and
// nothing is held.
// The chosen node is evaluated once more, for its GPUs: the evaluation memo keeps each node's score,
// not its placement (keeping one would cost an allocation per fitting node evaluated and more memo
// memory per table), for one node evaluation per Filter call that already reads thousands of nodes.
//
// base is the pod's request as the informer parsed it, req with its claims' shapes (withClaims): a
// pod whose only GPUs are claims is held as a claim hold (holdClaimChoice), its GPUs until the
// claim is seen allocated, never written as an assignment.
func (x *Extender) holdChoice(pod *corev1.Pod, base, req *placement.Request, node string) {
	why := x.State.holdable(pod, base)
	var a *api.PodAssignment
	if why == "" && req.WantsGPU() {
		x.State.View([]string{node}, func(_ string, n *placement.NodeState, _ string) {
			if n == nil {
				return
			}
			if p, _, u := x.Engine.EvaluateOn(x.State.Shapes().ScoreContext(), n, req); u == nil {
				a = BuildAssignment(n, req, &p)
			}
		})
		if a == nil {
			return
		}
	}
	switch {
	case why != "":
	case a != nil && !base.WantsGPU():
		why = x.State.holdClaimChoice(pod, base, req, a, choiceTTL)
	default:
		why = x.State.holdChoice(pod, req, node, a, choiceTTL)
	}
	if why != "" {
		x.log().Debug("filter: choice answered, not held", "pod", pod.Namespace+"/"+pod.Name, "uid", pod.UID, "node", node, "why", why)
	}
}
