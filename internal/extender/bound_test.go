package extender

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// boundCluster is the cluster of TestBoundedPickOneMatchesExhaustive: 160 nodes of 4 or 8 GPUs
// and 64 CPUs, each holding random whole GPUs and shares (with CPU), so that nearly every node is
// in its own state and the typical shapes are many (the assigned pods' shapes).
func boundCluster(t *testing.T) (*Extender, []string) {
	x := newTestExtender(t, api.PolicyTessera)
	x.PickOne = true
	rng := rand.New(rand.NewPCG(160, 8))
	names := make([]string, 160)
	for i := range names {
		names[i] = fmt.Sprintf("node-%03d", i)
		gpus := 4 + 4*rng.IntN(2)
		inv := testInventory(names[i], i, gpus, "A100")
		if i%3 == 0 { // two GPU generations: experiment and inference pods prefer the older on ties
			for g := range inv.GPUs {
				inv.GPUs[g].ComputeCapability = "8.0"
			}
		}
		node := testNode(inv, nil)
		node.Status.Allocatable = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("64"), corev1.ResourceMemory: resource.MustParse("512Gi")}
		x.State.UpsertNode(node)
		whole := rng.IntN(gpus - 1)
		var devs []api.DeviceAssignment
		for g := range whole {
			devs = append(devs, api.DeviceAssignment{UUID: gpuUUID(i, g), Whole: true})
		}
		if whole > 0 {
			x.State.UpsertPod(assigned(withCPU(wholePod(fmt.Sprintf("w%d", i), whole), fmt.Sprint(4*whole)), names[i], devs...), x.Class)
		}
		for g := whole; g < whole+rng.IntN(gpus-whole+1); g++ {
			used := 0
			for s := range 1 + rng.IntN(3) {
				cores, mem := 5+5*rng.IntN(9), 1+rng.IntN(4)
				if used+cores > 100 {
					continue
				}
				used += cores
				p := withCPU(sharePod(fmt.Sprintf("s%d-%d-%d", i, g, s), 1, mem, cores), fmt.Sprint(1+rng.IntN(4)))
				x.State.UpsertPod(assigned(p, names[i], api.DeviceAssignment{UUID: gpuUUID(i, g), MemoryBytes: int64(mem) << 30, CoresPercent: cores}), x.Class)
			}
		}
	}
	return x, names
}

// TestBoundedPickOneMatchesExhaustive: pick-one Filter, which bounds every node and evaluates only
// those whose bound reaches the best score, keeps the node that evaluating every node keeps (and
// refuses the same nodes for the same reasons, or, where it keeps one, some of them), pod after pod (twelve shapes, recurring), on two
// identical clusters that bind each choice and delete pods at random; and it does evaluate fewer
// nodes.
func TestBoundedPickOneMatchesExhaustive(t *testing.T) {
	x, names := boundCluster(t)
	y, _ := boundCluster(t)
	y.ExhaustivePickOne = true
	rng := rand.New(rand.NewPCG(3, 4))
	var placed []types.UID
	unlisted := 0 // refused nodes the bounded reply leaves out (never checked: below the choice)
	_, xe0 := x.Evaluations()
	// Twelve request shapes, so that shapes recur and their remembered bounds must follow each
	// node's changes.
	var palette []func(name string) *corev1.Pod
	for range 12 {
		cpu := fmt.Sprint(1 + rng.IntN(16))
		switch shares, mem, cores, whole := 1+rng.IntN(2), 1+rng.IntN(8), 5+rng.IntN(91), 1+rng.IntN(4); rng.IntN(3) {
		case 0:
			palette = append(palette, func(name string) *corev1.Pod { return withCPU(wholePod(name, whole), cpu) })
		default:
			palette = append(palette, func(name string) *corev1.Pod { return withCPU(sharePod(name, shares, mem, cores), cpu) })
		}
	}
	for step := range 150 {
		name := fmt.Sprintf("p%d", step)
		pod := palette[rng.IntN(len(palette))]
		px, py := pod(name), pod(name)
		px.UID, py.UID = types.UID(name), types.UID(name)
		if step%3 == 0 { // ties go to the older GPUs first, then to the smallest name
			px.Labels, py.Labels = map[string]string{api.LabelWorkload: api.WorkloadExperiment}, map[string]string{api.LabelWorkload: api.WorkloadExperiment}
		}
		x.State.markPending(px, x.Class) // Filter holds each choice, as for the informer's pods
		y.State.markPending(py, y.Class)
		got := x.Filter(&extenderv1.ExtenderArgs{Pod: px, NodeNames: &names})
		want := y.Filter(&extenderv1.ExtenderArgs{Pod: py, NodeNames: &names})
		if got.Error != want.Error || !slices.Equal(*got.NodeNames, *want.NodeNames) ||
			!refusalsAgree(got.FailedNodes, want.FailedNodes, len(*got.NodeNames) == 1) ||
			!refusalsAgree(got.FailedAndUnresolvableNodes, want.FailedAndUnresolvableNodes, len(*got.NodeNames) == 1) {
			t.Fatalf("step %d (%v): bounded pick-one kept %v (error %q, refused %v), exhaustive %v (error %q, refused %v)",
				step, px.Spec.Containers[0].Resources.Limits, *got.NodeNames, got.Error, got.FailedNodes, *want.NodeNames, want.Error, want.FailedNodes)
		}
		if len(*got.NodeNames) == 1 {
			unlisted += len(names) - 1 - len(got.FailedNodes) - len(got.FailedAndUnresolvableNodes) -
				(len(names) - 1 - len(want.FailedNodes) - len(want.FailedAndUnresolvableNodes))
		}
		if len(*got.NodeNames) == 1 {
			if err := streamBind(x, px, (*got.NodeNames)[0]); err != nil {
				t.Fatal(err)
			}
			if err := streamBind(y, py, (*got.NodeNames)[0]); err != nil {
				t.Fatal(err)
			}
			placed = append(placed, px.UID)
		}
		if rng.IntN(3) == 0 && len(placed) > 0 {
			i := rng.IntN(len(placed))
			x.State.DeletePod(placed[i])
			y.State.DeletePod(placed[i])
			placed = slices.Delete(placed, i, i+1)
		}
	}
	_, xe := x.Evaluations()
	_, ye := y.Evaluations()
	if len(placed) < 20 {
		t.Fatalf("only %d pods placed: the comparison saw too few choices", len(placed))
	}
	if xe-xe0 >= (ye)/2 {
		t.Fatalf("bounded pick-one evaluated %d nodes, exhaustive %d: the bound should spare at least half", xe-xe0, ye)
	}
	if unlisted == 0 {
		t.Fatal("every refused node was checked: the coarse bound pruned no node that does not fit")
	}
	t.Logf("evaluated: bounded %d (bounded %d), exhaustive %d; refused nodes not checked: %d", xe-xe0, x.Bounded(), ye, unlisted)
}

// refusalsAgree: a bounded pick-one reply refuses what the exhaustive one refuses, for the same
// reasons; where it kept a node it may leave refused nodes out (not checked, as fitting nodes not
// chosen are left out: the scheduler goes on with the kept node and reads no status of them).
func refusalsAgree(got, want extenderv1.FailedNodesMap, kept bool) bool {
	if !kept {
		return maps.Equal(got, want)
	}
	for name, why := range got {
		if want[name] != why {
			return false
		}
	}
	return true
}

// TestWarmerBoundsForPickOne: where pick-one Filter bounds (many typical shapes), the warmer bounds
// the nodes that changed for the shapes the memo holds, and while a new snapshot is staged it
// computes every node's bound data, so that the next pod of a shape bounds nothing in the call and
// a shape never seen computes no node bound data in it; every choice is the exhaustive one.
func TestWarmerBoundsForPickOne(t *testing.T) {
	x, names := boundCluster(t)
	y, _ := boundCluster(t)
	y.ExhaustivePickOne = true
	x.State.changes.start()
	x.State.Shapes().StageSnapshots(true) // as RunWarmer does
	x.WarmShapes = 2
	pods := []func(string) *corev1.Pod{
		func(n string) *corev1.Pod { return withCPU(sharePod(n, 1, 4, 30), "2") },
		func(n string) *corev1.Pod { return withCPU(wholePod(n, 1), "4") },
		func(n string) *corev1.Pod { return withCPU(sharePod(n, 2, 3, 25), "1") },
	}
	step := 0
	filter := func(k int) (node string, bounded, boundData int64) {
		name := fmt.Sprintf("p%d", step)
		step++
		px, py := pods[k](name), pods[k](name)
		px.UID, py.UID = "", "" // no hold: a hold changes the chosen node, which the next call bounds again
		b0, d0 := x.Bounded(), x.eval.Counts().BoundData
		got := x.Filter(&extenderv1.ExtenderArgs{Pod: px, NodeNames: &names})
		b1, d1 := x.Bounded(), x.eval.Counts().BoundData
		want := y.Filter(&extenderv1.ExtenderArgs{Pod: py, NodeNames: &names})
		if !slices.Equal(*got.NodeNames, *want.NodeNames) || len(*got.NodeNames) != 1 {
			t.Fatalf("shape %d: bounded pick-one kept %v, exhaustive %v", k, *got.NodeNames, *want.NodeNames)
		}
		return (*got.NodeNames)[0], b1 - b0, d1 - d0
	}
	if !x.Engine.Bounded(mustRequest(t, x, pods[0]("q"))) {
		t.Fatal("pick-one does not bound the test's requests: the test would prove nothing")
	}
	filter(1)
	node, _, _ := filter(0)
	for _, c := range []*Extender{x, y} { // the choice is bound (its node changes)
		if err := streamBind(c, pods[0]("bound"), node); err != nil {
			t.Fatal(err)
		}
	}
	x.warmOnce(context.Background())
	for k := range 2 {
		if _, b, _ := filter(k); b != 0 {
			t.Fatalf("shape %d after a bind and a warmer pass: %d nodes bounded in the call, want 0", k, b)
		}
	}
	// Pending pods move the typical shapes: a snapshot is staged, the warmer fills it and promotes.
	learnShapes(x, 0, 200)
	learnShapes(y, 0, 200)
	if x.State.Shapes().StagedScoreContext() == nil {
		t.Fatal("no snapshot staged after the counts drifted")
	}
	x.warmOnce(context.Background())
	if x.State.Shapes().StagedScoreContext() != nil {
		t.Fatal("the staged snapshot was not promoted")
	}
	// Every node's kept bound data is what the promoted snapshot computes (not the old one's).
	sc := x.State.Shapes().ScoreContext()
	req := mustRequest(t, x, pods[2]("check"))
	x.State.viewIndexed(names, 1, func(_, _, slot int, n *placement.NodeState, _ string) {
		kept := x.eval.NodeBound(slot, n)
		if _, nb, u := x.Engine.Bound(sc, n, req, nil, true); u == nil && (kept == nil || !reflect.DeepEqual(*kept, *nb)) {
			t.Fatalf("node %s: kept bound data %+v, the serving snapshot's %+v", n.Name, kept, nb)
		}
	})
	if _, _, d := filter(2); d != 0 {
		t.Fatalf("a shape never seen after the warmer's pass: %d nodes' bound data computed in the call, want 0", d)
	}
}

func mustRequest(t *testing.T, x *Extender, pod *corev1.Pod) *placement.Request {
	r, err := RequestFromPod(pod, x.Class)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestBoundedWarmerAgreesWithExhaustive: with the warmer running beside the calls (bounding the
// nodes that change, filling staged snapshots, promoting them), every pick-one choice is the one an
// extender without memo or bounds makes on the same state and snapshot (steps where the serving
// snapshot changed between the two calls are not compared; most are). Run with -race.
func TestBoundedWarmerAgreesWithExhaustive(t *testing.T) {
	x, names := boundCluster(t)
	x.State.changes.start()
	ctx, cancel := context.WithCancel(context.Background())
	warmer := make(chan struct{})
	go func() { defer close(warmer); x.RunWarmer(ctx) }()
	defer func() { cancel(); <-warmer }()
	fresh := &Extender{Engine: x.Engine, State: x.State, Class: x.Class, PickOne: true, ExhaustivePickOne: true}
	rng := rand.New(rand.NewPCG(7, 8))
	pods := []func(string) *corev1.Pod{
		func(n string) *corev1.Pod { return withCPU(sharePod(n, 1, 4, 30), "2") },
		func(n string) *corev1.Pod { return withCPU(wholePod(n, 1), "4") },
		func(n string) *corev1.Pod { return withCPU(sharePod(n, 2, 3, 25), "1") },
		func(n string) *corev1.Pod { return withCPU(sharePod(n, 1, 8, 70), "8") },
	}
	var placed []types.UID
	compared := 0
	for step := range 120 {
		pod := pods[rng.IntN(len(pods))](fmt.Sprintf("p%d", step))
		args := &extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names}
		before := x.State.Shapes().ScoreContext().Snapshot
		x.State.markPending(pod, x.Class) // Filter holds each choice, as for the informer's pods
		got := x.Filter(args)
		want := fresh.Filter(args)
		if x.State.Shapes().ScoreContext().Snapshot != before {
			continue
		}
		compared++
		if !slices.Equal(*got.NodeNames, *want.NodeNames) {
			t.Fatalf("step %d: bounded pick-one with the warmer kept %v, exhaustive %v", step, *got.NodeNames, *want.NodeNames)
		}
		if len(*got.NodeNames) == 1 && streamBind(x, pod, (*got.NodeNames)[0]) == nil {
			placed = append(placed, pod.UID)
			if step%10 == 0 {
				// Let the warmer take its turn (it waits 5 ms after a change and while a call is in
				// flight: back-to-back calls on a loaded machine would starve it).
				w0 := x.Warmed()
				for start := time.Now(); x.Warmed() == w0 && time.Since(start) < 2*time.Second; {
					time.Sleep(time.Millisecond)
				}
			}
		}
		if rng.IntN(3) == 0 && len(placed) > 0 {
			i := rng.IntN(len(placed))
			x.State.DeletePod(placed[i])
			placed = slices.Delete(placed, i, i+1)
		}
	}
	if compared < 80 || x.Warmed() == 0 {
		t.Fatalf("compared %d steps, warmed %d: the comparison proved little", compared, x.Warmed())
	}
}

// TestPickOneTiedBoundsNotEvaluated: where every node is in the same state (empty nodes of one
// kind: most of the live benchmark's 4,852), a shape's bounds kept from the warmer's pass equal the
// score the first evaluated node gets, so pick-one evaluates that node and skips the rest, whose
// ties go to it by name. Bounds kept as float32 rounded up read back above that score and the call
// evaluated every node (the live filter's slowest calls: ~3 ms at 4,852 nodes).
func TestPickOneTiedBoundsNotEvaluated(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	x.PickOne = true
	names := uniformNodes(x, "node-%03d", 64, 4, "64", "512Gi")
	x.State.changes.start()
	x.State.Shapes().StageSnapshots(true) // as RunWarmer does
	filter := func(name string) (string, int64) {
		pod := withCPU(sharePod(name, 1, 4, 30), "2")
		pod.UID = "" // no hold: every call sees the same nodes
		e0 := x.eval.Counts().Evaluated
		got := x.Filter(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names})
		if got.NodeNames == nil || len(*got.NodeNames) != 1 {
			t.Fatalf("%s: kept %v, want one node", name, got.NodeNames)
		}
		return (*got.NodeNames)[0], x.eval.Counts().Evaluated - e0
	}
	filter("first")
	// Pending pods move the typical shapes: the warmer fills the staged snapshot's table for the
	// shape (a bound for every node) and promotes it.
	learnShapes(x, 0, 200)
	x.warmOnce(context.Background())
	if x.State.Shapes().StagedScoreContext() != nil {
		t.Fatal("the staged snapshot was not promoted")
	}
	node, evaluated := filter("second")
	if node != names[0] {
		t.Fatalf("kept %s, want %s (every node ties; the smallest name wins)", node, names[0])
	}
	if evaluated > 2 {
		t.Fatalf("%d of %d tied nodes evaluated in the call, want at most 2", evaluated, len(names))
	}
}
