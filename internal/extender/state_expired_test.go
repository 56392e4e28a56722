package extender

import (
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// A reservation whose bind outcome never comes is dropped after the TTL and counted once per pod
// (its GPU entry and its CPU/memory use expire together); one still within the TTL is kept.
func TestExpiredReservationsCounted(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	now := time.Unix(1_000_000, 0)
	x.State.now = func() time.Time { return now }
	x.State.UpsertNode(testNode(testInventory("c", 1, 2, "A100"), nil))
	reserve := func(name string) {
		pod := withCPU(wholePod(name, 1), "4")
		pod.UID = types.UID("uid-" + name)
		req, err := RequestFromPod(pod, x.Class)
		if err != nil {
			t.Fatal(err)
		}
		var a *api.PodAssignment
		x.State.View([]string{"c"}, func(_ string, n *placement.NodeState, _ string) {
			p, _, _ := x.Engine.Evaluate(x.State.Shapes().ScoreContext(), n, req)
			a = BuildAssignment(n, req, &p)
		})
		x.State.reserve(pod.UID, req.Key, pod.Namespace, req, a)
	}
	reserve("old")
	now = now.Add(DefaultTTL / 2)
	reserve("new")
	now = now.Add(DefaultTTL/2 + time.Second)
	x.State.ExpireReservations()
	if got := x.State.ExpiredReservations(); got != 1 {
		t.Errorf("ExpiredReservations = %d after one pod's reservation expired, want 1", got)
	}
	if !x.State.Holds("uid-new") || x.State.Holds("uid-old") {
		t.Errorf("holds old %v new %v, want only new", x.State.Holds("uid-old"), x.State.Holds("uid-new"))
	}
	x.State.ExpireReservations()
	if got := x.State.ExpiredReservations(); got != 1 {
		t.Errorf("ExpiredReservations = %d after a pass with nothing expired, want still 1", got)
	}
}
