package extender

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// counted decides whether a pod's assignment annotation holds GPUs, for the informer state and for
// bind's fresh list alike (issue 11, finding 7: anyone who can write a pod can write the annotation and
// the assigned-node label). It holds only when the pod asks for GPUs, is not terminated, the
// assignment matches the request exactly, and either the pod is bound to the assignment's node or the
// assignment is this extender's own in-flight reservation (ours reports that). Anything else holds
// nothing: the returned assignment and request are nil. request is the pod's request (the State's,
// State.request), asked for only when the pod has an assignment to check.
func counted(pod *corev1.Pod, request func(*corev1.Pod) (*placement.Request, error), ours func(types.UID, *api.PodAssignment) bool) (*api.PodAssignment, *placement.Request) {
	raw, ok := pod.Annotations[api.AnnotationAssignment]
	if !ok || podTerminated(pod) {
		return nil, nil
	}
	a, err := api.DecodeAssignment([]byte(raw))
	if err != nil {
		return nil, nil
	}
	req, err := request(pod)
	if err != nil || !req.WantsGPU() || !matchesRequest(req, a) {
		return nil, nil
	}
	switch {
	case pod.Spec.NodeName != "" && pod.Spec.NodeName == a.Node:
		return a, req
	case pod.Spec.NodeName == "" && ours != nil && ours(pod.UID, a):
		return a, req
	}
	return nil, nil
}

// matchesRequest reports whether an assignment gives each container exactly what it asks for: its
// whole GPUs and its shares (each on its own GPU, with the requested compute and memory), nothing to
// containers that ask for none.
func matchesRequest(req *placement.Request, a *api.PodAssignment) bool {
	want := map[string]*placement.ContainerShape{}
	for i := range req.Containers {
		if c := &req.Containers[i]; c.Whole > 0 || c.Shares > 0 {
			want[c.Name] = c
		}
	}
	if len(a.Containers) != len(want) {
		return false
	}
	for _, ca := range a.Containers {
		c := want[ca.Name]
		if c == nil {
			return false
		}
		seen := map[string]bool{}
		whole, shares := 0, 0
		for _, d := range ca.Devices {
			if seen[d.UUID] {
				return false
			}
			seen[d.UUID] = true
			if d.Whole {
				whole++
				continue
			}
			shares++
			if d.CoresPercent != c.Milli/10 || (c.Memory > 0 && d.MemoryBytes != c.Memory) || (c.MemoryPercent > 0 && d.MemoryBytes <= 0) {
				return false
			}
		}
		if whole != c.Whole || shares != c.Shares {
			return false
		}
	}
	return true
}
