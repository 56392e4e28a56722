package extender

import (
	"context"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestStaleInventoryRefused: with InventoryMaxAge set, a node whose inventory heartbeat is missing,
// unreadable or not renewed for too long (as the extender observes it) is refused with a reason that
// says so; a fresh one is used, and a heartbeat update (no inventory change) brings a stale node back.
func TestStaleInventoryRefused(t *testing.T) {
	now := time.Date(2026, 11, 23, 10, 0, 0, 0, time.UTC)
	x := newTestExtender(t, api.PolicyTessera)
	x.State.now = func() time.Time { return now }
	x.State.InventoryMaxAge = time.Minute
	beat := func(name, hb string) {
		n := testNode(testInventory(name, 1, 2, "T4"), nil)
		if hb != "" {
			n.Annotations[api.AnnotationInventoryHeartbeat] = hb
		}
		x.State.UpsertNode(n)
	}
	// Freshness is timed by observation: "old" is seen with one heartbeat 5 minutes ago and never
	// again; "fresh" renews its heartbeat 30 s ago.
	beat("old", now.Add(-5*time.Minute).Format(time.RFC3339))
	beat("fresh", now.Add(-5*time.Minute).Format(time.RFC3339))
	now = now.Add(4*time.Minute + 30*time.Second)
	beat("fresh", now.Format(time.RFC3339))
	now = now.Add(30 * time.Second)
	beat("none", "")
	beat("junk", "yesterday")
	names := []string{"fresh", "old", "none", "junk"}
	res := x.Filter(&extenderv1.ExtenderArgs{Pod: wholePod("p", 1), NodeNames: &names})
	if len(*res.NodeNames) != 1 || (*res.NodeNames)[0] != "fresh" {
		t.Fatalf("fit %v, want only fresh; failed %v", *res.NodeNames, res.FailedNodes)
	}
	for node, want := range map[string]string{"old": "stale: heartbeat not renewed for 5m0s as observed by the extender", "none": "carries no heartbeat", "junk": "not an RFC 3339 time"} {
		if !strings.Contains(res.FailedNodes[node], want) {
			t.Errorf("%s: reason %q, want it to contain %q", node, res.FailedNodes[node], want)
		}
	}
	beat("old", now.Format(time.RFC3339))
	if res := x.Filter(&extenderv1.ExtenderArgs{Pod: wholePod("p", 1), NodeNames: &names}); len(*res.NodeNames) != 2 {
		t.Fatalf("after a heartbeat: fit %v, want fresh and old", *res.NodeNames)
	}
	x.State.InventoryMaxAge = 0
	if res := x.Filter(&extenderv1.ExtenderArgs{Pod: wholePod("p", 1), NodeNames: &names}); len(*res.NodeNames) != 4 {
		t.Fatalf("without a max age: fit %v, want all four", *res.NodeNames)
	}
}

// TestStaleInventoryBindRefused: bind refuses a node whose inventory went stale since Filter (its
// heartbeat not renewed for longer than InventoryMaxAge on the extender's clock).
func TestStaleInventoryBindRefused(t *testing.T) {
	now := time.Now()
	node := testNode(testInventory("n1", 1, 1, "T4"), nil)
	node.Annotations[api.AnnotationInventoryHeartbeat] = now.Add(-time.Hour).Format(time.RFC3339)
	a := wholePod("a", 1)
	cs, _ := fakeAPI(t, []runtime.Object{node, a}...)
	x := newBinder(t, cs, "x", node)
	x.State.InventoryMaxAge = time.Minute
	// Two minutes pass on the extender's clock without a heartbeat renewal.
	x.State.now = func() time.Time { return time.Now().Add(2 * time.Minute) }
	err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: "a", PodNamespace: "default", PodUID: a.UID, Node: "n1"})
	if err == nil || !strings.Contains(err.Error(), "stale") {
		t.Fatalf("bind on a stale inventory: %v", err)
	}
}

// TestVanishedGPUNeverPlaced: a GPU that left the inventory (unplugged, driver lost it) is placed on
// by neither Filter nor bind, and a pod still assigned to it holds nothing that exists.
func TestVanishedGPUNeverPlaced(t *testing.T) {
	inv := testInventory("n1", 1, 2, "T4")
	node := testNode(inv, nil)
	a := assigned(wholePod("a", 1), "n1", api.DeviceAssignment{UUID: gpuUUID(1, 0), Whole: true})
	b := wholePod("b", 1)
	cs, _ := fakeAPI(t, []runtime.Object{node, a, b}...)
	x := newBinder(t, cs, "x", node)
	x.State.UpsertPod(a, x.Class)
	x.State.UpsertPod(b, x.Class)
	// GPU 1 vanishes: the node is left with GPU 0, which a holds.
	inv.GPUs, inv.Links = inv.GPUs[:1], nil
	shrunk := testNode(inv, nil)
	x.State.UpsertNode(shrunk)
	if _, err := cs.CoreV1().Nodes().Update(context.Background(), shrunk, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	names := []string{"n1"}
	if res := x.Filter(&extenderv1.ExtenderArgs{Pod: b, NodeNames: &names}); len(*res.NodeNames) != 0 {
		t.Fatalf("b fits a node whose only GPU a holds (GPU 1 vanished)")
	}
	err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: "b", PodNamespace: "default", PodUID: b.UID, Node: "n1"})
	if err == nil {
		got, _ := cs.CoreV1().Pods("default").Get(context.Background(), "b", metav1.GetOptions{})
		t.Fatalf("b bound on a node with no free GPU: %s", got.Annotations[api.AnnotationAssignment])
	}
	// a's GPU vanishes too: the node has no GPU; a's assignment holds nothing, and nothing fits.
	inv.GPUs = nil
	x.State.UpsertNode(testNode(inv, nil))
	if res := x.Filter(&extenderv1.ExtenderArgs{Pod: b, NodeNames: &names}); len(*res.NodeNames) != 0 {
		t.Fatalf("b fits a node without GPUs")
	}
}
