package extender

import (
	"reflect"
	"time"

	corev1 "k8s.io/api/core/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// Filter's holds are bounded to pods that exist and wait for a node: a /filter call names its pod in
// the request body, and a hold takes capacity from every other pod for choiceTTL, so a hold for a
// pod the informer has not shown (made up, deleted, or not seen yet), for a bound or terminated pod,
// or for a request other than the one the informer parsed for the pod would let any caller of the
// endpoint keep a node's GPUs from the real pods. Such a call is still answered (the scheduler may
// run ahead of the informer for a real pod: its bind decides on the node's state alone), only
// nothing is held. One hold per pod UID (a new one replaces the old), so a namespace holds at most
// as many as it has pending pods.

// pendingPod is a pending pod as the informer showed it: its namespace/name and its request (nil
// when it has none that parses).
type pendingPod struct {
	key string
	req *placement.Request
}

// trackPendingLocked records whether pod is pending (not bound to a node and not terminated) and,
// if so, its request as UpsertPod parsed it.
func (s *State) trackPendingLocked(pod *corev1.Pod, req *placement.Request, err error) {
	if pod.UID == "" || pod.Spec.NodeName != "" || podTerminated(pod) {
		delete(s.pending, pod.UID)
		return
	}
	if err != nil {
		req = nil
	}
	s.pending[pod.UID] = pendingPod{key: pod.Namespace + "/" + pod.Name, req: req}
}

// unholdableLocked says why Filter's choice for pod (its request req) must not be held ("" when it
// may be).
func (s *State) unholdableLocked(pod *corev1.Pod, req *placement.Request) string {
	p, ok := s.pending[pod.UID]
	switch {
	case !ok:
		return "the informer shows no pending pod of this UID (unknown, bound or terminated)"
	case p.key != pod.Namespace+"/"+pod.Name:
		return "the informer's pod of this UID is " + p.key
	case p.req == nil || p.req != req && !reflect.DeepEqual(p.req, req):
		return "the request differs from the one the informer parsed for the pod"
	}
	return ""
}

// holdable is unholdableLocked under the read lock (Filter asks before evaluating the choice).
func (s *State) holdable(pod *corev1.Pod, req *placement.Request) string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.unholdableLocked(pod, req)
}

// holdChoice holds Filter's choice for pod until ttl passes: a (its GPUs, CPU and memory), or for a
// request without GPUs (a nil) its CPU and memory on node. It holds nothing, and says why, unless
// the pod is pending as the informer shows it.
func (s *State) holdChoice(pod *corev1.Pod, req *placement.Request, node string, a *api.PodAssignment, ttl time.Duration) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if why := s.unholdableLocked(pod, req); why != "" {
		return why
	}
	if a == nil {
		s.reserveUseLocked(pod.UID, node, req, ttl)
	} else {
		s.reserveForLocked(pod.UID, req.Key, pod.Namespace, req, a, ttl)
	}
	return ""
}
