package extender

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// twoShapeFilter adds nodes a, b and c and 300 learned pods to x and returns a filter call over them
// for a pod of shape 0 (one whole GPU, 4 CPUs) or 1 (a 4 GiB 30% share, 2 CPUs): how many node
// outcomes it evaluated and the nodes it kept. It fails t when the answer is not a fresh
// evaluation's (an extender without a memo on the same state).
func twoShapeFilter(t *testing.T, x *Extender) func(shape int) (evaluated int64, fit []string) {
	names := threeNodes(x)
	learnShapes(x, 0, 300)
	shapes := []func(string) *corev1.Pod{
		func(n string) *corev1.Pod { return withCPU(wholePod(n, 1), "4") },
		func(n string) *corev1.Pod { return withCPU(sharePod(n, 1, 4, 30), "2") },
	}
	step := 0
	return func(shape int) (int64, []string) {
		step++
		args := &extenderv1.ExtenderArgs{Pod: shapes[shape](fmt.Sprintf("p%d", step)), NodeNames: &names}
		_, e0 := x.Evaluations()
		got := x.Filter(args)
		_, e1 := x.Evaluations()
		want := (&Extender{Engine: x.Engine, State: x.State, Class: x.Class}).Filter(args)
		if !slices.Equal(*got.NodeNames, *want.NodeNames) || !maps.Equal(got.FailedNodes, want.FailedNodes) {
			t.Fatalf("shape %d: memo answers %v %v, a fresh evaluation %v %v", shape, *got.NodeNames, got.FailedNodes, *want.NodeNames, want.FailedNodes)
		}
		return e1 - e0, *got.NodeNames
	}
}

// TestWarmerKeepsShapesWarm: after the warmer's pass the next pod of each shape the memo holds
// evaluates nothing - not the node a bind changed, and not every node after a new shape snapshot -
// and gets the answer a fresh evaluation gives.
func TestWarmerKeepsShapesWarm(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	x.State.changes.start()
	filter := twoShapeFilter(t, x)
	for s := range 2 {
		if e, _ := filter(s); e != 3 {
			t.Fatalf("shape %d first seen: %d evaluated, want 3", s, e)
		}
	}
	// A bind leaves b without room for shape 0: the warmer re-evaluates b for both shapes.
	if err := streamBind(x, withCPU(wholePod("big", 4), "30"), "b"); err != nil {
		t.Fatal(err)
	}
	x.warmOnce(context.Background())
	for s := range 2 {
		e, fit := filter(s)
		if e != 0 {
			t.Fatalf("shape %d after a bind and a warmer pass: %d evaluated in filter, want 0", s, e)
		}
		if s == 0 && slices.Contains(fit, "b") {
			t.Fatalf("shape 0 fits %v, b is full", fit)
		}
	}
	// Enough new pods move the typical shapes: the warmer fills the new snapshot's tables for the
	// most recently used shapes it keeps (here one: shape 1, filtered last); the other waits for its pod.
	x.WarmShapes, x.KeptShapes = 1, 1
	learnShapes(x, 300, 320)
	refillsShapes(t, x, filter, "a new snapshot", 1)
}

// refillsShapes runs a warmer pass over twoShapeFilter's cluster after a new shape snapshot
// (shape 1 filtered last) and checks that it evaluated the kept most recently used shapes (1 or 2)
// on the three nodes, so that their next pods evaluate nothing, and shape 0's every node where it
// was not kept.
func refillsShapes(t *testing.T, x *Extender, filter func(shape int) (int64, []string), after string, kept int) {
	t.Helper()
	w0 := x.Warmed()
	x.warmOnce(context.Background())
	if w := x.Warmed() - w0; w != int64(3*kept) {
		t.Fatalf("%s: the warmer evaluated %d node outcomes, want %d (3 nodes x %d shapes)", after, w, 3*kept, kept)
	}
	if e, _ := filter(1); e != 0 {
		t.Fatalf("shape 1 after %s and a warmer pass: %d evaluated in filter, want 0", after, e)
	}
	want := int64(3)
	if kept == 2 {
		want = 0
	}
	if e, _ := filter(0); e != want {
		t.Fatalf("shape 0 after %s (%d shapes kept): %d evaluated in filter, want %d", after, kept, e, want)
	}
}

// TestWarmerStagesSnapshots: with the warmer running, a rebuilt shape snapshot is staged - filter
// keeps answering from the serving snapshot's tables - until the warmer has filled the staged
// snapshot's tables for the shapes used most (WarmShapes) and promoted it, then the tables of the
// other shapes it keeps (KeptShapes); the next pod of either shape then evaluates nothing, and
// every answer is a fresh evaluation's. (Before, a shape past the staged ones lost its table at
// every snapshot: live, ~290 of 1,500 calls bounded every node.)
func TestWarmerStagesSnapshots(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	x.State.changes.start()
	x.State.Shapes().StageSnapshots(true) // as RunWarmer does
	x.WarmShapes, x.KeptShapes = 1, 2
	filter := twoShapeFilter(t, x)
	filter(0)
	filter(1)
	serving := x.State.Shapes().ScoreContext().Snapshot
	learnShapes(x, 300, 320) // the counts drift: a snapshot is staged
	if staged := x.State.Shapes().StagedScoreContext(); staged == nil || staged.Snapshot <= serving {
		t.Fatalf("no snapshot staged after the counts drifted (serving %d, staged %+v)", serving, staged)
	}
	if e, _ := filter(1); e != 0 {
		t.Fatalf("shape 1 while a snapshot is staged: %d evaluated, want 0 (the serving snapshot's table)", e)
	}
	refillsShapes(t, x, filter, "a staged snapshot", 2)
	if got := x.State.Shapes().ScoreContext().Snapshot; got <= serving || x.State.Shapes().StagedScoreContext() != nil {
		t.Fatalf("after the warmer's pass snapshot %d serves (was %d); want the staged one promoted", got, serving)
	}
}

// TestChangeLogCoversEveryChange: every node whose placement state changes - binds with and without
// CPU requests, deletions, filter's holds, node updates and re-creations, the agent's holdings - is
// in the warmer's change log afterwards (a node left out would keep its outcomes unwarmed until its next pod).
func TestChangeLogCoversEveryChange(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	x.PickOne = true
	x.State.changes.start()
	c := newChurn(x, rand.New(rand.NewPCG(31, 32)))
	c.shapes = append(c.shapes, func(n string) *corev1.Pod { return wholePod(n, 1) }) // no CPU: GPUs only
	learnShapes(x, 0, 100)
	type seen struct {
		state  any
		digest uint64
	}
	look := func() map[string]seen {
		out := map[string]seen{}
		for name, e := range x.State.nodes {
			out[name] = seen{e.state, e.state.UsageDigest()}
		}
		return out
	}
	before := look()
	x.State.changes.take()
	changes := 0
	for step := range 400 {
		switch step % 7 {
		case 0, 3:
			args := c.args(step)
			x.State.markPending(args.Pod, x.Class)
			x.Filter(args) // pick-one: holds the chosen node
		case 5: // the node agent's holdings for a pod placed locally come and go (a status-only update)
			i := c.rng.IntN(len(c.names))
			node := memoNode(c.names[i], i, 4, "24")
			if c.rng.IntN(2) == 0 {
				raw, err := api.EncodeHoldings(&api.NodeHoldings{Node: c.names[i], Pods: []api.PodHolding{{Namespace: "default", Pod: "local",
					UID: "uid-local", Local: true, Containers: []api.ContainerAssignment{{Name: "main", Devices: []api.DeviceAssignment{{UUID: gpuUUID(i, 3), MemoryBytes: 1 << 30, CoresPercent: 5}}}}}}})
				if err != nil {
					t.Fatal(err)
				}
				node.Annotations[api.AnnotationHoldings] = string(raw)
			}
			x.State.UpsertNode(node)
		default:
			c.change(step)
		}
		logged := map[string]bool{}
		for _, e := range x.State.changes.take() {
			logged[e.name] = true
		}
		after := look()
		for name, a := range after {
			if b, ok := before[name]; (!ok || b != a) && !logged[name] {
				t.Fatalf("step %d: node %s changed (digest %d -> %d) and is not in the change log", step, name, b.digest, a.digest)
			} else if !ok || b != a {
				changes++
			}
		}
		before = after
	}
	if changes < 100 {
		t.Fatalf("only %d node changes in 400 steps: the test proved little", changes)
	}
}

// TestWarmerAgreesWithFreshEvaluation runs the warmer beside random binds, deletions and node
// updates (slots reused) and filter calls, and checks every answer against an extender without a
// memo on the same state (run it with -race: the warmer reads node states the writers change).
func TestWarmerAgreesWithFreshEvaluation(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	x.State.changes.start() // before the first change, so that the warmer misses none
	go func() { defer close(done); x.RunWarmer(ctx) }()
	defer func() { cancel(); <-done }()
	c := newChurn(x, rand.New(rand.NewPCG(21, 22)))
	learnShapes(x, 0, 100) // few learned pods: binds rebuild the snapshot now and then
	for step := range 600 {
		c.change(step)
		args := c.args(step)
		got := x.Filter(args)
		want := (&Extender{Engine: x.Engine, State: x.State, Class: x.Class}).Filter(args)
		if !slices.Equal(*got.NodeNames, *want.NodeNames) || !maps.Equal(got.FailedNodes, want.FailedNodes) ||
			!maps.Equal(got.FailedAndUnresolvableNodes, want.FailedAndUnresolvableNodes) {
			t.Fatalf("step %d: filter with the warmed memo %v %v, fresh %v %v", step, *got.NodeNames, got.FailedNodes, *want.NodeNames, want.FailedNodes)
		}
	}
	if r, _ := x.Evaluations(); r == 0 || x.Warmed() == 0 {
		t.Fatalf("remembered %d, warmed %d: the comparison proved nothing", r, x.Warmed())
	}
}

// TestWarmerWaitsForCalls: while a filter or prioritize call is in flight the warmer evaluates
// nothing; it goes on once the call is done.
func TestWarmerWaitsForCalls(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	x.State.changes.start()
	names := threeNodes(x)
	learnShapes(x, 0, 300) // one bind does not rebuild the snapshot
	x.Filter(&extenderv1.ExtenderArgs{Pod: withCPU(wholePod("p", 1), "4"), NodeNames: &names})
	if err := streamBind(x, withCPU(wholePod("big", 4), "30"), "b"); err != nil {
		t.Fatal(err)
	}
	x.calls.Add(1) // a call in flight
	done := make(chan struct{})
	go func() { defer close(done); x.warmOnce(context.Background()) }()
	select {
	case <-done:
		t.Fatal("the warmer finished its pass while a call was in flight")
	case <-time.After(50 * time.Millisecond):
	}
	if w := x.Warmed(); w != 0 {
		t.Fatalf("the warmer evaluated %d outcomes while a call was in flight", w)
	}
	x.calls.Add(-1)
	<-done
	if w := x.Warmed(); w != 1 {
		t.Fatalf("after the call: %d outcomes warmed, want 1 (b)", w)
	}
}

// TestWarmerFillsArrivingShapes: when a pending pod of a shape the memo has no table for arrives
// (the informer counts it), the warmer's next pass fills a table for it, so the pod's Filter call -
// which comes after the scheduler's own filters - evaluates nothing, with a fresh evaluation's
// answer. Before, a shape's first call evaluated or bounded every node (~2 ms at 4,852 nodes).
func TestWarmerFillsArrivingShapes(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	x.State.changes.start()
	filter := twoShapeFilter(t, x)
	if e, _ := filter(1); e != 3 {
		t.Fatalf("shape 1 first seen: %d evaluated, want 3", e)
	}
	x.State.UpsertPod(withCPU(wholePod("arriving", 1), "4"), x.Class) // shape 0, pending
	w0 := x.Warmed()
	x.warmOnce(context.Background())
	if w := x.Warmed() - w0; w != 3 {
		t.Fatalf("the warmer evaluated %d node outcomes for the arriving shape, want 3", w)
	}
	if e, _ := filter(0); e != 0 {
		t.Fatalf("shape 0's first call after its pod arrived and a warmer pass: %d evaluated, want 0", e)
	}
	// A pod of a shape that has a table asks for nothing more.
	x.State.UpsertPod(withCPU(wholePod("arriving-2", 1), "4"), x.Class)
	w0 = x.Warmed()
	x.warmOnce(context.Background())
	if w := x.Warmed() - w0; w != 0 {
		t.Fatalf("the warmer evaluated %d node outcomes for a shape with a table, want 0", w)
	}
}
