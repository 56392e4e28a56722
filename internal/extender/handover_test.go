package extender

import (
	"context"
	"strings"

	api "github.com/tessera-gpu/tessera/api/v1"
	corev1 "k8s.io/api/core/v1"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"
)

// TestHoldBindCommitHandOver: Filter's hold, bind's reservation and the informer's bound pod hand the
// GPU over without a gap: after the bind lands, the node is full for the next pod.
func TestHoldBindCommitHandOver(t *testing.T) {
	node := withAllocatable(testNode(testInventory("n1", 1, 1, "T4"), nil), 32000, 64<<10)
	a, b := withRequests(wholePod("a", 1), 1000, 1024), withRequests(wholePod("b", 1), 1000, 1024)
	cs, _ := fakeAPI(t, []runtime.Object{node, a, b}...)
	x := newBinder(t, cs, "x", node)
	x.PickOne = true
	names := []string{"n1"}
	x.State.UpsertPod(a, x.Class)
	x.State.UpsertPod(b, x.Class)
	if res := x.Filter(&extenderv1.ExtenderArgs{Pod: a, NodeNames: &names}); len(*res.NodeNames) != 1 {
		t.Fatalf("a: %v", res.FailedNodes)
	}
	if err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: "a", PodNamespace: "default", PodUID: a.UID, Node: "n1"}); err != nil {
		t.Fatal(err)
	}
	got, _ := cs.CoreV1().Pods("default").Get(context.Background(), "a", metav1.GetOptions{})
	unbound := got.DeepCopy()
	unbound.Spec.NodeName = ""
	for _, p := range []any{unbound, got, got} {
		x.State.UpsertPod(p.(*podT), x.Class)
		if res := x.Filter(&extenderv1.ExtenderArgs{Pod: b, NodeNames: &names}); res.NodeNames != nil && len(*res.NodeNames) != 0 {
			t.Fatalf("b fits a full node after a's update (bound=%v)", p.(*podT).Spec.NodeName != "")
		}
	}
}

type podT = corev1.Pod

// TestBindKeepsOtherHolds is the live divergence bench-placement found (204 nodes, 1,400 pods: a
// bound pod lost from the state, then bind retries on a node the state thought free). Filter holds
// a's choice; b's bind decided from the API server's list alone, which does not show a's hold, so it
// took a's GPU; the state then counted that GPU twice, and releasing a's hold freed the GPU that b
// holds. Bind must decide against this process's in-flight holds too (and keep b's own Filter choice).
func TestBindKeepsOtherHolds(t *testing.T) {
	node := withAllocatable(testNode(testInventory("n1", 1, 2, "T4"), nil), 32000, 64<<10)
	a, b, c := withRequests(wholePod("a", 1), 1000, 1024), withRequests(wholePod("b", 1), 1000, 1024), withRequests(wholePod("c", 1), 1000, 1024)
	cs, _ := fakeAPI(t, []runtime.Object{node, a, b, c}...)
	x := newBinder(t, cs, "x", node)
	x.PickOne = true
	names := []string{"n1"}
	for _, p := range []*podT{a, b, c} {
		x.State.UpsertPod(p, x.Class)
	}
	for _, p := range []*podT{a, b} {
		if res := x.Filter(&extenderv1.ExtenderArgs{Pod: p, NodeNames: &names}); len(*res.NodeNames) != 1 {
			t.Fatalf("%s: %v", p.Name, res.FailedNodes)
		}
	}
	// The scheduler binds b before a (binding cycles run concurrently), and the informer delivers b.
	gpus := map[string]string{}
	for _, p := range []*podT{b, a} {
		if err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: p.Name, PodNamespace: "default", PodUID: p.UID, Node: "n1"}); err != nil {
			t.Fatalf("bind %s: %v", p.Name, err)
		}
		got, _ := cs.CoreV1().Pods("default").Get(context.Background(), p.Name, metav1.GetOptions{})
		x.State.UpsertPod(got, x.Class)
		gpus[p.Name] = got.Annotations[api.AnnotationAssignment]
	}
	if gpus["a"] == gpus["b"] {
		t.Fatalf("a and b hold the same GPUs: %s", gpus["a"])
	}
	if res := x.Filter(&extenderv1.ExtenderArgs{Pod: c, NodeNames: &names}); res.NodeNames != nil && len(*res.NodeNames) != 0 {
		t.Fatalf("c fits a node whose two GPUs a and b hold: the state lost one of them")
	}
}

// TestBindCountsHoldsOfUnboundPods: a bind with no Filter hold of its own (a scheduler without
// --filter-pick-one, or a hold that expired) must still not take a GPU that Filter holds for another
// pod whose annotation is not written yet.
func TestBindCountsHoldsOfUnboundPods(t *testing.T) {
	node := withAllocatable(testNode(testInventory("n1", 1, 2, "T4"), nil), 32000, 64<<10)
	a, b := withRequests(wholePod("a", 1), 1000, 1024), withRequests(wholePod("b", 1), 1000, 1024)
	cs, _ := fakeAPI(t, []runtime.Object{node, a, b}...)
	x := newBinder(t, cs, "x", node)
	x.PickOne = true
	names := []string{"n1"}
	x.State.UpsertPod(a, x.Class)
	x.State.UpsertPod(b, x.Class)
	if res := x.Filter(&extenderv1.ExtenderArgs{Pod: a, NodeNames: &names}); len(*res.NodeNames) != 1 {
		t.Fatalf("a: %v", res.FailedNodes)
	}
	held := x.State.pods[a.UID].assignment.Containers[0].Devices[0].UUID
	if err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: "b", PodNamespace: "default", PodUID: b.UID, Node: "n1"}); err != nil {
		t.Fatal(err)
	}
	got, _ := cs.CoreV1().Pods("default").Get(context.Background(), "b", metav1.GetOptions{})
	if strings.Contains(got.Annotations[api.AnnotationAssignment], held) {
		t.Fatalf("b got %s, which Filter holds for a: %s", held, got.Annotations[api.AnnotationAssignment])
	}
}

// TestBindKeepsFiltersChoice: the bind places the pod on the GPUs Filter chose while they still fit
// (the choice made in arrival order, as the simulator makes it), even when the node changed since.
func TestBindKeepsFiltersChoice(t *testing.T) {
	node := withAllocatable(testNode(testInventory("n1", 1, 2, "T4"), nil), 32000, 64<<10)
	b := withRequests(sharePod("b", 1, 4, 30), 1000, 1024)
	cs, _ := fakeAPI(t, []runtime.Object{node, b}...)
	x := newBinder(t, cs, "x", node)
	x.PickOne = true
	names := []string{"n1"}
	x.State.UpsertPod(b, x.Class)
	if res := x.Filter(&extenderv1.ExtenderArgs{Pod: b, NodeNames: &names}); len(*res.NodeNames) != 1 {
		t.Fatalf("b: %v", res.FailedNodes)
	}
	held := x.State.pods[b.UID].assignment.Containers[0].Devices[0].UUID
	// Another share lands on the other GPU (the informer has not delivered it): packing b next to it
	// would be the fresh choice; Filter's choice still fits and stands.
	other := gpuUUID(1, 0)
	if other == held {
		other = gpuUUID(1, 1)
	}
	d := withRequests(sharePod("d", 1, 4, 30), 1000, 1024)
	d.Spec.NodeName = "n1"
	d.Labels[api.LabelAssignedNode] = "n1"
	enc, _ := api.EncodeAssignment(&api.PodAssignment{APIVersion: api.Version, Node: "n1", Containers: []api.ContainerAssignment{{Name: "main",
		Devices: []api.DeviceAssignment{{UUID: other, MemoryBytes: 4 << 30, CoresPercent: 30}}}}})
	d.Annotations[api.AnnotationAssignment] = string(enc)
	if _, err := cs.CoreV1().Pods("default").Create(context.Background(), d, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: "b", PodNamespace: "default", PodUID: b.UID, Node: "n1"}); err != nil {
		t.Fatal(err)
	}
	got, _ := cs.CoreV1().Pods("default").Get(context.Background(), "b", metav1.GetOptions{})
	if !strings.Contains(got.Annotations[api.AnnotationAssignment], held) {
		t.Fatalf("b's bind left Filter's choice %s: %s", held, got.Annotations[api.AnnotationAssignment])
	}
}
