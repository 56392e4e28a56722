package extender

import (
	"context"
	"fmt"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestForgedAssignmentsHoldNothing: an assignment counts only on a pod bound to its node, or as the
// extender's own reservation, and only when it matches the pod's request; the informer state and
// bind's fresh list agree (issue 11, finding 7).
func TestForgedAssignmentsHoldNothing(t *testing.T) {
	whole := func(i int) api.DeviceAssignment { return api.DeviceAssignment{UUID: gpuUUID(1, i), Whole: true} }
	unbound := func(p *corev1.Pod) *corev1.Pod { p.Spec.NodeName = ""; return p }
	forged := []*corev1.Pod{
		unbound(assigned(wholePod("pending", 1), "n1", whole(0))), // not bound, not ours
		assigned(wholePod("more", 1), "n1", whole(0), whole(1)),   // bound, but more than it asks for
		assigned(sharePod("cores", 1, 4, 30), "n1", api.DeviceAssignment{UUID: gpuUUID(1, 0), MemoryBytes: 4 << 30, CoresPercent: 100}),
		assigned(testPod("nogpu", corev1.ResourceList{}), "n1", whole(0)), // asks for no GPU
		func() *corev1.Pod {
			p := assigned(wholePod("elsewhere", 1), "n1", whole(0))
			p.Spec.NodeName = "n2"
			return p
		}(),
	}
	node := testNode(testInventory("n1", 1, 2, "A100"), nil)
	objs := []runtime.Object{node, wholePod("victim", 2)}
	for _, p := range forged {
		objs = append(objs, p)
	}
	cs, _ := fakeAPI(t, objs...)
	x := newBinder(t, cs, "a", node)
	for _, p := range forged {
		x.State.UpsertPod(p, x.Class)
		if x.State.Holds(p.UID) {
			t.Errorf("state counts the forged assignment of %s", p.Name)
		}
	}
	names := []string{"n1"}
	if res := x.Filter(&extenderv1.ExtenderArgs{Pod: wholePod("victim", 2), NodeNames: &names}); res.NodeNames == nil || len(*res.NodeNames) != 1 {
		t.Fatalf("filter refuses the victim: %v", res.FailedNodes)
	}
	if err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: "victim", PodNamespace: "default", Node: "n1"}); err != nil {
		t.Fatalf("bind refuses the victim (its fresh list counted a forged assignment): %v", err)
	}
	// A matching assignment on a bound pod does count.
	honest := assigned(wholePod("honest", 1), "n1", whole(0))
	x2 := newTestExtender(t, api.PolicyTessera)
	x2.State.UpsertNode(node)
	x2.State.UpsertPod(honest, x2.Class)
	if !x2.State.Holds(honest.UID) {
		t.Fatal("a bound pod's matching assignment is not counted")
	}
}

// TestBindAmbiguousErrorRereads: a Binding whose answer is an error but that landed is a success, and
// the assignment stays.
func TestBindAmbiguousErrorRereads(t *testing.T) {
	node := testNode(testInventory("n1", 1, 1, "T4"), nil)
	pod := wholePod("w", 1)
	cs, _ := fakeAPI(t, node, pod)
	cs.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() != "binding" {
			return false, nil, nil
		}
		b := a.(k8stesting.CreateAction).GetObject().(*corev1.Binding)
		obj, _ := cs.Tracker().Get(corev1.SchemeGroupVersion.WithResource("pods"), b.Namespace, b.Name)
		p := obj.(*corev1.Pod).DeepCopy()
		p.Spec.NodeName = b.Target.Name
		_ = cs.Tracker().Update(corev1.SchemeGroupVersion.WithResource("pods"), p, p.Namespace)
		return true, nil, fmt.Errorf("connection reset after the write")
	})
	x := newBinder(t, cs, "a", node)
	if err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: "w", PodNamespace: "default", Node: "n1"}); err != nil {
		t.Fatalf("bind of a pod that was in fact bound: %v", err)
	}
	got, _ := cs.CoreV1().Pods("default").Get(context.Background(), "w", metav1.GetOptions{})
	if _, ok := got.Annotations[api.AnnotationAssignment]; !ok || got.Spec.NodeName != "n1" {
		t.Fatalf("bound pod lost its assignment: %v node %q", got.Annotations, got.Spec.NodeName)
	}
}
