package extender

import (
	"fmt"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

func withAllocatable(n *corev1.Node, cpu, memMiB int64) *corev1.Node {
	n.Status.Allocatable = corev1.ResourceList{
		corev1.ResourceCPU:    *resource.NewMilliQuantity(cpu, resource.DecimalSI),
		corev1.ResourceMemory: *resource.NewQuantity(memMiB<<20, resource.BinarySI),
	}
	return n
}

func withRequests(p *corev1.Pod, cpu, memMiB int64) *corev1.Pod {
	p.Spec.Containers[0].Resources.Requests = corev1.ResourceList{
		corev1.ResourceCPU:    *resource.NewMilliQuantity(cpu, resource.DecimalSI),
		corev1.ResourceMemory: *resource.NewQuantity(memMiB<<20, resource.BinarySI),
	}
	return p
}

// TestFilterPicksThePolicysNode: the extender reads CPU and memory (requests, allocatable, and the
// use of every pod bound to a node), Filter keeps only the policy's choice (ties to the smallest
// name) and holds it, so the next pod's Filter sees it as the simulator would.
func TestFilterPicksThePolicysNode(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	x.PickOne = true
	names := []string{"n3", "n2", "n1"}
	for i, n := range names {
		x.State.UpsertNode(withAllocatable(testNode(testInventory(n, i+1, 2, "T4"), nil), 32000, 128<<10))
	}
	// A CPU-only pod bound to n1 takes 30 of its 32 CPUs: a GPU there is stranded.
	cpuHog := withRequests(testPod("hog", corev1.ResourceList{}), 30000, 1024)
	cpuHog.Spec.NodeName = "n1"
	x.State.UpsertPod(cpuHog, x.Class)
	req, err := RequestFromPod(withRequests(wholePod("probe", 1), 8000, 4096), x.Class)
	if err != nil || req.CPUMilli != 8000 || req.MemMiB != 4096 {
		t.Fatalf("request CPU/memory not read: %+v %v", req, err)
	}
	x.State.View([]string{"n1"}, func(_ string, n *placement.NodeState, _ string) {
		if n.CPUMilli != 32000 || n.UsedCPU != 30000 || n.MemMiB != 128<<10 || n.UsedMem != 1024 {
			t.Fatalf("node CPU/memory: %d/%d %d/%d", n.UsedCPU, n.CPUMilli, n.UsedMem, n.MemMiB)
		}
	})
	var got []string
	for i := range 4 {
		pod := withRequests(wholePod(fmt.Sprintf("w%d", i), 1), 8000, 4096)
		x.State.UpsertPod(pod, x.Class) // the informer shows it pending: Filter holds its choice
		res := x.Filter(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names})
		if res.NodeNames == nil || len(*res.NodeNames) != 1 {
			t.Fatalf("pod %d: filter kept %v (failed %v)", i, res.NodeNames, res.FailedNodes)
		}
		got = append(got, (*res.NodeNames)[0])
	}
	// n1 cannot feed a GPU pod (2 CPUs left); n2 and n3 tie: the smallest name first, and its second
	// GPU next (best fit), then n3. Without the holds, every pod would get n2.
	want := []string{"n2", "n2", "n3", "n3"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("choices %v, want %v", got, want)
	}
}
