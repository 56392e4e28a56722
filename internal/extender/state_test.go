package extender

import (
	"fmt"
	corev1 "k8s.io/api/core/v1"
	"slices"
	"testing"
	"time"

	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// TestStateCountsArrivals checks that pending pods count in the shapes (the arrival distribution),
// once each, and that a node seen after its pods gets them applied.
func TestStateCountsArrivals(t *testing.T) {
	s := NewState(time.Minute, nil)
	p := sharePod("p", 1, 4, 30)
	s.UpsertPod(p, ClassOptions{})
	s.UpsertPod(p, ClassOptions{})
	if got := s.Shapes().Total(); got != 1 {
		t.Fatalf("pending pod counted %d times, want 1", got)
	}
	a := assigned(wholePod("w", 2), "n1", api.DeviceAssignment{UUID: gpuUUID(1, 0), Whole: true}, api.DeviceAssignment{UUID: gpuUUID(1, 1), Whole: true})
	s.UpsertPod(a, ClassOptions{})
	s.UpsertNode(testNode(testInventory("n1", 1, 4, "A100"), nil))
	s.View([]string{"n1"}, func(_ string, n *placement.NodeState, _ string) {
		if n == nil || !n.GPUs[0].Whole || !n.GPUs[1].Whole || n.GPUs[2].Whole {
			t.Fatalf("node seen after its pod: %+v", n)
		}
	})
	s.DeletePod(p.UID)
	s.DeletePod(a.UID)
	if got := s.Shapes().Total(); got != 0 {
		t.Fatalf("deleted pods still counted: %d", got)
	}
}

// TestPrioritizeReusesFilter checks that Prioritize after Filter scores exactly as Prioritize alone,
// also when a node changed in between (its entry must not be reused).
func TestPrioritizeReusesFilter(t *testing.T) {
	build := func() (*Extender, []string) {
		x := newTestExtender(t, api.PolicyTessera)
		var names []string
		for i := 0; i < 6; i++ {
			name := fmt.Sprintf("n%d", i)
			names = append(names, name)
			x.State.UpsertNode(testNode(testInventory(name, i, 4, "A100"), nil))
			for g := 0; g < i%4; g++ {
				x.State.UpsertPod(assigned(sharePod(fmt.Sprintf("s%d-%d", i, g), 1, 2, 10*(g+i)), name,
					api.DeviceAssignment{UUID: gpuUUID(i, g), MemoryBytes: 2 << 30, CoresPercent: 10 * (g + i)}), x.Class)
			}
		}
		return x, names
	}
	pod := sharePod("new", 1, 4, 35)
	// change fills n1 (the best node) through a reservation (no new pod is observed, so the shape snapshot stays and
	// only the node's version tells Prioritize that Filter's score for n1 is stale).
	change := func(x *Extender) {
		var devs []api.DeviceAssignment
		for g := 0; g < 4; g++ {
			devs = append(devs, api.DeviceAssignment{UUID: gpuUUID(1, g), Whole: true})
		}
		req, _ := RequestFromPod(wholePod("late", 4), x.Class)
		x.State.reserve("uid-late", "default/late", "default", req, &api.PodAssignment{APIVersion: api.Version, Node: "n1",
			Containers: []api.ContainerAssignment{{Name: "main", Devices: devs}}})
	}
	for _, changed := range []bool{false, true} {
		xa, names := build()
		fr := xa.Filter(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names})
		if changed {
			change(xa)
		}
		got, _ := xa.Prioritize(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: fr.NodeNames})
		xb, _ := build()
		if changed {
			change(xb)
		}
		want, _ := xb.Prioritize(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: fr.NodeNames})
		if !slices.Equal(*got, *want) {
			t.Fatalf("changed=%v: after Filter %v, alone %v", changed, *got, *want)
		}
	}
}

// TestUnschedulablePodsDoNotShape: pending pods the scheduler found no node for leave the mix.
func TestUnschedulablePodsDoNotShape(t *testing.T) {
	s := NewState(time.Minute, nil)
	p := sharePod("junk", 1, 4, 30)
	s.UpsertPod(p, ClassOptions{})
	if s.Shapes().Total() != 1 {
		t.Fatal("pending pod not counted")
	}
	p = p.DeepCopy()
	p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: corev1.PodReasonUnschedulable}}
	s.UpsertPod(p, ClassOptions{})
	if got := s.Shapes().Total(); got != 0 {
		t.Fatalf("unschedulable pod still shapes the mix (%d)", got)
	}
}

// TestResolveCacheKeepsTheListInUse: pick-one's calls alternate filter over every node with
// prioritize over one, a different one per pod; the long list stays resolved (a round-robin cache
// resolved 5,000 names again every other pod).
func TestResolveCacheKeepsTheListInUse(t *testing.T) {
	nodes := map[string]*nodeEntry{"a": {}, "b": {}, "c": {}}
	var c resolveCache
	all := []string{"a", "b", "c"}
	first := c.resolve(all, 1, nodes)
	for _, one := range []string{"a", "b", "c", "a"} {
		c.resolve([]string{one}, 1, nodes)
		if got := c.resolve(all, 1, nodes); &got[0] != &first[0] {
			t.Fatalf("after resolving [%s] the list of every node was resolved again", one)
		}
	}
}

// TestStateReportsFreeComputeByModel: the model pressure reads the cluster's free GPU compute per
// model from the State: every node as it appears, every GPU taken or given back by a pod, a node
// rebuilt (its pods applied again) and a node gone.
func TestStateReportsFreeComputeByModel(t *testing.T) {
	s := NewState(time.Minute, nil)
	want := func(step string, a100, t4 int64) {
		t.Helper()
		if got := s.Shapes().FreeCompute(); got["A100"] != a100 || got["T4"] != t4 {
			t.Fatalf("%s: free compute %v, want A100 %d, T4 %d", step, got, a100, t4)
		}
	}
	s.UpsertNode(testNode(testInventory("n1", 1, 4, "A100"), nil))
	s.UpsertNode(testNode(testInventory("n2", 2, 2, "T4"), nil))
	want("nodes", 4000, 2000)
	whole := assigned(wholePod("w", 1), "n1", api.DeviceAssignment{UUID: gpuUUID(1, 0), Whole: true})
	s.UpsertPod(whole, ClassOptions{})
	s.UpsertPod(assigned(sharePod("s", 1, 2, 30), "n1", api.DeviceAssignment{UUID: gpuUUID(1, 1), MemoryBytes: 2 << 30, CoresPercent: 30}), ClassOptions{})
	want("pods", 2700, 2000)
	s.DeletePod(whole.UID)
	want("pod gone", 3700, 2000)
	s.UpsertNode(testNode(testInventory("n1", 1, 4, "A100"), map[string]string{"rebuilt": "yes"}))
	want("node rebuilt", 3700, 2000)
	s.DeleteNode("n1")
	want("node gone", 0, 2000)
}

// TestViewEntriesSkipsDeletedNodes: entries listed before their node was deleted (the warmer's
// list of changed or usable nodes) are not viewed afterwards, also once a new node took the
// deleted one's slot and a node of the same name came back (a new entry).
func TestViewEntriesSkipsDeletedNodes(t *testing.T) {
	s := NewState(DefaultTTL, nil)
	for i, name := range []string{"n1", "n2", "n3"} {
		s.UpsertNode(testNode(testInventory(name, i, 2, "A100"), nil))
	}
	listed := s.usableEntries()
	s.DeleteNode("n2")
	s.UpsertNode(testNode(testInventory("n4", 4, 2, "A100"), nil)) // takes n2's slot
	s.UpsertNode(testNode(testInventory("n2", 2, 2, "A100"), nil)) // n2 again: a new entry
	var seen []string
	s.viewEntries(listed, func(_ int, n *placement.NodeState) { seen = append(seen, n.Name) })
	slices.Sort(seen)
	if !slices.Equal(seen, []string{"n1", "n3"}) {
		t.Fatalf("viewed %v of the entries listed before n2 was deleted, want [n1 n3]", seen)
	}
}
