package main

import (
	"context"
	"log/slog"
	"path/filepath"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/tools/record"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/agent"
	"github.com/tessera-gpu/tessera/internal/gpu"
	"github.com/tessera-gpu/tessera/internal/memguard"
	"github.com/tessera-gpu/tessera/internal/nri"
	"github.com/tessera-gpu/tessera/vcuda"
)

// startMemoryGuard runs the memory guard (internal/memguard) on the backend's NVML until ctx ends:
// the caps of the agent's ledger (memory, and compute where the compute guard is on) enforced on
// what the driver measures per process, compared with
// the regions the metrics read (the same bounded read and vcuda.ParseRegion); the per-context
// overhead it measures is published in the run directory's node files for vcuda.
func startMemoryGuard(ctx context.Context, cfg *configv1.NodeConfig, backend gpu.Backend, a *agent.Agent, plugin *nri.Plugin,
	events record.EventRecorder, reg prometheus.Registerer, log *slog.Logger) error {
	m, cg := cfg.MemoryGuard, cfg.ComputeGuard
	if !m.On() {
		log.Warn("memory guard off (--memory-guard=false): share memory caps rest on vcuda alone, which a container can walk past; the compute guard, which runs in its samples, is off too")
		return nil
	}
	var compute *memguard.ComputeConfig
	var feedback *memguard.FeedbackConfig
	if cg.On() {
		compute = &memguard.ComputeConfig{Window: cg.Window.Duration, Grace: cg.Grace.Duration, TolerancePercent: cg.TolerancePercent,
			Kill: cg.Action == configv1.ComputeGuardKill}
		// The driver's measured busy time per process, published into each share container for
		// vcuda's compute limiter (api.ComputeMeasured), attributed with the guard's samples.
		feedback = &memguard.FeedbackConfig{Interval: cg.FeedbackInterval.Duration, File: plugin.MeasuredComputeFile}
	} else {
		log.Warn("compute guard off (--compute-guard=false): share compute caps rest on vcuda alone, which a container can lift")
	}
	g := memguard.New(memguard.Config{NVML: backend.NVML(), Entries: a.Ledger().Entries, Inventory: a.Inventory,
		Region: func(id string) (*vcuda.Region, error) {
			data, err := plugin.ReadRegion(id)
			if err != nil {
				return nil, err
			}
			return vcuda.ParseRegion(data)
		},
		HostProc: cfg.HostProc, Interval: m.Interval.Duration, Grace: m.Grace.Duration,
		ToleranceBytes: m.ToleranceBytes, TolerancePercent: m.TolerancePercent,
		ContextOverheadFile: filepath.Join(nri.NodeFilesDir(cfg.RunDir), api.ContextOverheadFile), Compute: compute, Feedback: feedback,
		NodeName: cfg.NodeName, Events: events, Log: log})
	if err := g.Register(reg); err != nil {
		return err
	}
	go g.Run(ctx)
	go g.RunFeedback(ctx) // nothing without the compute guard
	log.Info("memory guard running", "interval", m.Interval.Duration, "grace", m.Grace.Duration, "toleranceBytes", m.ToleranceBytes,
		"tolerancePercent", m.TolerancePercent, "hostProc", cfg.HostProc, "computeGuard", cg.On(), "computeWindow", cg.Window.Duration,
		"computeGrace", cg.Grace.Duration, "computeTolerancePercent", cg.TolerancePercent, "computeAction", cg.Action,
		"computeFeedbackInterval", cg.FeedbackInterval.Duration)
	return nil
}
