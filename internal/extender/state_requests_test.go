package extender

import (
	"context"
	"maps"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// TestRequestsAreParsedOncePerPodVersion: the informer parses each version of a GPU pod once, and
// filter, prioritize, preempt, bind and bind's decision (over the node's other pods) read that
// request; a version the informer has not shown, or other class options, is parsed afresh (and
// answered by what it asks, not by the version before).
func TestRequestsAreParsedOncePerPodVersion(t *testing.T) {
	n1, n2 := testNode(testInventory("n1", 1, 1, "T4"), nil), testNode(testInventory("n2", 2, 3, "T4"), nil)
	other := assigned(wholePod("other", 1), "n2", api.DeviceAssignment{UUID: gpuUUID(2, 0), Whole: true})
	pod := wholePod("p", 2)
	other.ResourceVersion, pod.ResourceVersion = "5", "1"
	cs, _ := fakeAPI(t, n1, n2, other.DeepCopy(), pod.DeepCopy())
	x := newBinder(t, cs, "a", n1)
	x.State.UpsertNode(n2)
	parses := map[string]int{}
	x.State.parse = func(p *corev1.Pod, o ClassOptions) (*placement.Request, error) {
		parses[p.Name+"@"+p.ResourceVersion]++
		return RequestFromPod(p, o)
	}
	x.State.UpsertPod(other, x.Class)
	x.State.UpsertPod(pod, x.Class)
	x.State.UpsertPod(pod, x.Class) // the same version again (a resync)
	names := []string{"n1", "n2"}
	args := &extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names}
	if res := x.Filter(args); len(*res.NodeNames) != 1 || (*res.NodeNames)[0] != "n2" {
		t.Fatalf("filter kept %v, want n2 (n1 has one GPU)", *res.NodeNames)
	}
	if _, err := x.Prioritize(args); err != nil {
		t.Fatal(err)
	}
	x.Preempt(&extenderv1.ExtenderPreemptionArgs{Pod: pod, NodeNameToMetaVictims: map[string]*extenderv1.MetaVictims{
		"n2": {Pods: []*extenderv1.MetaPod{{UID: string(other.UID)}}}}})
	// A version the informer has not shown yet asks for more than n2 has free: parsed, and refused.
	v2 := wholePod("p", 4)
	v2.ResourceVersion = "2"
	if res := x.Filter(&extenderv1.ExtenderArgs{Pod: v2, NodeNames: &names}); len(*res.NodeNames) != 0 {
		t.Fatalf("filter of version 2 (4 GPUs) kept %v", *res.NodeNames)
	}
	if cur, err := cs.CoreV1().Pods("default").Get(context.Background(), "p", metav1.GetOptions{}); err != nil || cur.ResourceVersion != "1" {
		t.Fatalf("the fake API server's pod: %v, %v (the test needs its version kept)", cur, err)
	}
	if err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: "p", PodNamespace: "default", PodUID: pod.UID, Node: "n2"}); err != nil {
		t.Fatal(err)
	}
	if want := map[string]int{"other@5": 1, "p@1": 1, "p@2": 1}; !maps.Equal(parses, want) {
		t.Fatalf("parses %v, want %v", parses, want)
	}
	// Other class options than the informer's: parsed again.
	x.Class = ClassOptions{Experiment: []string{"low"}}
	x.Filter(args)
	if want := map[string]int{"other@5": 1, "p@1": 2, "p@2": 1}; !maps.Equal(parses, want) {
		t.Fatalf("parses %v, want %v", parses, want)
	}
}
