package gpu

import (
	"context"
	"os"
	"testing"
	"time"
)

// TestSimFaultFileRaisesXID: a fault file in the simulated node's state directory raises its XID
// through the health watch, as a driver XID would.
func TestSimFaultFileRaisesXID(t *testing.T) {
	b, n := openTestSim(t, "")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	events := make(chan HealthEvent, 16)
	go b.WatchHealth(ctx, HealthOptions{CheckInterval: time.Hour}, func(e HealthEvent) { events <- e })
	dir := FaultsDir(b.stateDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	uuid := n.GPUs[3].UUID
	// The watch registers its event set before it can see an XID: write until one lands.
	for {
		if err := os.WriteFile(dir+"/xid-"+uuid, []byte("79\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		select {
		case e := <-events:
			if e.UUID != uuid || e.Healthy || e.XID != 79 {
				t.Fatalf("event %+v, want XID 79 on %s", e, uuid)
			}
			return
		case <-time.After(time.Second):
		}
	}
}
