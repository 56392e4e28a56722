package gpu

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"testing/synctest"
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

// TestSimFaultFilesSchedule pins the fault-file loop on a synctest bubble's clock: it looks once a
// faultFilesInterval, goes on while the directory is missing and after a fault file it could not
// apply (removed all the same), and ends with its context.
func TestSimFaultFilesSchedule(t *testing.T) {
	b, _ := openTestSim(t, "")
	dir := FaultsDir(b.stateDir)
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		done := make(chan struct{})
		go func() { defer close(done); b.watchFaultFiles(ctx, slog.New(slog.NewTextHandler(t.Output(), nil))) }()
		time.Sleep(faultFilesInterval * 3 / 2) // one look, at no directory
		synctest.Wait()
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		fault := filepath.Join(dir, "xid-GPU-not-on-this-node")
		for i := range 2 {
			if err := os.WriteFile(fault, []byte("79\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			synctest.Wait()
			if _, err := os.Stat(fault); err != nil {
				t.Fatalf("fault file %d taken before the next look: %v", i, err)
			}
			time.Sleep(faultFilesInterval)
			synctest.Wait()
			if _, err := os.Stat(fault); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("fault file %d still there a look later (%v), want it read and removed", i, err)
			}
		}
		cancel()
		<-done
	})
}
