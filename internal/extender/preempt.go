package extender

import (
	"cmp"
	"math"
	"slices"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	"github.com/tessera-gpu/tessera/internal/placement"
)

// Preempt answers the preemption verb. The scheduler picks victims by counting GPU and share
// tokens, not by which GPUs they free, so its victims may free none the preemptor fits on. Per
// candidate node: where its victims free a GPU the request fits on, they are kept as the scheduler
// chose them (with its count of PodDisruptionBudget violations); where they do not, the node's pods
// of lower priority than the preemptor (the scheduler's victims among them) whose GPUs free one are
// named instead (VictimsFreeing: the fewest budget violations, then the fewest pods, then the lowest
// summed priority), with the violations they cause counted as the scheduler counts its own
// (pdbViolations), so that it picks among nodes knowing them; where none do, the node is dropped.
func (x *Extender) Preempt(args *extenderv1.ExtenderPreemptionArgs) *extenderv1.ExtenderPreemptionResult {
	out := &extenderv1.ExtenderPreemptionResult{NodeNameToMetaVictims: map[string]*extenderv1.MetaVictims{}}
	if args.Pod == nil {
		return out
	}
	req, err := RequestFromPod(args.Pod, x.Class)
	if err != nil {
		return out
	}
	var priority int32
	if args.Pod.Spec.Priority != nil {
		priority = *args.Pod.Spec.Priority
	}
	victims := map[string][]types.UID{}
	meta := map[string]*extenderv1.MetaVictims{}
	for node, v := range args.NodeNameToMetaVictims {
		meta[node] = v
		for _, p := range v.Pods {
			victims[node] = append(victims[node], types.UID(p.UID))
		}
	}
	for node, v := range args.NodeNameToVictims {
		mv := &extenderv1.MetaVictims{NumPDBViolations: v.NumPDBViolations}
		for _, p := range v.Pods {
			mv.Pods = append(mv.Pods, &extenderv1.MetaPod{UID: string(p.UID)})
			victims[node] = append(victims[node], p.UID)
		}
		meta[node] = mv
	}
	violations := x.pdbViolations()
	for node, uids := range victims {
		named, ok := x.State.VictimsFreeing(node, uids, req, priority, violations)
		switch {
		case !ok:
		case named == nil:
			out.NodeNameToMetaVictims[node] = meta[node]
		default:
			mv := &extenderv1.MetaVictims{NumPDBViolations: int64(violations(named))}
			for _, uid := range named {
				mv.Pods = append(mv.Pods, &extenderv1.MetaPod{UID: string(uid)})
			}
			out.NodeNameToMetaVictims[node] = mv
		}
	}
	return out
}

// pdbViolations returns a function counting how many of a set of pods would be evicted against a
// PodDisruptionBudget, as kube-scheduler counts its victims' (default preemption's
// filterPodsWithPDBViolation): each budget in the pod's namespace whose selector (not empty) matches
// the pod's labels, the pod not already in its disrupted pods, takes one of its allowed disruptions;
// a pod that takes one past zero violates. Without the listers it counts none.
func (x *Extender) pdbViolations() func([]types.UID) int {
	if x.PDBs == nil || x.PodByUID == nil {
		return func([]types.UID) int { return 0 }
	}
	pdbs := x.PDBs()
	selectors := make([]labels.Selector, len(pdbs))
	for i, pdb := range pdbs {
		if sel, err := metav1.LabelSelectorAsSelector(pdb.Spec.Selector); err == nil && !sel.Empty() {
			selectors[i] = sel
		}
	}
	matches := map[types.UID][]int{} // the budgets a pod counts against, by UID
	budgetsOf := func(uid types.UID) []int {
		if m, ok := matches[uid]; ok {
			return m
		}
		var m []int
		if pod := x.PodByUID(uid); pod != nil && len(pod.Labels) > 0 {
			for i, pdb := range pdbs {
				if selectors[i] == nil || pdb.Namespace != pod.Namespace || !selectors[i].Matches(labels.Set(pod.Labels)) {
					continue
				}
				if _, gone := pdb.Status.DisruptedPods[pod.Name]; !gone {
					m = append(m, i)
				}
			}
		}
		matches[uid] = m
		return m
	}
	allowed := make([]int32, len(pdbs))
	return func(uids []types.UID) int {
		for i, pdb := range pdbs {
			allowed[i] = pdb.Status.DisruptionsAllowed
		}
		n := 0
		for _, uid := range uids {
			violates := false
			for _, i := range budgetsOf(uid) {
				if allowed[i]--; allowed[i] < 0 {
					violates = true
				}
			}
			if violates {
				n++
			}
		}
		return n
	}
}

// maxVictimSearch bounds the pods whose subsets VictimsFreeing tries (2^n fit checks of a node);
// past it, it adds pods greedily, lowest priority first.
const maxVictimSearch = 12

// VictimsFreeing reports whether req fits the node once victims are gone (named nil), or else once
// some set of the victims and the node's other GPU pods of priority below the preemptor's are gone
// (named: the fewest budget violations by violations, then the fewest pods, then the lowest summed
// priority; past maxVictimSearch candidates, greedily by priority alone).
func (s *State) VictimsFreeing(node string, victims []types.UID, req *placement.Request, below int32, violations func([]types.UID) int) (named []types.UID, ok bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.fitsWithoutLocked(node, victims, req) {
		return nil, true
	}
	// The candidates: the scheduler's victims (chosen by it below the preemptor's priority) and the
	// node's other GPU pods below it, lowest priority first, then by name.
	type cand struct {
		uid      types.UID
		priority int32
		key      string
	}
	var cands []cand
	seen := map[types.UID]bool{}
	for _, uid := range victims {
		if seen[uid] {
			continue
		}
		seen[uid] = true
		// A victim without a GPU (it frees CPU or memory) has no entry of its own: the scheduler
		// chose it below the preemptor, so it costs as the dearest pod that may go.
		c := cand{uid, below - 1, string(uid)}
		if p := s.pods[uid]; p != nil {
			c.priority, c.key = p.priority, p.key
		}
		cands = append(cands, c)
	}
	for uid, p := range s.podsOn[node] {
		if !seen[uid] && p.applied && !p.reserved && p.priority < below {
			cands = append(cands, cand{uid, p.priority, p.key})
		}
	}
	slices.SortFunc(cands, func(a, b cand) int {
		if a.priority != b.priority {
			return cmp.Compare(a.priority, b.priority)
		}
		return strings.Compare(a.key, b.key)
	})
	chosen := make([]bool, len(cands))
	set := func() []types.UID { // the chosen candidates
		var out []types.UID
		for i := range cands {
			if chosen[i] {
				out = append(out, cands[i].uid)
			}
		}
		return out
	}
	if len(cands) > maxVictimSearch {
		// The shortest prefix that frees a GPU, then its pods given back, highest priority first,
		// where the rest still frees one (as the scheduler reprieves).
		for i := range cands {
			chosen[i] = true
			if !s.fitsWithoutLocked(node, set(), req) {
				continue
			}
			for j := i; j >= 0; j-- {
				chosen[j] = false
				if !s.fitsWithoutLocked(node, set(), req) {
					chosen[j] = true
				}
			}
			return set(), true
		}
		return nil, false
	}
	choose := func(mask uint64) (n int, sum int64) {
		for i := range cands {
			if chosen[i] = mask>>i&1 == 1; chosen[i] {
				n, sum = n+1, sum+int64(cands[i].priority)
			}
		}
		return n, sum
	}
	best, bestV, bestN, bestSum := uint64(0), math.MaxInt, len(cands)+1, int64(0)
	for mask := uint64(1); mask < 1<<len(cands); mask++ {
		n, sum := choose(mask)
		uids := set()
		v := violations(uids)
		if cmp.Or(cmp.Compare(v, bestV), cmp.Compare(n, bestN), cmp.Compare(sum, bestSum)) >= 0 || !s.fitsWithoutLocked(node, uids, req) {
			continue
		}
		best, bestV, bestN, bestSum = mask, v, n, sum
	}
	if best == 0 {
		return nil, false
	}
	choose(best)
	return set(), true
}

// fitsWithoutLocked reports whether req fits the node once the given pods' GPUs, CPU and memory are
// freed.
func (s *State) fitsWithoutLocked(node string, victims []types.UID, req *placement.Request) bool {
	e := s.nodes[node]
	if e == nil || e.inv == nil {
		return false
	}
	n := e.state.Clone()
	for _, uid := range victims {
		if p := s.pods[uid]; p != nil && p.node == node && p.applied {
			n.Release(&placement.Request{}, &p.placement)
		}
		if u := s.uses[uid]; u != nil && u.node == node && u.applied {
			n.AddUse(-u.cpu, -u.mem)
		}
	}
	_, unfit := placement.Candidates(n, req)
	return unfit == nil
}
