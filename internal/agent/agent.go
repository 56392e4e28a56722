// Package agent is the heart of tessera-node: one inventory (with health), the CDI specs that
// describe it, and the device-plugin view of it (Source), all derived from the GPU backend and the
// ledger, and kept current when either changes.
package agent

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"sort"
	"sync"

	"k8s.io/client-go/tools/record"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/gpu"
	"github.com/tessera-gpu/tessera/internal/ledger"
	"github.com/tessera-gpu/tessera/internal/podresources"
)

// Config is what the agent needs beyond its parts.
type Config struct {
	NodeName     string
	SharesPerGPU int
	CDIDir       string
	Generator    *cdi.Generator
	// HealthStatePath is where GPU health is persisted across restarts ("" keeps it in memory).
	HealthStatePath string
	// Health configures the health watch (ignored XIDs, check interval).
	Health gpu.HealthOptions
	// Recorder, when set, records a Node event for every GPU health change.
	Recorder record.EventRecorder
	// Log receives the agent's lines and, unless Health.Log is set, the health watch's (nil:
	// discarded).
	Log *slog.Logger
}

// Agent owns the node's inventory. It is safe for concurrent use.
type Agent struct {
	cfg     Config
	log     *slog.Logger
	backend gpu.Backend
	ledger  *ledger.Ledger
	writer  *cdi.Writer
	// allocated, when set, returns the device IDs the kubelet has handed out per resource, so that
	// health marks spare tokens unhealthy rather than ones in use.
	allocated func(ctx context.Context) (map[podresources.Key]podresources.Grant, error)
	publish   func(*api.NodeInventory)

	mu        sync.RWMutex
	node      *gpu.Node
	unhealthy map[string]string // GPU or MIG UUID -> reason
	// suspectAll, when set, marks every GPU of the next Refresh unhealthy (health state unreadable).
	suspectAll string
	mdevSlots  map[string]mdevSlot
	changed    chan struct{}
	// inventoryWatchers are told of every rediscovery and health change (WatchInventory).
	inventoryWatchers []chan struct{}
}

// New builds the agent; call Refresh before serving.
func New(cfg Config, backend gpu.Backend, l *ledger.Ledger) *Agent {
	if cfg.Generator != nil && cfg.Generator.Driver != nil && cfg.Generator.Driver.NVML == nil {
		gen, driver := *cfg.Generator, *cfg.Generator.Driver
		driver.NVML = backend.NVML()
		gen.Driver = &driver
		cfg.Generator = &gen
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Health.Log == nil {
		cfg.Health.Log = cfg.Log
	}
	a := &Agent{cfg: cfg, log: cfg.Log, backend: backend, ledger: l, writer: &cdi.Writer{Dir: cfg.CDIDir},
		unhealthy: map[string]string{}, changed: make(chan struct{}, 1)}
	l.OnChange(a.notify)
	a.loadHealth()
	return a
}

// WithAllocated lets the agent ask the kubelet which devices are in use.
func (a *Agent) WithAllocated(fn func(ctx context.Context) (map[podresources.Key]podresources.Grant, error)) {
	a.allocated = fn
}

// WithPublisher is called with the inventory after every refresh (to annotate the Node object).
func (a *Agent) WithPublisher(fn func(*api.NodeInventory)) { a.publish = fn }

// Refresh rediscovers the GPUs, rewrites the CDI specs and tells the device plugins.
func (a *Agent) Refresh(ctx context.Context) error {
	n, err := a.backend.Discover(ctx)
	if err != nil {
		return fmt.Errorf("discover GPUs: %w", err)
	}
	specs, err := a.cfg.Generator.Specs(n)
	if err != nil {
		return err
	}
	if err := a.writer.Sync(specs); err != nil {
		return err
	}
	a.mu.Lock()
	a.node = n
	a.suspectUnknownLocked(n)
	a.mu.Unlock()
	a.log.Info("inventory refreshed", "backend", a.backend.Name(), "gpus", len(n.GPUs), "mdevs", len(n.Mdevs), "cdiDir", a.cfg.CDIDir)
	a.notify()
	a.notifyInventory()
	if a.publish != nil {
		a.publish(a.Inventory())
	}
	return nil
}

// notify wakes the device plugins (coalesced).
func (a *Agent) notify() {
	select {
	case a.changed <- struct{}{}:
	default:
	}
}

// WatchInventory returns a channel that receives (coalesced) after every rediscovery and every
// health change, so that the DRA driver republishes its slices when they may differ rather than
// polling. Ledger changes do not fire it: they change no slice.
func (a *Agent) WatchInventory() <-chan struct{} {
	ch := make(chan struct{}, 1)
	a.mu.Lock()
	a.inventoryWatchers = append(a.inventoryWatchers, ch)
	a.mu.Unlock()
	return ch
}

func (a *Agent) notifyInventory() {
	a.mu.RLock()
	defer a.mu.RUnlock()
	for _, ch := range a.inventoryWatchers {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

// Node is the last discovered node (nil before the first Refresh).
func (a *Agent) Node() *gpu.Node {
	a.mu.RLock()
	defer a.mu.RUnlock()
	return a.node
}

// Inventory is the node's inventory with health applied.
func (a *Agent) Inventory() *api.NodeInventory {
	a.mu.RLock()
	defer a.mu.RUnlock()
	if a.node == nil {
		return &api.NodeInventory{APIVersion: api.Version, Node: a.cfg.NodeName, SharesPerGPU: a.cfg.SharesPerGPU}
	}
	inv := a.node.Inventory(a.cfg.NodeName, a.cfg.SharesPerGPU)
	inv.GPUs = append([]api.GPU(nil), inv.GPUs...)
	for i := range inv.GPUs {
		if _, bad := a.unhealthy[inv.GPUs[i].UUID]; bad {
			inv.GPUs[i].Healthy = false
		}
	}
	return inv
}

// Unhealthy is why each unhealthy GPU or MIG instance (by UUID) is unhealthy: a copy.
func (a *Agent) Unhealthy() map[string]string {
	a.mu.RLock()
	defer a.mu.RUnlock()
	return maps.Clone(a.unhealthy)
}

// Ledger is the agent's ledger.
func (a *Agent) Ledger() *ledger.Ledger { return a.ledger }

// Generator names CDI devices.
func (a *Agent) Generator() *cdi.Generator { return a.cfg.Generator }

// RemoveMdev removes an mdev device and refreshes the specs.
func (a *Agent) RemoveMdev(ctx context.Context, uuid string) error {
	if err := a.backend.RemoveMdev(uuid); err != nil {
		return err
	}
	return a.Refresh(ctx)
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
