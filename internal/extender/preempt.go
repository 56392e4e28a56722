package extender

import (
	"k8s.io/apimachinery/pkg/types"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	"github.com/tessera-gpu/tessera/internal/placement"
)

// Preempt answers the preemption verb: of the scheduler's candidate nodes and victims, it keeps the
// nodes where evicting those victims frees GPUs the preemptor's request really fits on (the scheduler
// only counts GPU tokens, so it could evict pods that free the wrong GPUs); the victims are kept as
// the scheduler chose them.
func (x *Extender) Preempt(args *extenderv1.ExtenderPreemptionArgs) *extenderv1.ExtenderPreemptionResult {
	out := &extenderv1.ExtenderPreemptionResult{NodeNameToMetaVictims: map[string]*extenderv1.MetaVictims{}}
	if args.Pod == nil {
		return out
	}
	req, err := RequestFromPod(args.Pod, x.Class)
	if err != nil {
		return out
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
	for node, uids := range victims {
		if x.State.FitsWithout(node, uids, req) {
			out.NodeNameToMetaVictims[node] = meta[node]
		}
	}
	return out
}

// FitsWithout reports whether req fits the node once the given pods' GPUs, CPU and memory are freed.
func (s *State) FitsWithout(node string, victims []types.UID, req *placement.Request) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
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
