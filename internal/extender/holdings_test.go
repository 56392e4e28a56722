package extender

import (
	"testing"
	"time"

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
