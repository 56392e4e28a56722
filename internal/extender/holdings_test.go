package extender

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// TestSecurityExtenderCountsHoldings: what the node agent's ledger holds for pods the extender does
// not track (a local placement by the agent) is occupied; a pod the extender tracks is counted once.
func TestSecurityExtenderCountsHoldings(t *testing.T) {
	s := NewState(time.Minute, nil)
	inv := testInventory("n1", 1, 2, "A100")
	node := testNode(inv, nil)
	raw, err := api.EncodeHoldings(&api.NodeHoldings{Node: "n1", Pods: []api.PodHolding{
		{Namespace: "default", Pod: "local", UID: "uid-local", Local: true, Containers: []api.ContainerAssignment{{Name: "main", Devices: []api.DeviceAssignment{{UUID: gpuUUID(1, 0), Whole: true}}}}},
		{Namespace: "default", Pod: "own", UID: "uid-own", Containers: []api.ContainerAssignment{{Name: "main", Devices: []api.DeviceAssignment{{UUID: gpuUUID(1, 1), MemoryBytes: 4 << 30, CoresPercent: 10}}}}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	// The extender's own pod on GPU 1 (its assignment annotation, bound to n1).
	own := sharePod("own", 1, 4, 10)
	own.Spec.NodeName = "n1"
	a, _ := api.EncodeAssignment(&api.PodAssignment{APIVersion: api.Version, Node: "n1", Containers: []api.ContainerAssignment{{Name: "main", Devices: []api.DeviceAssignment{{UUID: gpuUUID(1, 1), MemoryBytes: 4 << 30, CoresPercent: 10}}}}})
	own.Annotations[api.AnnotationAssignment] = string(a)
	s.UpsertNode(node)
	s.UpsertPod(own, ClassOptions{})
	node.Annotations[api.AnnotationHoldings] = string(raw)
	s.UpsertNode(node)
	check := func(when string, whole0 bool, shares1 int) {
		t.Helper()
		s.View([]string{"n1"}, func(_ string, n *placement.NodeState, missing string) {
			if n == nil {
				t.Fatalf("%s: node missing: %s", when, missing)
			}
			if n.GPUs[0].Whole != whole0 || n.GPUs[1].Shares != shares1 {
				t.Errorf("%s: GPU0 whole=%v (want %v), GPU1 shares=%d (want %d)", when, n.GPUs[0].Whole, whole0, n.GPUs[1].Shares, shares1)
			}
		})
	}
	check("with holdings", true, 1)
	// The local placement is released on the node: the GPU is free again.
	raw2, _ := api.EncodeHoldings(&api.NodeHoldings{Node: "n1"})
	node.Annotations[api.AnnotationHoldings] = string(raw2)
	s.UpsertNode(node)
	check("holdings emptied", false, 1)
}

// TestSecurityBindCountsHoldings: Bind, when Filter's reservation is missing (expired, or the bind
// reached another replica), decides against the node's holdings too: a GPU the node agent's ledger
// holds whole for a pod the extender does not track is never assigned again.
func TestSecurityBindCountsHoldings(t *testing.T) {
	heldWhole := func(t *testing.T, node *corev1.Node) {
		t.Helper()
		raw, err := api.EncodeHoldings(&api.NodeHoldings{Node: node.Name, Pods: []api.PodHolding{
			{Namespace: "default", Pod: "local", UID: "uid-local", Local: true, Containers: []api.ContainerAssignment{{Name: "main", Devices: []api.DeviceAssignment{{UUID: gpuUUID(1, 0), Whole: true}}}}},
		}})
		if err != nil {
			t.Fatal(err)
		}
		node.Annotations[api.AnnotationHoldings] = string(raw)
	}
	bind := func(t *testing.T, gpus int, pod *corev1.Pod) (*corev1.Pod, error) {
		t.Helper()
		node := testNode(testInventory("n1", 1, gpus, "A100"), nil)
		heldWhole(t, node)
		_, got, err := bindAndRead(t, node, pod)
		return got, err
	}
	// The node's only GPU is held whole: nothing is left, whole or shared.
	for _, pod := range []*corev1.Pod{wholePod("w", 1), sharePod("s", 1, 4, 10)} {
		t.Run("refused/"+pod.Name, func(t *testing.T) {
			got, err := bind(t, 1, pod)
			if err == nil || !strings.Contains(err.Error(), "no longer fits node n1") {
				t.Fatalf("bind onto the held GPU: err %v, want a refusal", err)
			}
			if got.Spec.NodeName != "" || got.Annotations[api.AnnotationAssignment] != "" {
				t.Fatalf("refused bind left node %q assignment %q", got.Spec.NodeName, got.Annotations[api.AnnotationAssignment])
			}
		})
	}
	// A pod the API server lists as assigned on the node (the state has not seen it yet) and the
	// holdings both name is counted once: half of the GPU stays free for the binding pod.
	t.Run("counted once", func(t *testing.T) {
		node := testNode(testInventory("n1", 1, 1, "A100"), nil)
		dev := api.DeviceAssignment{UUID: gpuUUID(1, 0), MemoryBytes: 8 << 30}
		raw, err := api.EncodeHoldings(&api.NodeHoldings{Node: "n1", Pods: []api.PodHolding{
			{Namespace: "default", Pod: "b", UID: "uid-b", Containers: []api.ContainerAssignment{{Name: "main", Devices: []api.DeviceAssignment{dev}}}},
		}})
		if err != nil {
			t.Fatal(err)
		}
		node.Annotations[api.AnnotationHoldings] = string(raw)
		pod := sharePod("s", 1, 8, 0)
		cs, _ := fakeAPI(t, node, assigned(sharePod("b", 1, 8, 0), "n1", dev), pod)
		x := newBinder(t, cs, "a", node)
		if err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: "s", PodNamespace: "default", PodUID: pod.UID, Node: "n1"}); err != nil {
			t.Fatalf("8 GiB of the GPU are free, bind refused: %v", err)
		}
	})
	// A second GPU is free: bind takes it, never the held one.
	for _, pod := range []*corev1.Pod{wholePod("w", 1), sharePod("s", 1, 4, 10)} {
		t.Run("other/"+pod.Name, func(t *testing.T) {
			got, err := bind(t, 2, pod)
			if err != nil {
				t.Fatal(err)
			}
			a, err := api.DecodeAssignment([]byte(got.Annotations[api.AnnotationAssignment]))
			if err != nil {
				t.Fatal(err)
			}
			if got.Spec.NodeName != "n1" || len(a.Containers) != 1 || len(a.Containers[0].Devices) != 1 || a.Containers[0].Devices[0].UUID != gpuUUID(1, 1) {
				t.Fatalf("bind chose %+v on node %q, want %s only (%s is held whole)", a, got.Spec.NodeName, gpuUUID(1, 1), gpuUUID(1, 0))
			}
		})
	}
}
