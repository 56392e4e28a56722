package extender

import (
	corev1 "k8s.io/api/core/v1"
)

// markPending records pod as pending, as the informer's UpsertPod does, without counting its shape
// (for tests and benchmarks whose pods are not learned arrivals): Filter then holds its choice.
func (s *State) markPending(pod *corev1.Pod, opts ClassOptions) {
	req, err := RequestFromPod(pod, opts)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.trackPendingLocked(pod, req, err)
}
