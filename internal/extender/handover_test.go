package extender

import (
	"context"
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
