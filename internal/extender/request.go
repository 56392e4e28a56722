package extender

import (
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// ClassOptions maps priority class names to workload classes for pods without the workload label.
type ClassOptions struct {
	Experiment, Inference, Training []string
	AllowPolicyOverride             bool
}

// RequestFromPod parses a pod into a placement.Request; it fails for invalid GPU requests (api.ParsePodRequest)
// and unknown policy overrides, with a message meant for the pod's events.
func RequestFromPod(pod *corev1.Pod, opts ClassOptions) (*placement.Request, error) {
	pr, err := api.ParsePodRequest(pod)
	if err != nil {
		return nil, err
	}
	r := &placement.Request{Key: pod.Namespace + "/" + pod.Name}
	for _, c := range pr.Containers {
		cs := placement.ContainerShape{Name: c.Name, Whole: c.WholeGPUs, Shares: c.Shares, Memory: c.ShareMemoryBytes,
			MemoryPercent: c.ShareMemoryPercent, Milli: c.ShareCores * 10, MIG: c.MIG, Mdev: c.Mdev}
		r.Containers = append(r.Containers, cs)
	}
	r.Models = modelList(pod.Annotations[api.AnnotationGPUModel])
	r.ExcludeModels = modelList(pod.Annotations[api.AnnotationGPUModelExclude])
	for _, m := range r.Models {
		if slices.ContainsFunc(r.ExcludeModels, func(x string) bool { return api.SameGPUModel(x, m) }) {
			return nil, fmt.Errorf("pod %s: GPU model %q is in both %s and %s; name it in one", r.Key, m, api.AnnotationGPUModel, api.AnnotationGPUModelExclude)
		}
	}
	if p := pod.Annotations[api.AnnotationPolicy]; p != "" && opts.AllowPolicyOverride {
		if !api.IsKnownPolicy(p) {
			return nil, fmt.Errorf("pod %s: annotation %s=%q names no policy (known: %v)", r.Key, api.AnnotationPolicy, p, api.KnownPolicies)
		}
		r.Policy = p
	}
	r.Class = workloadClass(pod, opts)
	r.CPUMilli, r.MemMiB = podCPUMem(pod)
	return r, nil
}

// modelList splits a model annotation's value: models separated by "|", blanks dropped.
func modelList(v string) []string {
	var models []string
	for m := range strings.SplitSeq(v, "|") {
		if m = strings.TrimSpace(m); m != "" {
			models = append(models, m)
		}
	}
	return models
}

// podCPUMem is the pod's effective CPU (milli) and memory (MiB) request as the kube-scheduler counts
// it: the containers' sum or the largest init container, whichever is more, plus the pod overhead.
func podCPUMem(pod *corev1.Pod) (int64, int64) {
	var cpu, mem int64
	for i := range pod.Spec.Containers {
		r := pod.Spec.Containers[i].Resources.Requests
		cpu += r.Cpu().MilliValue()
		mem += r.Memory().Value()
	}
	for i := range pod.Spec.InitContainers {
		r := pod.Spec.InitContainers[i].Resources.Requests
		cpu = max(cpu, r.Cpu().MilliValue())
		mem = max(mem, r.Memory().Value())
	}
	cpu += pod.Spec.Overhead.Cpu().MilliValue()
	mem += pod.Spec.Overhead.Memory().Value()
	return cpu, (mem + 1<<20 - 1) >> 20
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
