package extender

import (
	"strings"
	"testing"
	"time"

	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestSecurityInventoryFreshnessByObservation: inventory freshness is timed on the extender's own
// clock, from when it saw the heartbeat change, never by comparing the agent's timestamp with the
// extender's clock. A dead node whose agent's clock ran an hour fast (heartbeat an hour in the
// future, never renewed, only re-sent unchanged by informer resyncs) goes stale once InventoryMaxAge
// has passed as observed; a live node whose clock runs an hour slow (heartbeat an hour in the past,
// renewed every minute) stays placeable; and with no informer events at all a node still goes stale.
func TestSecurityInventoryFreshnessByObservation(t *testing.T) {
	now := time.Date(2026, 11, 23, 10, 0, 0, 0, time.UTC)
	x := newTestExtender(t, api.PolicyTessera)
	x.State.now = func() time.Time { return now }
	x.State.InventoryMaxAge = 5 * time.Minute
	beat := func(name string, hb time.Time) {
		n := testNode(testInventory(name, 1, 2, "T4"), nil)
		n.Annotations[api.AnnotationInventoryHeartbeat] = hb.Format(time.RFC3339)
		x.State.UpsertNode(n)
	}
	names := []string{"fast", "slow"}
	filter := func() *extenderv1.ExtenderFilterResult {
		return x.Filter(&extenderv1.ExtenderArgs{Pod: wholePod("p", 1), NodeNames: &names})
	}
	fastBeat, start := now.Add(time.Hour), now
	for minute := 0; minute <= 10; minute++ {
		beat("fast", fastBeat)                                              // the same value: no renewal
		beat("slow", now.Add(-time.Hour+time.Duration(minute)*time.Minute)) // renewed every minute
		res := filter()
		fits := map[string]bool{}
		for _, n := range *res.NodeNames {
			fits[n] = true
		}
		if !fits["slow"] {
			t.Fatalf("minute %d: the slow-clock node, renewed every minute, is refused: %v", minute, res.FailedNodes)
		}
		if wantFast := now.Sub(start) <= x.State.InventoryMaxAge; fits["fast"] != wantFast {
			t.Fatalf("minute %d: fast-clock node (never renewed) fits %v, want %v; failed %v", minute, fits["fast"], wantFast, res.FailedNodes)
		}
		if !fits["fast"] && !strings.Contains(res.FailedNodes["fast"], "heartbeat not renewed for "+now.Sub(start).String()+" as observed by the extender") {
			t.Fatalf("minute %d: fast-clock node's reason %q", minute, res.FailedNodes["fast"])
		}
		now = now.Add(time.Minute)
	}
	// The warmer's view agrees: only the renewed node is usable.
	if u := x.State.usableEntries(); len(u) != 1 || u[0].name != "slow" {
		t.Fatalf("usable entries: %d, want only slow", len(u))
	}
	// No event at all: the slow node's agent dies too; the extender notices by itself.
	now = now.Add(x.State.InventoryMaxAge)
	if res := filter(); len(*res.NodeNames) != 0 || !strings.Contains(res.FailedNodes["slow"], "stale") {
		t.Fatalf("without informer events for longer than the max age: fit %v, failed %v", *res.NodeNames, res.FailedNodes)
	}
}
