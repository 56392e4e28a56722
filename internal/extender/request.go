package extender

import (
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// ContainerShape is the GPU need of one container in placement units.
type ContainerShape struct {
	Name string
	// Whole is the number of exclusive GPUs.
	Whole int
	// Shares is the number of shares, each on a different GPU.
	Shares int
	// Memory is each share's memory cap in bytes; MemoryPercent the same in percent of its GPU.
	Memory        int64
	MemoryPercent int
	// Milli is each share's reserved compute, per-mille (0 = nothing reserved).
	Milli int
	MIG   map[string]int
	Mdev  map[string]int
}

// shareMemoryOn is the memory one share takes on a GPU of gpuMemory bytes.
func (c *ContainerShape) shareMemoryOn(gpuMemory int64) int64 {
	if c.MemoryPercent > 0 {
		return gpuMemory * int64(c.MemoryPercent) / 100
	}
	return c.Memory
}

// Request is a pod's placement request.
type Request struct {
	// Key is namespace/name (empty in the simulator).
	Key        string
	Containers []ContainerShape
	// CPUMilli and MemMiB are hard constraints where the node tracks them (the simulator).
	CPUMilli, MemMiB int64
	// Models restricts the pod to GPUs of these models (nil: any).
	Models []string
	// Class is the workload class (api.WorkloadExperiment/Training/Inference or "").
	Class string
	// Policy overrides the engine's default policy ("" = default).
	Policy string
}

// GPUMilli is the GPU compute the request takes, per-mille: 1000 per whole GPU plus each share's compute.
func (r *Request) GPUMilli() int {
	s := 0
	for _, c := range r.Containers {
		s += c.Whole*MilliPerGPU + c.Shares*c.Milli
	}
	return s
}

// WantsGPU reports whether the request places any whole GPU or share.
func (r *Request) WantsGPU() bool {
	for _, c := range r.Containers {
		if c.Whole > 0 || c.Shares > 0 {
			return true
		}
	}
	return false
}

// modelAllowed reports whether a GPU model satisfies the request's model constraint.
func (r *Request) modelAllowed(model string) bool {
	return len(r.Models) == 0 || slices.Contains(r.Models, model)
}

// ClassOptions maps priority class names to workload classes for pods without the workload label.
type ClassOptions struct {
	Experiment, Inference, Training []string
	AllowPolicyOverride             bool
}

// RequestFromPod parses a pod into a Request; it fails for invalid GPU requests (api.ParsePodRequest)
// and unknown policy overrides, with a message meant for the pod's events.
func RequestFromPod(pod *corev1.Pod, opts ClassOptions) (*Request, error) {
	pr, err := api.ParsePodRequest(pod)
	if err != nil {
		return nil, err
	}
	r := &Request{Key: pod.Namespace + "/" + pod.Name}
	for _, c := range pr.Containers {
		cs := ContainerShape{Name: c.Name, Whole: c.WholeGPUs, Shares: c.Shares, Memory: c.ShareMemoryBytes,
			MemoryPercent: c.ShareMemoryPercent, Milli: c.ShareCores * 10, MIG: c.MIG, Mdev: c.Mdev}
		r.Containers = append(r.Containers, cs)
	}
	if v := strings.TrimSpace(pod.Annotations[api.AnnotationGPUModel]); v != "" {
		for m := range strings.SplitSeq(v, "|") {
			if m = strings.TrimSpace(m); m != "" {
				r.Models = append(r.Models, m)
			}
		}
	}
	if p := pod.Annotations[api.AnnotationPolicy]; p != "" && opts.AllowPolicyOverride {
		if !api.IsKnownPolicy(p) {
			return nil, fmt.Errorf("pod %s: annotation %s=%q names no policy (known: %v)", r.Key, api.AnnotationPolicy, p, api.KnownPolicies)
		}
		r.Policy = p
	}
	r.Class = workloadClass(pod, opts)
	return r, nil
}

// workloadClass is the pod's label when set, else the class its priority class name maps to.
func workloadClass(pod *corev1.Pod, opts ClassOptions) string {
	switch v := pod.Labels[api.LabelWorkload]; v {
	case api.WorkloadExperiment, api.WorkloadInference, api.WorkloadTraining:
		return v
	}
	pc := pod.Spec.PriorityClassName
	switch {
	case pc == "":
		return ""
	case slices.Contains(opts.Experiment, pc):
		return api.WorkloadExperiment
	case slices.Contains(opts.Inference, pc):
		return api.WorkloadInference
	case slices.Contains(opts.Training, pc):
		return api.WorkloadTraining
	}
	return ""
}
