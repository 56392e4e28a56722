package v1

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

func podWith(limits ...map[string]string) *corev1.Pod {
	pod := &corev1.Pod{}
	pod.Namespace, pod.Name = "ns", "p"
	for i, l := range limits {
		c := corev1.Container{Name: string(rune('a' + i)), Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{}}}
		for k, v := range l {
			c.Resources.Limits[corev1.ResourceName(k)] = resource.MustParse(v)
		}
		pod.Spec.Containers = append(pod.Spec.Containers, c)
	}
	return pod
}

func TestParsePodRequest(t *testing.T) {
	req, err := ParsePodRequest(podWith(
		map[string]string{ResourceShare: "2", ResourceShareMemory: "10Gi", ResourceShareCores: "30"},
		map[string]string{"cpu": "1"},
		map[string]string{ResourceGPU: "1", MIGResource("1g.5gb"): "2", MdevResource("A100-4C"): "1"},
		map[string]string{ResourceShare: "1", ResourceShareMemoryPercent: "25"},
	))
	if err != nil {
		t.Fatal(err)
	}
	if len(req.Containers) != 3 {
		t.Fatalf("want 3 GPU containers (the cpu-only one left out), got %+v", req.Containers)
	}
	a, c, d := req.Containers[0], req.Containers[1], req.Containers[2]
	if a.Shares != 2 || a.ShareMemoryBytes != 10<<30 || a.ShareCores != 30 || a.ShareMemoryOn(40<<30) != 10<<30 {
		t.Errorf("share container parsed as %+v", a)
	}
	if c.WholeGPUs != 1 || c.MIG["1g.5gb"] != 2 || c.Mdev["A100-4C"] != 1 {
		t.Errorf("device container parsed as %+v", c)
	}
	if d.ShareMemoryOn(40<<30) != 10<<30 || d.ShareCores != 0 {
		t.Errorf("percent container parsed as %+v", d)
	}
	if empty, _ := ParsePodRequest(podWith(map[string]string{"cpu": "1"})); !empty.Empty() {
		t.Error("a pod without GPU requests is not Empty")
	}
}

func TestParsePodRequestRejects(t *testing.T) {
	cases := []struct {
		name   string
		limits map[string]string
		want   string
	}{
		{"fractional shares", map[string]string{ResourceShare: "500m", ResourceShareMemory: "1Gi"}, "tessera.dev/vgpu: 500m is not a whole number"},
		{"fractional memory", map[string]string{ResourceShare: "1", ResourceShareMemory: "1.5"}, "tessera.dev/vgpu-memory: 1500m is not a whole number"},
		{"cores over 100", map[string]string{ResourceShare: "1", ResourceShareMemory: "1Gi", ResourceShareCores: "150"}, "tessera.dev/vgpu-cores: must be between 1 and 100 percent of the GPU's SMs, got 150"},
		{"memory percent 0", map[string]string{ResourceShare: "1", ResourceShareMemoryPercent: "0"}, "tessera.dev/vgpu-memory-percent: must be between 1 and 100"},
		{"too many shares", map[string]string{ResourceShare: "65", ResourceShareMemory: "1Gi"}, "tessera.dev/vgpu: must be between 0 and 64 shares, got 65"},
		{"no memory", map[string]string{ResourceShare: "1"}, "each share needs a memory cap"},
		{"both memory forms", map[string]string{ResourceShare: "1", ResourceShareMemory: "1Gi", ResourceShareMemoryPercent: "10"}, "set either tessera.dev/vgpu-memory or tessera.dev/vgpu-memory-percent, not both"},
		{"params without shares", map[string]string{ResourceShareMemory: "1Gi"}, "are set but tessera.dev/vgpu is not"},
		{"whole and shares", map[string]string{ResourceGPU: "1", ResourceShare: "1", ResourceShareMemory: "1Gi"}, "either whole GPUs (nvidia.com/gpu) or shares"},
		{"bad mig profile", map[string]string{"nvidia.com/mig-huge": "1"}, `"huge" is not a MIG profile`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParsePodRequest(podWith(tc.limits))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want it to contain %q", err, tc.want)
			}
			if !strings.Contains(err.Error(), `container "a"`) {
				t.Errorf("error %v does not name the container", err)
			}
		})
	}
}

// TestSecurityOverflowingRequest: a share's memory near int64's limit (which, on a pod bound by
// nodeName, wrapped the agent's ledger sum negative so every later share fitted) is refused at
// parsing, with the field and the limit named; 1Pi itself is accepted.
func TestSecurityOverflowingRequest(t *testing.T) {
	for _, mem := range []string{"9223372030e9", "1125899906842625", "2e15"} {
		_, err := ParsePodRequest(podWith(map[string]string{ResourceShare: "1", ResourceShareMemory: mem}))
		want := `container "a": tessera.dev/vgpu-memory: must be at most 1125899906842624 bytes (1Pi) per share, got ` + mem
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("vgpu-memory %s: error %v, want it to contain %q", mem, err, want)
		}
	}
	req, err := ParsePodRequest(podWith(map[string]string{ResourceShare: "1", ResourceShareMemory: "1125899906842624"}))
	if err != nil || req.Containers[0].ShareMemoryBytes != MaxShareMemoryBytes {
		t.Errorf("1125899906842624 (1Pi): %+v, %v", req, err)
	}
}

func TestParsePodRequestRequestLimitMismatchAndInit(t *testing.T) {
	pod := podWith(map[string]string{ResourceShare: "1", ResourceShareMemory: "1Gi"})
	pod.Spec.Containers[0].Resources.Requests = corev1.ResourceList{ResourceShare: resource.MustParse("2")}
	if _, err := ParsePodRequest(pod); err == nil || !strings.Contains(err.Error(), "request 2 differs from limit 1") {
		t.Errorf("mismatch: %v", err)
	}
	pod = podWith()
	pod.Spec.InitContainers = []corev1.Container{{Name: "init", Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{ResourceShare: resource.MustParse("1")}}}}
	if _, err := ParsePodRequest(pod); err == nil || !strings.Contains(err.Error(), `init container "init": tessera.dev/vgpu is not supported`) {
		t.Errorf("init container: %v", err)
	}
	pod.Spec.InitContainers[0].Resources.Limits = corev1.ResourceList{ResourceGPU: resource.MustParse("1")}
	if _, err := ParsePodRequest(pod); err == nil || !strings.Contains(err.Error(), `init container "init": nvidia.com/gpu is not supported in init containers`) {
		t.Errorf("init container with a whole GPU: %v", err)
	}
	pod.Spec.InitContainers[0].Resources.Limits = corev1.ResourceList{corev1.ResourceName(MIGResource("1g.5gb")): resource.MustParse("1")}
	if _, err := ParsePodRequest(pod); err != nil {
		t.Errorf("init container with a MIG instance: %v", err)
	}
}

func TestCheckFits(t *testing.T) {
	inv := testInventory() // GPU 0: 40 GiB mdev parent, GPU 1 MIG
	if err := (&ContainerRequest{Name: "c", Shares: 1, ShareMemoryBytes: 1}).CheckFits(inv); err == nil || !strings.Contains(err.Error(), "has 0 usable") {
		t.Errorf("an mdev parent and a MIG GPU count as usable: %v", err)
	}
	inv.GPUs[0].Mdev = nil
	cases := []struct {
		req  ContainerRequest
		want string
	}{
		{ContainerRequest{Name: "c", Shares: 1, ShareMemoryBytes: 40 << 30}, ""},
		{ContainerRequest{Name: "c", Shares: 2, ShareMemoryBytes: 1}, "asks for 2 GPUs but node node-a has 1 usable whole or shared"},
		{ContainerRequest{Name: "c", Shares: 1, ShareMemoryBytes: 41 << 30}, "the largest GPU on node node-a has"},
		{ContainerRequest{Name: "c", WholeGPUs: 2}, "asks for 2 GPUs"},
	}
	for _, tc := range cases {
		err := tc.req.CheckFits(inv)
		if (tc.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("CheckFits(%+v) = %v, want %q", tc.req, err, tc.want)
		}
	}
}
