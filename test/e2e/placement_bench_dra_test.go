package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/dra"
	"github.com/tessera-gpu/tessera/internal/placement"
	"github.com/tessera-gpu/tessera/internal/placement/simulate"
)

// The placement benchmark's DRA mode (issue 36, item 4): the trace's GPU pods ask for their GPUs as
// ResourceClaimTemplates of Tessera's DeviceClasses, the API-only nodes publish ResourceSlices as
// tessera-node does (dra.Resources over the node's inventory, devices in GPU index order), and the
// real kube-scheduler's DRA allocator gives out the devices. Policies, as tessera-sim names them
// (internal/placement/simulate/dra.go):
//   - dra-least: the scheduler alone with its default scoring (NodeResourcesFit LeastAllocated);
//   - dra-most: the scheduler alone, NodeResourcesFit MostAllocated over CPU and memory;
//   - dra-tessera: the extender (policy tessera, --dra-claims) chooses the node from the claims'
//     requests, the allocator the devices inside it.

// draBenchMode is how a DRA policy of the benchmark runs.
type draBenchMode struct {
	// extenderPolicy is the extender's --policy ("": no extender).
	extenderPolicy string
	// scoring is NodeResourcesFit's scoringStrategy type ("": the scheduler's default).
	scoring string
}

// draBenchPolicy reports whether policy is one of the benchmark's DRA policies, and how it runs;
// a dra- name it does not run is an error (the -fullest variants need slices reordered on every
// allocation, which the API-only nodes do not do).
func draBenchPolicy(policy string) (draBenchMode, bool, error) {
	switch policy {
	case "dra-least":
		return draBenchMode{}, true, nil
	case "dra-most":
		return draBenchMode{scoring: "MostAllocated"}, true, nil
	case "dra-tessera":
		return draBenchMode{extenderPolicy: "tessera"}, true, nil
	}
	if strings.HasPrefix(policy, "dra-") {
		return draBenchMode{}, false, fmt.Errorf("policy %q: the live benchmark runs dra-least, dra-most and dra-tessera (devices in index order)", policy)
	}
	return draBenchMode{}, false, nil
}

// draBenchGPUMemory is each GPU's memory on the DRA benchmark's nodes: large enough that a 1%
// share's memory (1% of it) is above the smallest share the driver offers (the CUDA context
// overhead, 512 MiB for an unknown compute capability), so the allocator never rounds a request up
// and memory never binds before compute, as in the device-plugin runs.
const draBenchGPUMemory = 80 << 30

// draShare is a trace share's claim capacity: compute in percent (the trace's gpu_milli / 10) and
// as much of the GPU's memory in percent (at least 1: a share that names no memory takes the GPU).
func draShare(p *simulate.Pod) (compute, memoryBytes int64) {
	compute = int64(p.GPUMilli / 10)
	return compute, draBenchGPUMemory / 100 * max(compute, 1)
}

// draTemplateName is the ResourceClaimTemplate a trace pod's GPUs come from ("": it asks for
// none): whole-<n> for n whole GPUs, share-<percent> for a share.
func draTemplateName(p *simulate.Pod) string {
	switch {
	case p.NumGPU == 0 || p.GPUMilli == 0:
		return ""
	case p.GPUMilli < placement.MilliPerGPU:
		c, _ := draShare(p)
		return fmt.Sprintf("share-%d", c)
	}
	return fmt.Sprintf("whole-%d", p.NumGPU)
}

// draTemplate is the template draTemplateName names for p: one request of the whole class with
// count num_gpu, or of the share class with the share's memory and compute.
func draTemplate(p *simulate.Pod) *resourceapi.ResourceClaimTemplate {
	req := resourceapi.ExactDeviceRequest{DeviceClassName: api.DRAClassWholeGPU, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: int64(p.NumGPU)}
	if p.GPUMilli < placement.MilliPerGPU {
		c, m := draShare(p)
		req = resourceapi.ExactDeviceRequest{DeviceClassName: api.DRAClassShareGPU, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
			Capacity: &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{
				dra.CapacityMemory:  *resource.NewQuantity(m, resource.BinarySI),
				dra.CapacityCompute: *resource.NewQuantity(c, resource.DecimalSI),
			}}}
	}
	return &resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: draTemplateName(p), Namespace: metav1.NamespaceDefault},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &req}}}}}}
}

// draBenchPod is benchPod with the GPUs as a claim from the pod's template instead of extended
// resources (CPU, memory and the model restriction as benchPod has them).
func draBenchPod(i int, p *simulate.Pod) *corev1.Pod {
	cpuOnly := *p
	cpuOnly.NumGPU, cpuOnly.GPUMilli = 0, 0
	pod := benchPod(i, &cpuOnly)
	if t := draTemplateName(p); t != "" {
		pod.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: &t}}
		pod.Spec.Containers[0].Resources.Claims = []corev1.ResourceClaim{{Name: "gpu"}}
	}
	return pod
}

// createDRATemplates creates the templates the arrivals' pods name.
func createDRATemplates(b *testing.B, client kubernetes.Interface, arrivals []simulate.Pod) {
	done := map[string]bool{}
	for i := range arrivals {
		name := draTemplateName(&arrivals[i])
		if name == "" || done[name] {
			continue
		}
		done[name] = true
		_, err := client.ResourceV1().ResourceClaimTemplates(metav1.NamespaceDefault).Create(context.Background(), draTemplate(&arrivals[i]), metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			b.Fatalf("create ResourceClaimTemplate %s: %v", name, err)
		}
	}
}

// createDRASlices publishes the node's GPUs as tessera-node's DRA driver does (one pool named after
// the node; none for a node without GPUs).
func createDRASlices(client kubernetes.Interface, inv *api.NodeInventory) error {
	if len(inv.GPUs) == 0 {
		return nil
	}
	pool := dra.Resources(inv, nil, resourceapi.DeviceTaintEffectNoSchedule, nil).Pools[inv.Node]
	node := inv.Node
	for i, s := range pool.Slices {
		rs := &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%s-%d", node, api.DRADriverName, i)},
			Spec: resourceapi.ResourceSliceSpec{Driver: api.DRADriverName, NodeName: &node,
				Pool:    resourceapi.ResourcePool{Name: node, Generation: 1, ResourceSliceCount: int64(len(pool.Slices))},
				Devices: s.Devices, SharedCounters: s.SharedCounters}}
		if _, err := client.ResourceV1().ResourceSlices().Create(context.Background(), rs, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("node %s ResourceSlice: %w", node, err)
		}
	}
	return nil
}

// applyBenchDeviceClasses applies the chart's DeviceClasses as helm renders them.
func applyBenchDeviceClasses(b *testing.B, cp *ControlPlane) {
	manifest, err := helm(b, "template", "tessera", helmChart(), "--show-only", "templates/deviceclasses.yaml")
	if err != nil {
		b.Fatalf("helm template the DeviceClasses: %v\n%s", err, manifest)
	}
	if out, err := runStdin(b, time.Minute, manifest, tool(b, "kubectl"), "--kubeconfig", cp.Kubeconfig, "apply", "-f", "-"); err != nil {
		b.Fatalf("apply the chart's DeviceClasses: %v\n%s", err, out)
	}
}
