package extender

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

func memoNode(name string, id, gpus int, cpu string) *corev1.Node {
	n := testNode(testInventory(name, id, gpus, "A100"), nil)
	n.Status.Allocatable = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse(cpu), corev1.ResourceMemory: resource.MustParse("256Gi")}
	return n
}

func withCPU(p *corev1.Pod, cpu string) *corev1.Pod {
	p.Spec.Containers[0].Resources.Requests = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse(cpu)}
	return p
}

// threeNodes adds nodes a, b and c (4 GPUs, 32 CPUs each) and returns their names.
func threeNodes(x *Extender) []string {
	names := []string{"a", "b", "c"}
	for i, n := range names {
		x.State.UpsertNode(memoNode(n, i, 4, "32"))
	}
	return names
}

// learnShapes records pending pods from..to-1 of one share shape: the typical shapes placement
// learns. With 300 known, one more pod does not rebuild the snapshot (placement.ShapeStats
// refreshes after 2% of changes). Their Filter calls never come, so the warmer is not told of
// their arrival (a table for their shape would be filled for nothing and count in the tests' sums).
func learnShapes(x *Extender, from, to int) {
	for i := from; i < to; i++ {
		x.State.UpsertPod(withCPU(sharePod(fmt.Sprintf("pending-%d", i), 1, 2, 20), "1"), x.Class)
	}
	x.State.changes.takeArrivals()
}

// churn is the random cluster of the memo and warmer agreement tests: 24 nodes of 4 GPUs, four
// request shapes, and random binds, deletions, GPU health changes and nodes removed and added again
// (so slots are reused).
type churn struct {
	x      *Extender
	rng    *rand.Rand
	names  []string
	shapes []func(string) *corev1.Pod
	placed []types.UID
}

func newChurn(x *Extender, rng *rand.Rand) *churn {
	c := &churn{x: x, rng: rng, shapes: []func(string) *corev1.Pod{
		func(n string) *corev1.Pod { return withCPU(wholePod(n, 1), "4") },
		func(n string) *corev1.Pod { return withCPU(wholePod(n, 2), "8") },
		func(n string) *corev1.Pod { return withCPU(sharePod(n, 1, 4, 30), "2") },
		func(n string) *corev1.Pod { return withCPU(sharePod(n, 2, 2, 20), "2") },
	}}
	for i := range 24 {
		c.names = append(c.names, fmt.Sprintf("n%02d", i))
		x.State.UpsertNode(memoNode(c.names[i], i, 4, "24"))
	}
	return c
}

// change makes one random change (or none) at step.
func (c *churn) change(step int) {
	x, rng, names := c.x, c.rng, c.names
	switch k := rng.IntN(10); {
	case k < 5:
		pod := c.shapes[rng.IntN(len(c.shapes))](fmt.Sprintf("b%d", step))
		if streamBind(x, pod, names[rng.IntN(len(names))]) == nil {
			c.placed = append(c.placed, pod.UID)
		}
	case k < 7 && len(c.placed) > 0:
		i := rng.IntN(len(c.placed))
		x.State.DeletePod(c.placed[i])
		c.placed = slices.Delete(c.placed, i, i+1)
	case k < 8:
		i := rng.IntN(len(names))
		inv := testInventory(names[i], i, 4, "A100")
		inv.GPUs[rng.IntN(4)].Healthy = rng.IntN(2) == 0
		node := memoNode(names[i], i, 4, "24")
		raw, _ := api.EncodeInventory(inv)
		node.Annotations[api.AnnotationInventory] = string(raw)
		x.State.UpsertNode(node)
	case k < 9:
		i := rng.IntN(len(names))
		x.State.DeleteNode(names[i])
		x.State.UpsertNode(memoNode(names[i], i, 4, "24"))
	}
}

// args is a filter/prioritize call over every node for a pod of a random shape.
func (c *churn) args(step int) *extenderv1.ExtenderArgs {
	return &extenderv1.ExtenderArgs{Pod: c.shapes[c.rng.IntN(len(c.shapes))](fmt.Sprintf("q%d", step)), NodeNames: &c.names}
}

// TestMemoEvaluatesOnlyChangedNodes: a second pod of one request shape is evaluated only on the
// nodes that changed since the first (here the node the first was bound to); a new shape snapshot
// evaluates every node again.
func TestMemoEvaluatesOnlyChangedNodes(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	names := threeNodes(x)
	// Pending pods the typical shapes are learned from; with 300 known, one more pod does not
	// rebuild the snapshot (placement.ShapeStats refreshes after 2% of changes).
	learnShapes(x, 0, 300)
	filter := func(pod *corev1.Pod) (remembered, evaluated int64, fit []string) {
		r0, e0 := x.Evaluations()
		fr := x.Filter(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names})
		r1, e1 := x.Evaluations()
		return r1 - r0, e1 - e0, *fr.NodeNames
	}
	if r, e, _ := filter(withCPU(wholePod("p1", 1), "4")); r != 0 || e != 3 {
		t.Fatalf("first pod: %d remembered, %d evaluated; want 0, 3", r, e)
	}
	if r, e, _ := filter(withCPU(wholePod("p2", 1), "4")); r != 3 || e != 0 {
		t.Fatalf("same shape, nothing changed: %d remembered, %d evaluated; want 3, 0", r, e)
	}
	// Bind a pod that leaves b without room for the shape: b alone is evaluated again, and refused.
	if err := streamBind(x, withCPU(wholePod("big", 4), "30"), "b"); err != nil {
		t.Fatal(err)
	}
	r, e, fit := filter(withCPU(wholePod("p3", 1), "4"))
	if r != 2 || e != 1 || slices.Contains(fit, "b") {
		t.Fatalf("after a bind on b: %d remembered, %d evaluated, fit %v; want 2, 1, without b", r, e, fit)
	}
	// Usage that comes back is the same usage: a pod held on c (Filter's reservation), released, and
	// then bound to c with the same devices leaves c's outcome remembered.
	held := withCPU(wholePod("held", 1), "4")
	held.UID = "held-uid"
	hreq, _ := RequestFromPod(held, x.Class)
	before, _, _ := filter(withCPU(wholePod("p3b", 1), "4"))
	var a *api.PodAssignment
	x.State.View([]string{"c"}, func(_ string, n *placement.NodeState, _ string) {
		p, _, _ := x.Engine.Evaluate(x.State.Shapes().ScoreContext(), n, hreq)
		a = BuildAssignment(n, hreq, &p)
	})
	x.State.reserve(held.UID, hreq.Key, held.Namespace, hreq, a)
	x.State.unreserve(held.UID)
	if r, e, _ := filter(withCPU(wholePod("p3d", 1), "4")); e != 0 || r != before {
		t.Fatalf("hold made and released: %d remembered, %d evaluated; want %d, 0 (c is as it was)", r, e, before)
	}
	x.State.reserve(held.UID, hreq.Key, held.Namespace, hreq, a)
	if _, e, _ := filter(withCPU(wholePod("p3e", 1), "4")); e != 1 {
		t.Fatalf("held again: %d evaluated, want 1", e)
	}
	if err := streamBind(x, held, "c"); err != nil { // the bind commits the held devices
		t.Fatal(err)
	}
	if _, e, _ := filter(withCPU(wholePod("p3f", 1), "4")); e != 0 {
		t.Fatalf("the hold committed as bound: %d evaluated, want 0 (c's usage did not change)", e)
	}
	// Another CPU request is another shape: evaluated afresh.
	if r, e, _ := filter(withCPU(wholePod("p4", 1), "5")); r != 0 || e != 3 {
		t.Fatalf("another shape: %d remembered, %d evaluated; want 0, 3", r, e)
	}
	// Enough new pods move the typical shapes: the snapshot is rebuilt and nothing is remembered.
	learnShapes(x, 300, 320)
	if r, e, _ := filter(withCPU(wholePod("p5", 1), "4")); r != 0 || e != 3 {
		t.Fatalf("after a new shape snapshot: %d remembered, %d evaluated; want 0, 3", r, e)
	}
}

// TestMemoAgreesWithFreshEvaluation replays random binds, deletions, node updates (a GPU turned
// unhealthy, a node removed and added again, so slots are reused) and filter/prioritize calls of a
// few request shapes (filter or prioritize first), and checks each answer against the same call with the memo cleared.
func TestMemoAgreesWithFreshEvaluation(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	c := newChurn(x, rand.New(rand.NewPCG(11, 12)))
	learnShapes(x, 0, 300)
	remembered := int64(0)
	for step := range 400 {
		c.change(step)
		args := c.args(step)
		r0, _ := x.Evaluations()
		var got *extenderv1.ExtenderFilterResult
		var gotP *extenderv1.HostPriorityList
		var err error
		if step%2 == 0 { // prioritize first: its outcomes carry no Unfit messages, filter's must
			gotP, err = x.Prioritize(args)
			got = x.Filter(args)
		} else {
			got = x.Filter(args)
			gotP, err = x.Prioritize(args)
		}
		if err != nil {
			t.Fatal(err)
		}
		r1, _ := x.Evaluations()
		remembered += r1 - r0
		x.eval.Reset()
		want := x.Filter(args)
		wantP, _ := x.Prioritize(args)
		if !slices.Equal(*got.NodeNames, *want.NodeNames) || !maps.Equal(got.FailedNodes, want.FailedNodes) ||
			!maps.Equal(got.FailedAndUnresolvableNodes, want.FailedAndUnresolvableNodes) {
			t.Fatalf("step %d: filter with the memo %v %v, fresh %v %v", step, *got.NodeNames, got.FailedNodes, *want.NodeNames, want.FailedNodes)
		}
		if !slices.Equal(*gotP, *wantP) {
			t.Fatalf("step %d: prioritize with the memo %v, fresh %v", step, *gotP, *wantP)
		}
	}
	if remembered == 0 {
		t.Fatal("the memo never answered: the comparison proved nothing")
	}
}
