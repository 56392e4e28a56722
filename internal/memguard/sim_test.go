package memguard

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/tessera-gpu/tessera/internal/gpu"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// TestSimBackend: the guard samples the sim backend's NVML (tessera-node --backend=sim) without
// failing, whether or not the simulation lists processes: a list it does not implement (go-nvml's
// mock panics there) is an NVML error on that GPU, counted, never a crash and never a kill.
func TestSimBackend(t *testing.T) {
	b, err := gpu.OpenSim(gpu.Options{StateDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	n, err := b.Discover(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	inv := n.Inventory("node-a", 10)
	uuid := inv.GPUs[0].UUID
	g := New(Config{NVML: b.NVML(), HostProc: t.TempDir(), Grace: 0, ToleranceBytes: 64 << 20, TolerancePercent: 2,
		Entries: func() []ledger.Entry { return []ledger.Entry{share(ctrA, "pod-a", uuid, 256<<20)} }})
	if err := g.Register(prometheus.NewRegistry()); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		g.Sample()
	}
	if testutil.ToFloat64(g.metrics.kills) != 0 {
		t.Error("a kill on the simulated node with no processes")
	}
	t.Logf("NVML errors on %s: %v", uuid, testutil.ToFloat64(g.metrics.nvmlErrors.WithLabelValues(uuid)))
}
