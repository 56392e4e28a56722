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
		node := testNode(testInventory(names[i], i, gpus, "A100"), nil)
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
// refuses the same nodes for the same reasons), pod after pod (twelve shapes, recurring), on two
// identical clusters that bind each choice and delete pods at random; and it does evaluate fewer
// nodes.
func TestBoundedPickOneMatchesExhaustive(t *testing.T) {
	x, names := boundCluster(t)
	y, _ := boundCluster(t)
	y.ExhaustivePickOne = true
	rng := rand.New(rand.NewPCG(3, 4))
	var placed []types.UID
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
		got := x.Filter(&extenderv1.ExtenderArgs{Pod: px, NodeNames: &names})
		want := y.Filter(&extenderv1.ExtenderArgs{Pod: py, NodeNames: &names})
		if got.Error != want.Error || !slices.Equal(*got.NodeNames, *want.NodeNames) ||
			!maps.Equal(got.FailedNodes, want.FailedNodes) || !maps.Equal(got.FailedAndUnresolvableNodes, want.FailedAndUnresolvableNodes) {
			t.Fatalf("step %d (%v): bounded pick-one kept %v (error %q), exhaustive %v (error %q)",
				step, px.Spec.Containers[0].Resources.Limits, *got.NodeNames, got.Error, *want.NodeNames, want.Error)
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
	t.Logf("evaluated: bounded %d (bounded %d), exhaustive %d", xe-xe0, x.Bounded(), ye)
}

// TestBoundWordsRoundUp: a bound kept in a table's word (float32) reads back no lower than it was
// (else a node whose bound equals its score could be pruned although it is the best), and only
// for the node bound data it was computed from.
func TestBoundWordsRoundUp(t *testing.T) {
	tab := newEvalTable(nil, 4)
	rng := rand.New(rand.NewPCG(5, 6))
	nb, other := &nodeBoundSlot{gen: 7}, &nodeBoundSlot{gen: 8}
	for range 10000 {
		b := float64(rng.IntN(101)) - 1e-3*rng.Float64()*8000
		tab.storeBound(1, nb, b)
		got, ok := tab.bound(1, nb)
		if !ok || got < b {
			t.Fatalf("stored %v, read %v (ok %v)", b, got, ok)
		}
		if _, ok := tab.bound(1, other); ok {
			t.Fatal("a bound read back for other node bound data")
		}
	}
}
