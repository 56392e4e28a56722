package extender

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"
)

// Preempt answers the preemption verb. The scheduler picks victims by counting GPU and share
// tokens, not by which GPUs they free, so its victims may free none the preemptor fits on. Per
// candidate node: where its victims free a GPU the request fits on, they are kept as the scheduler
// chose them (with its count of PodDisruptionBudget violations); where they do not, the node's pods
// of lower priority than the preemptor (the scheduler's victims among them) whose GPUs free one are
// named instead (victimsFreeing: the fewest budget violations, then the fewest pods, then the lowest
// summed priority), with the violations they cause counted as the scheduler counts its own
// (pdbViolations), so that it picks among nodes knowing them; where none do, the node is dropped.
func (x *Extender) Preempt(args *extenderv1.ExtenderPreemptionArgs) *extenderv1.ExtenderPreemptionResult {
	out := &extenderv1.ExtenderPreemptionResult{NodeNameToMetaVictims: map[string]*extenderv1.MetaVictims{}}
	if args.Pod == nil {
		return out
	}
	req, err := x.State.request(args.Pod, x.Class)
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
		named, ok := x.State.victimsFreeing(node, uids, req, priority, violations)
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
