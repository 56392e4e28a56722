package e2e

import (
	"testing"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/dra"
	"github.com/tessera-gpu/tessera/internal/placement/simulate"
)

// Unit tests of the placement benchmark's DRA mode (no cluster; they need no tools).

func TestDRABenchPolicy(t *testing.T) {
	for _, tc := range []struct {
		policy, extender, scoring string
		dra, err                  bool
	}{
		{"dra-least", "", "", true, false},
		{"dra-most", "", "MostAllocated", true, false},
		{"dra-tessera", "tessera", "", true, false},
		{"dra-tessera-fullest", "", "", false, true},
		{"tessera", "", "", false, false},
		{policyKubeScheduler, "", "", false, false},
	} {
		m, isDRA, err := draBenchPolicy(tc.policy)
		if isDRA != tc.dra || (err != nil) != tc.err || m.extenderPolicy != tc.extender || m.scoring != tc.scoring {
			t.Errorf("%s: %+v dra=%v err=%v", tc.policy, m, isDRA, err)
		}
	}
}

// TestDRABenchPodsAskWhatTheTraceAsks: a trace pod's claim template asks for what the simulator
// places (num_gpu whole GPUs, or one share with gpu_milli/10 percent compute and as much memory),
// and its pod for no extended resource.
func TestDRABenchPodsAskWhatTheTraceAsks(t *testing.T) {
	whole := simulate.Pod{CPUMilli: 8000, MemMiB: 1024, NumGPU: 4, GPUMilli: 1000}
	share := simulate.Pod{CPUMilli: 4000, MemMiB: 1024, NumGPU: 1, GPUMilli: 250, Models: []string{"T4"}}
	tiny := simulate.Pod{NumGPU: 1, GPUMilli: 5}
	cpu := simulate.Pod{CPUMilli: 1000, MemMiB: 512}
	if n := draTemplateName(&cpu); n != "" {
		t.Fatalf("CPU pod names template %q", n)
	}
	w := draTemplate(&whole)
	if r := w.Spec.Spec.Devices.Requests[0].Exactly; w.Name != "whole-4" || r.DeviceClassName != api.DRAClassWholeGPU || r.Count != 4 || r.Capacity != nil {
		t.Fatalf("whole template %s: %+v", w.Name, r)
	}
	s := draTemplate(&share)
	r := s.Spec.Spec.Devices.Requests[0].Exactly
	mem, compute := r.Capacity.Requests[dra.CapacityMemory], r.Capacity.Requests[dra.CapacityCompute]
	if s.Name != "share-25" || r.DeviceClassName != api.DRAClassShareGPU || r.Count != 1 || compute.Value() != 25 || mem.Value() != draBenchGPUMemory/100*25 {
		t.Fatalf("share template %s: %+v", s.Name, r)
	}
	// The smallest share still names memory (one that names none takes the whole GPU), above the
	// least the driver offers (no rounding up by the allocator).
	if _, m := draShare(&tiny); m < 512<<20 {
		t.Fatalf("a share of %d per mille asks %d bytes, under the 512 MiB the driver's range starts at", tiny.GPUMilli, m)
	}
	pod := draBenchPod(7, &share)
	if len(pod.Spec.ResourceClaims) != 1 || *pod.Spec.ResourceClaims[0].ResourceClaimTemplateName != "share-25" || len(pod.Spec.Containers[0].Resources.Claims) != 1 {
		t.Fatalf("pod claims: %+v", pod.Spec.ResourceClaims)
	}
	for name := range pod.Spec.Containers[0].Resources.Limits {
		t.Errorf("pod asks for %s besides its claim", name)
	}
	if pod.Annotations[api.AnnotationGPUModel] != "T4" || pod.Spec.Affinity == nil {
		t.Errorf("model restriction lost: %v %v", pod.Annotations, pod.Spec.Affinity)
	}
}
