package main

import (
	"context"
	"maps"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// The agent labels its Node with every model present (not GPU 0's alone) and GFD's set under
// Tessera's keys; it removes labels of models gone, also ones an earlier agent left, and never
// touches GPU Feature Discovery's or anyone else's labels.
func TestPublisherGPULabels(t *testing.T) {
	gpu := func(i int, model string, mem int64, cc string) api.GPU {
		return api.GPU{UUID: "GPU-00000000-0000-4000-8000-00000000000" + string(rune('0'+i)), Index: i, Model: model, MemoryBytes: mem << 30,
			SMCount: 108, ComputeCapability: cc, NUMANode: -1, PCIBusID: "0000:0" + string(rune('0'+i)) + ":00.0", Minor: i, Healthy: true}
	}
	a100, h100 := "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"
	inv := &api.NodeInventory{APIVersion: api.Version, Node: "n", DriverVersion: "550.54.15", CUDAVersion: "12.4", SharesPerGPU: 4,
		GPUs: []api.GPU{gpu(0, h100, 80, "9.0"), gpu(1, a100, 80, "8.0"), gpu(2, a100, 40, "8.0")}}
	others := map[string]string{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "kubernetes.io/hostname": "n", api.LabelPool: "p"}
	old := maps.Clone(others)
	old[api.LabelPrefixModelCount+"Tesla-T4"] = "1" // left by an agent before a GPU swap
	old[api.LabelGPUModel] = "Tesla-T4"
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n", Labels: old}})
	capable := map[string]bool{inv.GPUs[0].UUID: true}
	publish := publisher(context.Background(), client, "n", func(uuid string) bool { return capable[uuid] }, testLog(t))

	check := func(what string, want map[string]string) {
		t.Helper()
		node, err := client.CoreV1().Nodes().Get(context.Background(), "n", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		want = maps.Clone(want)
		maps.Copy(want, others)
		if !maps.Equal(node.Labels, want) {
			t.Errorf("%s: labels\n%v\nwant\n%v", what, node.Labels, want)
		}
	}
	publish(inv)
	check("mixed node", map[string]string{
		api.LabelGPUModel: "mixed",
		api.LabelPrefixModelCount + "NVIDIA-H100-80GB-HBM3": "1",
		api.LabelPrefixModelCount + "NVIDIA-A100-SXM4-80GB": "2",
		api.LabelGPUCount:        "3",
		api.LabelGPUMemory:       "40960",
		api.LabelGPUComputeMajor: "8", api.LabelGPUComputeMinor: "0",
		api.LabelMIGCapable:    "true",
		api.LabelDriverVersion: "550.54.15",
		api.LabelCUDAVersion:   "12.4",
	})
	inv.GPUs = inv.GPUs[1:2]
	publish(inv)
	check("the H100 gone", map[string]string{
		api.LabelGPUModel: "NVIDIA-A100-SXM4-80GB",
		api.LabelPrefixModelCount + "NVIDIA-A100-SXM4-80GB": "1",
		api.LabelGPUCount:        "1",
		api.LabelGPUMemory:       "81920",
		api.LabelGPUComputeMajor: "8", api.LabelGPUComputeMinor: "0",
		api.LabelMIGCapable:    "false",
		api.LabelDriverVersion: "550.54.15",
		api.LabelCUDAVersion:   "12.4",
	})
	inv.GPUs = []api.GPU{}
	publish(inv)
	check("no GPUs", map[string]string{})
}
