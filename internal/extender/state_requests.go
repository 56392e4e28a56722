package extender

import (
	"slices"

	corev1 "k8s.io/api/core/v1"

	"github.com/tessera-gpu/tessera/internal/placement"
)

// The State's requests: each GPU pod's placement request, parsed once per pod version by the
// informer and read by every verb (filter, prioritize, preempt, bind and bind's decision over the
// node's other pods) instead of parsed again by each. A pod's request is a function of the pod
// object and the class options; the API server gives a changed object a new resourceVersion, so
// the same UID, resourceVersion and options read the same request (a request is never modified).

// parsedRequest is a pod's request as parsed from one version of it with opts.
type parsedRequest struct {
	version string
	opts    ClassOptions
	req     *placement.Request
}

// request returns pod's placement request: the State's when it parsed this version of the pod with
// the same options, else parsed now (a pod without a version, or one the informer has not shown yet).
func (s *State) request(pod *corev1.Pod, opts ClassOptions) (*placement.Request, error) {
	if pod.UID != "" && pod.ResourceVersion != "" {
		s.mu.RLock()
		r, ok := s.requests[pod.UID]
		s.mu.RUnlock()
		if ok && r.version == pod.ResourceVersion && r.opts.equal(opts) {
			return r.req, nil
		}
	}
	return s.parse(pod, opts)
}

// requestLocked is request for the informer (the write lock held): a version not parsed yet is
// parsed and, when it asks for GPUs, kept for the verbs.
func (s *State) requestLocked(pod *corev1.Pod, opts ClassOptions) (*placement.Request, error) {
	r, ok := s.requests[pod.UID]
	if ok && pod.ResourceVersion != "" && r.version == pod.ResourceVersion && r.opts.equal(opts) {
		return r.req, nil
	}
	req, err := s.parse(pod, opts)
	if err == nil && req.WantsGPU() && pod.UID != "" && pod.ResourceVersion != "" {
		s.requests[pod.UID] = parsedRequest{version: pod.ResourceVersion, opts: opts, req: req}
	} else if ok {
		delete(s.requests, pod.UID)
	}
	return req, err
}

// equal reports whether o and p map pods to the same requests.
func (o ClassOptions) equal(p ClassOptions) bool {
	return o.AllowPolicyOverride == p.AllowPolicyOverride && slices.Equal(o.Experiment, p.Experiment) &&
		slices.Equal(o.Inference, p.Inference) && slices.Equal(o.Training, p.Training)
}
