package memguard

import (
	"strconv"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// computeShare is a share capped at cores percent of uuid (and 1 GiB of memory, never reached here).
func computeShare(id, pod, uuid string, cores int) ledger.Entry {
	e := share(id, pod, uuid, 1024*mib)
	e.Devices[0].CoresPercent = cores
	return e
}

// withCompute turns the compute guard on: an 8 s window, 2 s of grace, 15 points of tolerance.
func (e *env) withCompute(kill bool) *env {
	e.guard.cfg.Compute = &ComputeConfig{Window: 8e9, Grace: 2e9, TolerancePercent: 15, Kill: kill}
	return e
}

// runs sets the SM utilisation the driver samples for c's process on uuid (0: not sampled).
func (e *env) runs(uuid string, c *child, util uint32) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.util[uuid] == nil {
		e.util[uuid] = map[uint32]uint32{}
	}
	if util == 0 {
		delete(e.util[uuid], c.pid)
		return
	}
	e.util[uuid][c.pid] = util
}

func (e *env) computeKills() float64 {
	return testutil.ToFloat64(e.guard.metrics.computeViolations.WithLabelValues("Kill"))
}

// TestSecurityComputeCapKill: a share whose measured SM utilisation, averaged over the window, stays
// over its cap plus tolerance for the grace has its GPU processes killed, with a Warning Event and
// the counter. The tenant lifted vcuda's limiter (its credit is in the container-writable region):
// only the driver's per-process sampling on the host shows it. Mutation: with enforceCompute's kill
// removed (checkCompute never calls it) the child lives and this fails.
func TestSecurityComputeCapKill(t *testing.T) {
	e := newEnv(t, computeShare(ctrA, "pod-a", gpu0, 30)).withCompute(true)
	c := e.inContainer(ctrA)
	e.uses(gpu0, c, 512*mib)
	e.runs(gpu0, c, 95)
	// Samples at 1..8 s fill the window (first measured at 1 s: judged from 9 s); over from 9 s;
	// the grace of 2 s ends at 11 s.
	for range 10 {
		e.samples(1)
		c.alive(t)
	}
	e.samples(1)
	c.killed(t)
	if got := e.computeKills(); got != 1 {
		t.Errorf("tessera_compute_cap_violations_total{action=Kill} = %v, want 1", got)
	}
	if e.kills() != 0 {
		t.Errorf("the memory kill counter moved (%v): the memory cap was not passed", e.kills())
	}
	ev := e.eventsWith(ReasonComputeCapExceeded)
	if len(ev) != 1 {
		t.Fatalf("events %v, want one %s", ev, ReasonComputeCapExceeded)
	}
	for _, want := range []string{"Warning", `"main"`, "95%", "compute cap of 30%", "GPU 0 (" + gpu0 + ")", strconv.Itoa(int(c.pid))} {
		if !strings.Contains(ev[0], want) {
			t.Errorf("event %q does not say %q", ev[0], want)
		}
	}
}

// TestComputeCapWithinToleranceAndBursts: a share at its cap plus less than the tolerance is never
// acted on however long; a burst above it (a long kernel vcuda cannot split) shorter than the
// window's average can carry is not either; a share with no compute cap (0) or a whole GPU is not
// judged. Mutation: comparing each sample instead of the window's average (avg := util) kills the
// bursting child and this fails; dropping the tolerance (limit := cores) kills the first.
func TestComputeCapWithinToleranceAndBursts(t *testing.T) {
	uncapped := share(ctrW, "pod-w", gpu1, 1024*mib) // memory only
	e := newEnv(t, computeShare(ctrA, "pod-a", gpu0, 30), computeShare(ctrB, "pod-b", gpu1, 40), uncapped).withCompute(true)
	a, b, w := e.inContainer(ctrA), e.inContainer(ctrB), e.inContainer(ctrW)
	for _, p := range []struct {
		uuid string
		c    *child
	}{{gpu0, a}, {gpu1, b}, {gpu1, w}} {
		e.uses(p.uuid, p.c, 256*mib)
	}
	e.runs(gpu0, a, 44)  // 30 + 14 points: within
	e.runs(gpu1, w, 100) // no compute cap
	for i := range 30 {
		// b: 20% with a 3 s burst at 100% every 10 s: over its limit (55) for longer than the
		// grace sample by sample, while the 8 s window's average peaks at 50.
		if i%10 < 3 {
			e.runs(gpu1, b, 100)
		} else {
			e.runs(gpu1, b, 20)
		}
		e.samples(1)
	}
	a.alive(t)
	b.alive(t)
	w.alive(t)
	if e.computeKills() != 0 || len(e.eventsWith(ReasonComputeCapExceeded)) != 0 {
		t.Errorf("kills %v: shares within their caps on average must be left alone", e.computeKills())
	}
	reg := prometheus.NewRegistry()
	if err := reg.Register(e.guard.metrics); err != nil {
		t.Fatal(err)
	}
	metrics, err := testutil.GatherAndCount(reg, "tessera_container_gpu_sm_utilization_percent")
	if err != nil || metrics != 2 {
		t.Errorf("sm utilisation series = %d (%v), want one per compute-capped share (2)", metrics, err)
	}
}

// TestComputeCapEventAction: with action Event the share is reported once per run over its cap and
// nothing is killed.
func TestComputeCapEventAction(t *testing.T) {
	e := newEnv(t, computeShare(ctrA, "pod-a", gpu0, 20)).withCompute(false)
	c := e.inContainer(ctrA)
	e.uses(gpu0, c, 256*mib)
	e.runs(gpu0, c, 90)
	e.samples(20)
	c.alive(t)
	if ev := e.eventsWith(ReasonComputeCapExceeded); len(ev) != 1 || !strings.Contains(ev[0], "nothing was killed") {
		t.Fatalf("events %v, want one saying nothing was killed", ev)
	}
	if got := testutil.ToFloat64(e.guard.metrics.computeViolations.WithLabelValues("Event")); got != 1 {
		t.Errorf("violations{action=Event} = %v, want 1", got)
	}
}

// TestComputeCapMissingDataNeverCounts: samples the driver cannot give (NOT_SUPPORTED on a driver
// or GPU without per-process accounting, a failing call) count nothing towards the grace and are
// counted as errors; a process list that fails does too. Mutation: keeping a cap's window and its
// run over the cap across a sample without data (no forget, in checkCompute's two places) kills
// the child.
func TestComputeCapMissingDataNeverCounts(t *testing.T) {
	e := newEnv(t, computeShare(ctrA, "pod-a", gpu0, 30)).withCompute(true)
	c := e.inContainer(ctrA)
	e.uses(gpu0, c, 256*mib)
	e.runs(gpu0, c, 95)
	for round := range 4 {
		e.samples(10) // a full window and 1 s into the grace
		e.mu.Lock()
		if round%2 == 0 {
			e.utilRet[gpu0] = nvml.ERROR_NOT_SUPPORTED
		} else {
			e.fail[gpu0] = nvml.ERROR_UNKNOWN
		}
		e.mu.Unlock()
		e.samples(1)
		e.mu.Lock()
		delete(e.utilRet, gpu0)
		delete(e.fail, gpu0)
		e.mu.Unlock()
	}
	c.alive(t)
	if got := testutil.ToFloat64(e.guard.metrics.utilErrors.WithLabelValues(gpu0)); got != 2 {
		t.Errorf("compute guard NVML errors = %v, want 2", got)
	}
}

// TestComputeCapSharedClaim: a shared claim's compute cap is one cap over all its containers: two
// containers at 25% each on a claim capped at 30% are over it together, and both lose their GPU
// processes.
func TestComputeCapSharedClaim(t *testing.T) {
	claim := ledger.Entry{ContainerID: ledger.ClaimID("c1"), PodUID: "uid-pod-a", Namespace: "team", Pod: "pod-a", Container: "resourceclaim/shared",
		Claim:   &ledger.Claim{UID: "c1", Namespace: "team", Name: "shared", PodUIDs: []string{"uid-pod-a", "uid-pod-b"}},
		Devices: []api.DeviceAssignment{{UUID: gpu0, MemoryBytes: 4096 * mib, CoresPercent: 30}}}
	a := ledger.Entry{ContainerID: ctrA, PodUID: "uid-pod-a", Namespace: "team", Pod: "pod-a", Container: "main", Claims: []string{"c1"}}
	b := ledger.Entry{ContainerID: ctrB, PodUID: "uid-pod-b", Namespace: "team", Pod: "pod-b", Container: "main", Claims: []string{"c1"}}
	e := newEnv(t, claim, a, b).withCompute(true)
	ca, cb := e.inContainer(ctrA), e.inContainer(ctrB)
	for _, c := range []*child{ca, cb} {
		e.uses(gpu0, c, 256*mib)
		e.runs(gpu0, c, 25)
	}
	e.samples(11)
	ca.killed(t)
	cb.killed(t)
	if got := e.computeKills(); got != 2 {
		t.Errorf("violations{action=Kill} = %v, want 2 (one per container)", got)
	}
}
