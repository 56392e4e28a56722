package gpu

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"sort"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/clock"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
)

// HealthEvent says a GPU (or MIG instance) changed health, and why.
type HealthEvent struct {
	UUID    string
	Healthy bool
	Reason  string
	// XID is the XID that made it unhealthy (0 when the reason is not an XID).
	XID uint64
}

// HealthOptions configure WatchHealth.
type HealthOptions struct {
	// IgnoredXIDs do not make a GPU unhealthy: they are the application's fault, not the GPU's.
	// nil means configv1.DefaultIgnoredXIDs; an empty list ignores none.
	IgnoredXIDs []uint64
	// CheckInterval is how often every GPU is probed (default configv1.DefaultHealthCheckInterval).
	CheckInterval time.Duration
	// Unhealthy is the health the watch starts from (UUID -> reason), e.g. as persisted before a
	// restart. These stay unhealthy until a full quiet interval has passed and a probe succeeds.
	Unhealthy map[string]string
	// Clock ticks the periodic check (nil: the real clock); tests step a fake one.
	Clock clock.WithTicker
	// Log receives the watch's lines (nil: discarded).
	Log *slog.Logger
}

// healthEvents are the events health registers for, each masked by what the GPU supports.
const healthEvents = nvml.EventTypeXidCriticalError | nvml.EventTypeDoubleBitEccError

// healthMonitor turns NVML events and periodic probes into health changes, the way NVIDIA's device
// plugin does (internal/rm/health.go) plus recovery:
//   - events come from one event set over all GPUs, each registered for healthEvents masked by
//     nvmlDeviceGetSupportedEventTypes (a mask with an unsupported type registers nothing at all);
//   - an XID not in the ignored list marks the GPU unhealthy, or only the MIG instance its GI/CI
//     ids name; a double-bit ECC error marks the GPU;
//   - an event-wait error marks every GPU unhealthy, and the watch goes on with a new event set;
//   - every CheckInterval each GPU is probed (its handle, its memory info, no pending or failed row
//     remapping); a failing probe marks it unhealthy, and an unhealthy one becomes healthy again
//     only when no bad news arrived during the last whole interval and the probe passes.
type healthMonitor struct {
	log      *slog.Logger
	lib      nvml.Interface
	ignored  map[uint64]bool
	interval time.Duration
	report   func(HealthEvent)

	mu        sync.Mutex
	gpus      map[string]bool   // GPU UUIDs seen by the last enumeration
	unhealthy map[string]string // GPU or MIG UUID -> reason
	// recent holds UUIDs that had bad news since the last check: they stay unhealthy one more interval.
	recent map[string]bool
}

func newHealthMonitor(lib nvml.Interface, opts HealthOptions, report func(HealthEvent)) *healthMonitor {
	ignored := opts.IgnoredXIDs
	if ignored == nil {
		ignored = configv1.DefaultIgnoredXIDs
	}
	log := opts.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m := &healthMonitor{log: log, lib: lib, ignored: map[uint64]bool{}, interval: opts.CheckInterval, report: report,
		gpus: map[string]bool{}, unhealthy: maps.Clone(opts.Unhealthy), recent: map[string]bool{}}
	if m.interval <= 0 {
		m.interval = configv1.DefaultHealthCheckInterval
	}
	if m.unhealthy == nil {
		m.unhealthy = map[string]string{}
	}
	for _, x := range ignored {
		m.ignored[x] = true
	}
	// What was unhealthy before a restart must prove itself for a whole interval, like fresh news.
	for uuid := range m.unhealthy {
		m.recent[uuid] = true
	}
	return m
}

// watchHealth runs the monitor until ctx ends. Nothing NVML answers ends it: errors become health.
func watchHealth(ctx context.Context, lib nvml.Interface, opts HealthOptions, report func(HealthEvent)) error {
	m := newHealthMonitor(lib, opts, report)
	clk := opts.Clock
	if clk == nil {
		clk = clock.RealClock{}
	}
	// The first probe runs now; the next only a whole interval later (not wait.Until, which would
	// run one straight away and let a GPU persisted as unhealthy skip its quiet interval).
	m.check()
	go func() {
		t := clk.NewTicker(m.interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C():
				m.check()
			}
		}
	}()
	// A failed event set or wait is retried after 100 ms, doubling up to the check interval and
	// staying there (a DelayFunc does not stop at the cap as ExponentialBackoff does).
	backoff := wait.Backoff{Duration: 100 * time.Millisecond, Factor: 2, Cap: m.interval, Steps: 1 << 30}
	_ = backoff.DelayFunc().Until(ctx, true, true, func(ctx context.Context) (bool, error) {
		if err := m.watchEvents(ctx); err != nil {
			m.markAll(err.Error())
		}
		return false, nil
	})
	return nil
}

// watchEvents registers a new event set and handles its events until ctx ends or a wait fails.
func (m *healthMonitor) watchEvents(ctx context.Context) error {
	set, ret := m.lib.EventSetCreate()
	if ret != nvml.SUCCESS {
		return fmt.Errorf("create an NVML event set: %v", nvml.ErrorString(ret))
	}
	defer set.Free()
	m.register(set)
	for ctx.Err() == nil {
		e, ret := set.Wait(1000)
		switch ret {
		case nvml.SUCCESS:
			m.handle(e)
		case nvml.ERROR_TIMEOUT:
		default:
			return fmt.Errorf("NVML event wait failed: %v", nvml.ErrorString(ret))
		}
	}
	return nil
}

// register adds every GPU to set for the health events it supports. A GPU whose events cannot be
// read or registered is unhealthy: nobody would hear it fail.
func (m *healthMonitor) register(set nvml.EventSet) {
	count, ret := m.lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		m.markAll("count GPUs for health events: " + nvml.ErrorString(ret))
		return
	}
	var changes []HealthEvent
	for i := 0; i < count; i++ {
		d, ret := m.lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			m.log.Error("GPU health: no handle", "index", i, "err", nvml.ErrorString(ret))
			continue
		}
		uuid, ret := d.GetUUID()
		if ret != nvml.SUCCESS {
			m.log.Error("GPU health: no UUID", "index", i, "err", nvml.ErrorString(ret))
			continue
		}
		supported, ret := d.GetSupportedEventTypes()
		if ret != nvml.SUCCESS {
			changes = m.markLocked(changes, uuid, "cannot read its supported NVML events: "+nvml.ErrorString(ret), 0)
			continue
		}
		mask := healthEvents & supported
		if mask == 0 {
			m.log.Warn("GPU supports no health events; only the periodic check watches it", "uuid", uuid)
			continue
		}
		switch ret := d.RegisterEvents(mask, set); ret {
		case nvml.SUCCESS:
		case nvml.ERROR_NOT_SUPPORTED:
			m.log.Warn("GPU too old for NVML health events; only the periodic check watches it", "uuid", uuid)
		default:
			changes = m.markLocked(changes, uuid, "cannot register for NVML health events: "+nvml.ErrorString(ret), 0)
		}
	}
	m.emit(changes)
}

// handle turns one NVML event into health changes.
func (m *healthMonitor) handle(e nvml.EventData) {
	var reason string
	var xid uint64
	switch e.EventType {
	case nvml.EventTypeXidCriticalError:
		if m.ignored[e.EventData] {
			m.log.Info("application XID ignored for health", "xid", e.EventData)
			return
		}
		reason, xid = fmt.Sprintf("XID %d", e.EventData), e.EventData
	case nvml.EventTypeDoubleBitEccError:
		reason = "double-bit ECC error"
	default:
		return
	}
	if e.Device == nil {
		m.markAll(reason + " on an unidentified GPU")
		return
	}
	uuid, ret := e.Device.GetUUID()
	if ret != nvml.SUCCESS {
		// As NVIDIA's plugin: an error nobody can place makes every GPU suspect.
		m.markAll(reason + " on a GPU whose UUID NVML cannot read: " + nvml.ErrorString(ret))
		return
	}
	targets := []string{uuid}
	if e.EventType == nvml.EventTypeXidCriticalError && e.GpuInstanceId != noInstance {
		targets = m.migInstances(e.Device, e.GpuInstanceId, e.ComputeInstanceId)
		if len(targets) == 0 {
			// Not an instance this node serves (created outside Tessera since discovery): MIG
			// isolates it from ours, so nothing of ours is hurt.
			m.log.Warn("XID on an unknown MIG instance ignored", "gpu", uuid, "gi", e.GpuInstanceId, "ci", e.ComputeInstanceId, "xid", e.EventData)
			return
		}
	}
	var changes []HealthEvent
	for _, t := range targets {
		changes = m.markLocked(changes, t, reason, xid)
	}
	m.emit(changes)
}

// migInstances are the UUIDs of the MIG devices on parent with GPU instance gi and, unless it is
// noInstance, compute instance ci.
func (m *healthMonitor) migInstances(parent nvml.Device, gi, ci uint32) []string {
	var out []string
	count, ret := parent.GetMaxMigDeviceCount()
	if ret != nvml.SUCCESS {
		return nil
	}
	for i := 0; i < count; i++ {
		mig, ret := parent.GetMigDeviceHandleByIndex(i)
		if ret != nvml.SUCCESS {
			continue
		}
		g, ret1 := mig.GetGpuInstanceId()
		c, ret2 := mig.GetComputeInstanceId()
		uuid, ret3 := mig.GetUUID()
		if ret1 != nvml.SUCCESS || ret2 != nvml.SUCCESS || ret3 != nvml.SUCCESS {
			continue
		}
		if uint32(g) == gi && (ci == noInstance || uint32(c) == ci) {
			out = append(out, uuid)
		}
	}
	return out
}

// check probes every GPU (and every unhealthy MIG instance): failures mark them unhealthy, and
// unhealthy ones that stayed quiet since the last check and pass recover.
func (m *healthMonitor) check() {
	m.enumerate()
	m.mu.Lock()
	uuids := map[string]bool{}
	for u := range m.gpus {
		uuids[u] = true
	}
	for u := range m.unhealthy {
		uuids[u] = true
	}
	m.mu.Unlock()
	results := map[string]error{}
	for u := range uuids {
		results[u] = m.probe(u) // NVML calls outside the lock
	}
	m.mu.Lock()
	var changes []HealthEvent
	for _, u := range sortedUUIDs(uuids) {
		err := results[u]
		_, bad := m.unhealthy[u]
		switch {
		case err != nil && !bad:
			m.unhealthy[u] = err.Error()
			changes = append(changes, HealthEvent{UUID: u, Reason: err.Error()})
		case err != nil:
			m.recent[u] = true
		case bad && m.recent[u]:
			delete(m.recent, u) // quiet from now on: it may recover at the next check
		case bad:
			delete(m.unhealthy, u)
			changes = append(changes, HealthEvent{UUID: u, Healthy: true, Reason: "periodic check passed after a quiet interval"})
		}
	}
	m.mu.Unlock()
	m.emit(changes)
}

// enumerate refreshes the GPU list; a GPU that vanished stays listed, so the probe reports it.
func (m *healthMonitor) enumerate() {
	count, ret := m.lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		m.markAll("count GPUs: " + nvml.ErrorString(ret))
		return
	}
	for i := 0; i < count; i++ {
		d, ret := m.lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			continue
		}
		if uuid, ret := d.GetUUID(); ret == nvml.SUCCESS {
			m.mu.Lock()
			m.gpus[uuid] = true
			m.mu.Unlock()
		}
	}
}

// probe is the cheap health check of one GPU or MIG instance: the driver still finds it, answers a
// memory query, and (full GPUs outside MIG mode) has no pending or failed row remapping, which only
// a reset or service clears.
func (m *healthMonitor) probe(uuid string) error {
	d, ret := m.lib.DeviceGetHandleByUUID(uuid)
	if ret != nvml.SUCCESS {
		return fmt.Errorf("NVML cannot find it: %v", nvml.ErrorString(ret))
	}
	if isMIG, ret := d.IsMigDeviceHandle(); ret == nvml.SUCCESS && isMIG {
		if _, ret := d.GetMemoryInfo(); ret != nvml.SUCCESS {
			return fmt.Errorf("memory query failed: %v", nvml.ErrorString(ret))
		}
		parent, ret := d.GetDeviceHandleFromMigDeviceHandle()
		if ret != nvml.SUCCESS {
			return fmt.Errorf("no parent GPU: %v", nvml.ErrorString(ret))
		}
		d = parent
	}
	if _, ret := d.GetMemoryInfo(); ret != nvml.SUCCESS {
		return fmt.Errorf("memory query failed: %v", nvml.ErrorString(ret))
	}
	_, _, pending, failed, ret := d.GetRemappedRows()
	switch {
	case ret == nvml.ERROR_NOT_SUPPORTED: // pre-Ampere, or MIG mode: no row remapping to read
	case ret != nvml.SUCCESS:
		return fmt.Errorf("row remapping query failed: %v", nvml.ErrorString(ret))
	case failed:
		return fmt.Errorf("a row remapping failed: the GPU needs service")
	case pending:
		return fmt.Errorf("row remappings pending: reset the GPU")
	}
	return nil
}

// markAll marks every known GPU unhealthy.
func (m *healthMonitor) markAll(reason string) {
	m.log.Error("GPU health: marking all GPUs unhealthy", "reason", reason)
	m.mu.Lock()
	uuids := sortedUUIDs(m.gpus)
	m.mu.Unlock()
	var changes []HealthEvent
	for _, u := range uuids {
		changes = m.markLocked(changes, u, reason, 0)
	}
	m.emit(changes)
}

// markLocked records bad news about uuid; it appends a change when the UUID was healthy.
func (m *healthMonitor) markLocked(changes []HealthEvent, uuid, reason string, xid uint64) []HealthEvent {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.recent[uuid] = true
	if _, bad := m.unhealthy[uuid]; bad {
		return changes
	}
	m.unhealthy[uuid] = reason
	return append(changes, HealthEvent{UUID: uuid, Reason: reason, XID: xid})
}

// emit reports changes; never under m.mu, as report takes the agent's locks.
func (m *healthMonitor) emit(changes []HealthEvent) {
	for _, c := range changes {
		m.report(c)
	}
}

func sortedUUIDs(set map[string]bool) []string {
	out := make([]string, 0, len(set))
	for u := range set {
		out = append(out, u)
	}
	sort.Strings(out)
	return out
}
