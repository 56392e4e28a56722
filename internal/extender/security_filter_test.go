package extender

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestSecurityFilterHoldsOnlyKnownPods: pick-one Filter holds its choice only for a pod the
// informer shows pending (same UID, namespace/name and request; not bound, not terminated). Calls
// for made-up pods, for a real pod under another name or with a larger request, for a bound, a
// finished or a deleted pod are answered but hold nothing, so they cannot keep a node's GPUs from
// the real pod (issue 30: two such calls held both GPUs of a node for 15 s and the real pod failed
// with "0 are free ... 2 are held whole").
func TestSecurityFilterHoldsOnlyKnownPods(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	x.PickOne = true
	x.State.UpsertNode(testNode(testInventory("n1", 1, 2, "T4"), nil))
	names := []string{"n1"}
	filter := func(pod *corev1.Pod) []string {
		t.Helper()
		res := x.Filter(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names})
		if res.Error != "" || res.NodeNames == nil {
			t.Fatalf("%s: error %q, refused %v", pod.Name, res.Error, res.FailedNodes)
		}
		return *res.NodeNames
	}
	noHold := func(pod *corev1.Pod, what string) {
		t.Helper()
		if got := filter(pod); len(got) != 1 {
			t.Fatalf("%s: filter kept %v, want n1 (the call is answered)", what, got)
		}
		if x.State.Holds(pod.UID) {
			t.Fatalf("%s: Filter holds GPUs for it", what)
		}
	}

	real := wholePod("real", 1)
	x.State.UpsertPod(real, x.Class)
	// Made-up pods, one GPU each: before the fix two of them held both GPUs.
	for _, name := range []string{"fake-1", "fake-2"} {
		noHold(wholePod(name, 1), "made-up pod "+name)
	}
	// The real pod's UID under another name, and the real pod asking for more than it does.
	renamed := wholePod("renamed", 1)
	renamed.UID = real.UID
	noHold(renamed, "real UID under another name")
	bigger := wholePod("real", 2)
	noHold(bigger, "real pod with a forged larger request")

	// The real pending pod still fits and gets its hold.
	if got := filter(real); len(got) != 1 || got[0] != "n1" {
		t.Fatalf("real pending pod: kept %v, want n1", got)
	}
	if !x.State.Holds(real.UID) {
		t.Fatal("real pending pod: Filter's choice is not held")
	}

	// A bound pod (bound by another scheduler: no assignment of ours), a finished one and a
	// deleted one hold nothing.
	bound := wholePod("bound", 1)
	bound.Spec.NodeName = "n1"
	x.State.UpsertPod(bound, x.Class)
	noHold(bound, "bound pod")
	done := wholePod("done", 1)
	done.Status.Phase = corev1.PodSucceeded
	x.State.UpsertPod(done, x.Class)
	noHold(done, "succeeded pod")
	deleting := wholePod("deleting", 1)
	x.State.UpsertPod(deleting, x.Class)
	now := metav1.Now()
	deleting.DeletionTimestamp = &now
	x.State.UpsertPod(deleting, x.Class)
	noHold(deleting, "pod being deleted")
	gone := wholePod("gone", 1)
	x.State.UpsertPod(gone, x.Class)
	x.State.DeletePod(gone.UID)
	noHold(gone, "deleted pod")

	// A second real pod still finds the GPU the real pod's hold leaves.
	second := wholePod("second", 1)
	second.UID = types.UID("uid-second")
	x.State.UpsertPod(second, x.Class)
	if got := filter(second); len(got) != 1 {
		t.Fatalf("second real pod: kept %v, want n1 (one GPU is free beside the real pod's hold)", got)
	}
	if !x.State.Holds(second.UID) {
		t.Fatal("second real pod: Filter's choice is not held")
	}
}
