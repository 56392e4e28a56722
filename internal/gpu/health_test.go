package gpu

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/apimachinery/pkg/util/wait"
	clocktesting "k8s.io/utils/clock/testing"
)

// healthLog collects health changes.
type healthLog struct {
	mu     sync.Mutex
	events []HealthEvent
}

func (l *healthLog) add(e HealthEvent) { l.mu.Lock(); l.events = append(l.events, e); l.mu.Unlock() }

func (l *healthLog) take() []HealthEvent {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := l.events
	l.events = nil
	return out
}

// deliverNext waits for the event the sim queued on set and hands it to the monitor, as the loop does.
func deliverNext(t *testing.T, m *healthMonitor, set nvml.EventSet) {
	t.Helper()
	e, ret := set.Wait(10000)
	if ret != nvml.SUCCESS {
		t.Fatalf("wait for the injected event: %v", nvml.ErrorString(ret))
	}
	m.handle(e)
}

func newTestMonitor(t *testing.T, description string, opts HealthOptions) (*simBackend, *Node, *healthMonitor, *healthLog, nvml.EventSet) {
	t.Helper()
	b, n := openTestSim(t, description)
	log := &healthLog{}
	m := newHealthMonitor(b.srv, opts, log.add)
	m.check()
	if got := log.take(); len(got) != 0 {
		t.Fatalf("a healthy node reported changes at the first check: %+v", got)
	}
	set, _ := b.srv.EventSetCreate()
	t.Cleanup(func() { set.Free() })
	return b, n, m, log, set
}

func TestHealthEventMaskFromSupportedTypes(t *testing.T) {
	b, n := openTestSim(t, "")
	// GPU 0 runs without ECC: it supports no ECC events, and registering them would register nothing.
	b.SetECC(n.GPUs[0].UUID, false)
	log := &healthLog{}
	m := newHealthMonitor(b.srv, HealthOptions{}, log.add)
	m.check()
	set, _ := b.srv.EventSetCreate()
	defer set.Free()
	m.register(set)
	if got := log.take(); len(got) != 0 {
		t.Fatalf("registration marked GPUs: %+v", got)
	}
	if err := b.InjectXID(n.GPUs[0].UUID, 79); err != nil {
		t.Fatalf("XID on the GPU without ECC: %v (its XID events were not registered)", err)
	}
	deliverNext(t, m, set)
	// A GPU with ECC reports double-bit errors.
	if err := b.InjectEvent(n.GPUs[1].UUID, nvml.EventTypeDoubleBitEccError); err != nil {
		t.Fatal(err)
	}
	deliverNext(t, m, set)
	got := log.take()
	if len(got) != 2 || got[0].UUID != n.GPUs[0].UUID || got[0].Reason != "XID 79" || got[0].XID != 79 ||
		got[1].UUID != n.GPUs[1].UUID || got[1].Reason != "double-bit ECC error" {
		t.Errorf("changes %+v", got)
	}
	// A GPU whose events cannot be read is unhealthy: nobody would hear it fail.
	b.SetLost(n.GPUs[3].UUID, true)
	set2, _ := b.srv.EventSetCreate()
	defer set2.Free()
	m.register(set2)
	if got := log.take(); len(got) != 1 || got[0].UUID != n.GPUs[3].UUID || !strings.Contains(got[0].Reason, "GPU_IS_LOST") {
		t.Errorf("lost GPU at registration: %+v", got)
	}
}

func TestHealthIgnoredXIDs(t *testing.T) {
	for _, c := range []struct {
		name    string
		ignored []uint64
		xid     uint64
		marks   bool
	}{
		{"43 default", nil, 43, false},
		{"13 default", nil, 13, false},
		{"79 default", nil, 79, true},
		{"79 ignored", []uint64{79}, 79, false},
		{"43 not ignored", []uint64{79}, 43, true},
		{"31 none ignored", []uint64{}, 31, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			b, n, m, log, set := newTestMonitor(t, "", HealthOptions{IgnoredXIDs: c.ignored})
			m.register(set)
			if err := b.InjectXID(n.GPUs[2].UUID, c.xid); err != nil {
				t.Fatal(err)
			}
			deliverNext(t, m, set)
			if got := log.take(); (len(got) == 1 && !got[0].Healthy) != c.marks {
				t.Errorf("XID %d with ignored %v: changes %+v", c.xid, c.ignored, got)
			}
		})
	}
}

func TestHealthMIGAttribution(t *testing.T) {
	b, n, m, log, set := newTestMonitor(t, "apiVersion: tessera.dev/v1\nkind: SimulatedNode\ngpus:\n- model: H100-SXM5-80GB\n  count: 2\n  mig: [3g.40gb, 2g.20gb, 1g.10gb+me]\n", HealthOptions{})
	m.register(set)
	gpu1 := n.GPUs[1]
	target, sibling := gpu1.MIG.Instances[1], gpu1.MIG.Instances[0]
	// The driver reports the parent GPU with the instance's GI/CI ids: only that instance is hurt.
	if err := b.InjectXID(target.UUID, 79); err != nil {
		t.Fatal(err)
	}
	deliverNext(t, m, set)
	got := log.take()
	if len(got) != 1 || got[0].UUID != target.UUID || got[0].Healthy {
		t.Fatalf("XID in MIG %s (GI %d, CI %d): changes %+v", target.UUID, target.GPUInstanceID, target.ComputeInstanceID, got)
	}
	if _, bad := m.unhealthy[sibling.UUID]; bad {
		t.Error("the sibling instance was marked too")
	}
	// An XID not attributable to an instance takes the whole GPU.
	if err := b.InjectXID(gpu1.UUID, 79); err != nil {
		t.Fatal(err)
	}
	deliverNext(t, m, set)
	if got := log.take(); len(got) != 1 || got[0].UUID != gpu1.UUID {
		t.Errorf("GPU-wide XID: %+v", got)
	}
	// An XID in an instance this node does not know (GI 9 does not exist) hurts nothing of ours.
	parent, _ := b.srv.DeviceGetHandleByUUID(n.GPUs[0].UUID)
	m.handle(nvml.EventData{Device: parent, EventType: nvml.EventTypeXidCriticalError, EventData: 79, GpuInstanceId: 9, ComputeInstanceId: 0})
	if got := log.take(); len(got) != 0 {
		t.Errorf("XID on an unknown instance: %+v", got)
	}
}

func TestHealthRecovery(t *testing.T) {
	b, n, m, log, set := newTestMonitor(t, "", HealthOptions{})
	m.register(set)
	uuid := n.GPUs[2].UUID
	b.InjectXID(uuid, 79)
	deliverNext(t, m, set)
	log.take()
	// The check right after the XID keeps it out: the XID is news of this interval.
	m.check()
	if got := log.take(); len(got) != 0 {
		t.Fatalf("recovered within the interval of its XID: %+v", got)
	}
	// A GPU that fell off the bus fails the probe and stays out however long it is quiet.
	b.SetLost(uuid, true)
	m.check()
	m.check()
	if got := log.take(); len(got) != 0 {
		t.Fatalf("a lost GPU recovered: %+v", got)
	}
	// Back on the bus: one quiet interval, then the passing probe brings it back.
	b.SetLost(uuid, false)
	m.check()
	if got := log.take(); len(got) != 0 {
		t.Fatalf("recovered without a quiet interval after the last failed probe: %+v", got)
	}
	m.check()
	if got := log.take(); len(got) != 1 || got[0].UUID != uuid || !got[0].Healthy {
		t.Fatalf("no recovery after a quiet interval and a passing probe: %+v", got)
	}
	// The probe alone finds what no event announced: pending row remappings need a reset.
	b.SetRowRemapPending(n.GPUs[4].UUID, true)
	m.check()
	if got := log.take(); len(got) != 1 || got[0].UUID != n.GPUs[4].UUID || !strings.Contains(got[0].Reason, "reset the GPU") {
		t.Errorf("row remapping pending: %+v", got)
	}
}

// TestHealthStartsFromPersistedState: what was unhealthy before a restart stays so until a whole
// quiet interval has passed and its probe succeeds; a fresh probe at start catches the rest.
func TestHealthStartsFromPersistedState(t *testing.T) {
	b, n := openTestSim(t, "")
	b.SetLost(n.GPUs[5].UUID, true)
	log := &healthLog{}
	m := newHealthMonitor(b.srv, HealthOptions{Unhealthy: map[string]string{n.GPUs[3].UUID: "XID 79"}}, log.add)
	m.check()
	got := log.take()
	if len(got) != 1 || got[0].UUID != n.GPUs[5].UUID || got[0].Healthy {
		t.Fatalf("first check after start: %+v (want only GPU 5 marked, GPU 3 kept unhealthy)", got)
	}
	m.check()
	if got := log.take(); len(got) != 1 || got[0].UUID != n.GPUs[3].UUID || !got[0].Healthy {
		t.Fatalf("second check: %+v (want GPU 3 recovered)", got)
	}
}

// TestHealthWaitErrorsDoNotEndTheWatch runs the whole loop: a failed event wait marks every GPU
// unhealthy, the watch goes on (new event set), GPUs recover at the checks, and a later XID is
// still heard.
func TestHealthWaitErrorsDoNotEndTheWatch(t *testing.T) {
	synctest.Test(t, healthWaitErrorsDoNotEndTheWatch)
}

// healthWaitErrorsDoNotEndTheWatch runs in a synctest bubble: the check interval, the backoff
// after the failed wait and the event waits pass on the bubble's clock, at once.
func healthWaitErrorsDoNotEndTheWatch(t *testing.T) {
	b, n := openTestSim(t, "")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	events := make(chan HealthEvent, 256)
	done := make(chan error, 1)
	go func() {
		done <- watchHealth(ctx, b.srv, HealthOptions{CheckInterval: 20 * time.Millisecond}, func(e HealthEvent) { events <- e })
	}()
	// await collects events until every GPU has reached the wanted health.
	await := func(healthy bool, uuids ...string) {
		t.Helper()
		left := map[string]bool{}
		for _, u := range uuids {
			left[u] = true
		}
		for len(left) > 0 {
			select {
			case e := <-events:
				if e.Healthy == healthy {
					delete(left, e.UUID)
				}
			case err := <-done:
				t.Fatalf("the health watch ended: %v", err)
			case <-time.After(time.Minute):
				t.Fatalf("still waiting for healthy=%v of %v", healthy, left)
			}
		}
	}
	var all []string
	for _, g := range n.GPUs {
		all = append(all, g.UUID)
	}
	b.FailNextWait(nvml.ERROR_GPU_IS_LOST)
	await(false, all...)
	await(true, all...)
	// Still watching: an XID after the error is heard (once the new event set is registered).
	err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		err := b.InjectXID(n.GPUs[1].UUID, 79)
		return err == nil, ignoreNotWatched(err)
	})
	if err != nil {
		t.Fatal(err)
	}
	await(false, n.GPUs[1].UUID)
	cancel()
	if err := <-done; err != nil {
		t.Errorf("the watch ended with %v", err)
	}
}

func ignoreNotWatched(err error) error {
	if errors.Is(err, ErrNotWatched) {
		return nil
	}
	return err
}

// TestHealthWatchWaitsAWholeIntervalBeforeRecovery runs the loop on a fake clock: a GPU persisted
// as unhealthy stays so through the start and its first check, and recovers only after ticks.
func TestHealthWatchWaitsAWholeIntervalBeforeRecovery(t *testing.T) {
	synctest.Test(t, healthWatchWaitsAWholeIntervalBeforeRecovery)
}

// healthWatchWaitsAWholeIntervalBeforeRecovery runs in a synctest bubble: the polls and the event
// waits pass on the bubble's clock, at once (the ticks still come from the fake clock).
func healthWatchWaitsAWholeIntervalBeforeRecovery(t *testing.T) {
	b, n := openTestSim(t, "")
	fc := clocktesting.NewFakeClock(time.Now())
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	log := &healthLog{}
	persisted := n.GPUs[3].UUID
	done := make(chan error, 1)
	go func() {
		done <- watchHealth(ctx, b.srv, HealthOptions{Unhealthy: map[string]string{persisted: "XID 79"}, Clock: fc, CheckInterval: time.Minute}, log.add)
	}()
	// Once XIDs are heard the start-up check is over and the event loop runs; the clock has not moved.
	err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		err := b.InjectXID(n.GPUs[1].UUID, 79)
		return err == nil, ignoreNotWatched(err)
	})
	if err != nil {
		t.Fatal(err)
	}
	seen := func(uuid string, healthy bool) bool {
		log.mu.Lock()
		defer log.mu.Unlock()
		for _, e := range log.events {
			if e.UUID == uuid && e.Healthy == healthy {
				return true
			}
		}
		return false
	}
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		return seen(n.GPUs[1].UUID, false), nil
	}); err != nil {
		t.Fatalf("XID not reported: %v", err)
	}
	if seen(persisted, true) {
		t.Fatal("a GPU persisted as unhealthy recovered before any check interval had passed")
	}
	// Ticks: both the persisted GPU and the XID'd one come back.
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		fc.Step(time.Minute)
		return seen(persisted, true) && seen(n.GPUs[1].UUID, true), nil
	}); err != nil {
		t.Fatalf("no recovery after check intervals: %+v", log.take())
	}
	cancel()
	<-done
}

// setCreates records when the health watch creates each NVML event set (on the bubble's clock).
type setCreates struct {
	nvml.Interface
	start time.Time
	mu    sync.Mutex
	at    []time.Duration
}

func (c *setCreates) EventSetCreate() (nvml.EventSet, nvml.Return) {
	c.mu.Lock()
	c.at = append(c.at, time.Since(c.start))
	c.mu.Unlock()
	return c.Interface.EventSetCreate()
}

func (c *setCreates) times() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]time.Duration(nil), c.at...)
}

// TestHealthWaitRetrySchedule pins the event watch's retries on a synctest bubble's clock: the first
// event set at once; after each failed wait a new one 100 ms later, doubling, then at the check
// interval for as long as waits fail (not giving up there); the context's end ends the watch
// within the wait in progress.
func TestHealthWaitRetrySchedule(t *testing.T) { synctest.Test(t, healthWaitRetrySchedule) }

func healthWaitRetrySchedule(t *testing.T) {
	b, _ := openTestSim(t, "")
	lib := &setCreates{Interface: b.srv, start: time.Now()}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for range 5 {
		b.FailNextWait(nvml.ERROR_UNKNOWN) // each event set's first wait fails
	}
	done := make(chan error, 1)
	go func() {
		done <- watchHealth(ctx, lib, HealthOptions{CheckInterval: 500 * time.Millisecond}, func(HealthEvent) {})
	}()
	ms := func(v ...int) []time.Duration {
		var out []time.Duration
		for _, x := range v {
			out = append(out, time.Duration(x)*time.Millisecond)
		}
		return out
	}
	check := func(when string, want []time.Duration) {
		t.Helper()
		synctest.Wait()
		if got := lib.times(); !slices.Equal(got, want) {
			t.Fatalf("%s: event sets created at %v, want %v", when, got, want)
		}
	}
	check("at once", ms(0))
	time.Sleep(99 * time.Millisecond)
	check("99 ms in", ms(0))
	time.Sleep(3 * time.Second)
	// 100, 200, 400, then the 500 ms interval (not 800): 0, 100, 300, 700, 1200, 1700; then waits
	// succeed and the sixth set is kept.
	check("3.1 s in", ms(0, 100, 300, 700, 1200, 1700))
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("the watch ended with %v", err)
		}
	case <-time.After(time.Second): // an event wait's timeout: NVML's wait does not see the context
		t.Fatal("the watch goes on after its context ended")
	}
	check("after the end", ms(0, 100, 300, 700, 1200, 1700))
}
