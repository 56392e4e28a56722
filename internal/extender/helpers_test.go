package extender

import (
	"encoding/json"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	api "github.com/tessera-gpu/tessera/api/v1"
)

func gpuUUID(node, i int) string { return fmt.Sprintf("GPU-%08x-0000-4000-8000-%012x", node, i) }

// testInventory is an n-GPU node of one model with 16 GiB GPUs and NVLink pairs (0-1, 2-3, ...).
func testInventory(name string, id, n int, model string) *api.NodeInventory {
	inv := &api.NodeInventory{APIVersion: api.Version, Node: name, SharesPerGPU: 10}
	for i := 0; i < n; i++ {
		inv.GPUs = append(inv.GPUs, api.GPU{UUID: gpuUUID(id, i), Index: i, Model: model, MemoryBytes: 16 << 30, SMCount: 80,
			ComputeCapability: "7.0", NUMANode: 0, PCIBusID: fmt.Sprintf("0000:%02x:00.0", i+1), Minor: i, Healthy: true})
	}
	for i := 0; i+1 < n; i += 2 {
		inv.Links = append(inv.Links, api.Link{A: i, B: i + 1, Kind: api.LinkNVLink, NVLinks: 4})
	}
	return inv
}

func testNode(inv *api.NodeInventory, labels map[string]string) *corev1.Node {
	raw, err := api.EncodeInventory(inv)
	if err != nil {
		panic(err)
	}
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: inv.Node, Labels: labels, Annotations: map[string]string{api.AnnotationInventory: string(raw)}}}
}

// sharePod asks for shares x (memGiB, cores%); wholePod for n whole GPUs.
func sharePod(name string, shares, memGiB, cores int) *corev1.Pod {
	l := corev1.ResourceList{
		api.ResourceShare:       *resource.NewQuantity(int64(shares), resource.DecimalSI),
		api.ResourceShareMemory: *resource.NewQuantity(int64(memGiB)<<30, resource.BinarySI),
	}
	if cores > 0 {
		l[api.ResourceShareCores] = *resource.NewQuantity(int64(cores), resource.DecimalSI)
	}
	return testPod(name, l)
}

func wholePod(name string, n int) *corev1.Pod {
	return testPod(name, corev1.ResourceList{api.ResourceGPU: *resource.NewQuantity(int64(n), resource.DecimalSI)})
}

func testPod(name string, l corev1.ResourceList) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", UID: types.UID("uid-" + name), Annotations: map[string]string{}, Labels: map[string]string{}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "main", Resources: corev1.ResourceRequirements{Limits: l}}}},
	}
}

// assigned returns pod with an assignment annotation for the given devices on node.
func assigned(pod *corev1.Pod, node string, devs ...api.DeviceAssignment) *corev1.Pod {
	a := &api.PodAssignment{APIVersion: api.Version, Node: node, Containers: []api.ContainerAssignment{{Name: "main", Devices: devs}}}
	raw, err := json.Marshal(a)
	if err != nil {
		panic(err)
	}
	pod.Annotations[api.AnnotationAssignment] = string(raw)
	pod.Labels[api.LabelAssignedNode] = node
	pod.Spec.NodeName = node
	return pod
}

// uniformNodes adds n empty nodes of gpus A100s each, with cpu and mem allocatable, named by
// format from the node's index, and returns their names.
func uniformNodes(x *Extender, format string, n, gpus int, cpu, mem string) []string {
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf(format, i)
		node := testNode(testInventory(names[i], i, gpus, "A100"), nil)
		node.Status.Allocatable = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse(cpu), corev1.ResourceMemory: resource.MustParse(mem)}
		x.State.UpsertNode(node)
	}
	return names
}
