package memguard

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/prometheus/client_golang/prometheus/testutil"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// The host clocks the publisher reads in these tests: wall - monotonic is fixed. Tests give sample
// times in us after feedWall (sampled adds it), so a sample at t ends at feedMono + t*1000 ns on
// CLOCK_MONOTONIC.
const (
	feedWall = int64(1_800_000_000) * 1e9
	feedMono = int64(5_000) * 1e9
)

// withFeedback turns the publisher on: each holder's measured directory under a temporary
// directory (made for the given holders, as the NRI plugin makes it), fixed host clocks.
func (e *env) withFeedback(holders ...string) string {
	root := e.t.TempDir()
	for _, h := range holders {
		if err := os.MkdirAll(filepath.Join(root, h, api.ComputeMeasuredDir), 0o755); err != nil {
			e.t.Fatal(err)
		}
	}
	e.guard.cfg.Feedback = &FeedbackConfig{Interval: 200e6, File: func(holder string) (string, error) {
		return filepath.Join(root, holder, api.ComputeMeasuredDir, api.ComputeMeasuredFile), nil
	}}
	e.guard.feed.clock = func() (int64, int64) { return feedWall, feedMono }
	e.buffer[gpu0], e.buffer[gpu1] = []nvml.ProcessUtilizationSample{}, []nvml.ProcessUtilizationSample{}
	return root
}

// nspid makes c's pid in its own PID namespace n (its fake /proc status).
func (e *env) nspid(c *child, n int) {
	e.t.Helper()
	status := "Name:\tsleep\nNSpid:\t" + strconv.Itoa(int(c.pid)) + "\t" + strconv.Itoa(n) + "\n"
	if err := os.WriteFile(filepath.Join(e.proc, strconv.Itoa(int(c.pid)), "status"), []byte(status), 0o644); err != nil {
		e.t.Fatal(err)
	}
}

// restart makes c's pid, in the fake /proc, another process's: its start time moves on by d.
func (e *env) restart(c *child, d uint64) uint64 {
	e.t.Helper()
	path := filepath.Join(e.proc, strconv.Itoa(int(c.pid)), "stat")
	stat, err := os.ReadFile(path)
	if err != nil {
		e.t.Fatal(err)
	}
	i := bytes.LastIndexByte(stat, ')')
	f := bytes.Fields(stat[i+1:])
	start, err := strconv.ParseUint(string(f[19]), 10, 64)
	if err != nil {
		e.t.Fatal(err)
	}
	f[19] = []byte(strconv.FormatUint(start+d, 10))
	if err := os.WriteFile(path, append(append(stat[:i+1:i+1], ' '), bytes.Join(f, []byte(" "))...), 0o644); err != nil {
		e.t.Fatal(err)
	}
	return start + d
}

func (e *env) startOf(c *child) uint64 {
	e.t.Helper()
	data, err := os.ReadFile(filepath.Join(e.proc, strconv.Itoa(int(c.pid)), "stat"))
	if err != nil {
		e.t.Fatal(err)
	}
	i := bytes.LastIndexByte(data, ')')
	start, err := strconv.ParseUint(string(bytes.Fields(data[i+1:])[19]), 10, 64)
	if err != nil {
		e.t.Fatal(err)
	}
	return start
}

// sampled puts a sample in the driver's buffer for uuid: c's, at ts us after feedWall, SM utilisation.
func (e *env) sampled(uuid string, c *child, ts uint64, util uint32) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.buffer[uuid] = append(e.buffer[uuid], nvml.ProcessUtilizationSample{Pid: c.pid, TimeStamp: uint64(feedWall/1000) + ts, SmUtil: util})
}

// measured is a holder's file as vcuda would read it (the strict parser); nil when absent.
func measured(t *testing.T, root, holder string) *api.ComputeMeasured {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, holder, api.ComputeMeasuredDir, api.ComputeMeasuredFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	m, err := api.ParseComputeMeasured(data)
	if err != nil {
		t.Fatalf("%s's file does not parse: %v\n%s", holder, err, data)
	}
	return m
}

func line(uuid string, pid, start, busy, tsUS uint64) api.ComputeMeasuredLine {
	return api.ComputeMeasuredLine{UUID: uuid, PID: pid, Start: start, Busy: busy, At: uint64(feedMono) + tsUS*1000}
}

func wantLines(t *testing.T, m *api.ComputeMeasured, want ...api.ComputeMeasuredLine) {
	t.Helper()
	if m == nil {
		t.Fatalf("no file, want lines %+v", want)
	}
	if !slices.Equal(m.Lines, want) {
		t.Errorf("lines\n%+v\nwant\n%+v", m.Lines, want)
	}
}

// TestFeedbackIntegratesDriverBusy: a share container's file names each of its processes by its
// pid in the container and its start time, with busy = the sum of SmUtil/100 x the time since the
// same process's previous sample, half a point added to a whole percent between 0 and 100 (NVML's
// figure read as truncated: PeriodBusyNs) (the first sample a baseline, busy 0), at = the newest sample's end
// on CLOCK_MONOTONIC; a driver's repeat of a sample already taken counts once; another container's
// process on the same GPU is in its own file, never in this one. Mutation: building a file from
// every process on the GPU (not only the holder's) puts B's process in A's file and this fails.
func TestFeedbackIntegratesDriverBusy(t *testing.T) {
	e := newEnv(t, share(ctrA, "pod-a", gpu0, 1024*mib), share(ctrB, "pod-b", gpu0, 1024*mib))
	root := e.withFeedback(ctrA, ctrB)
	a1, a2, b := e.inContainer(ctrA), e.inContainer(ctrA), e.inContainer(ctrB)
	for c, n := range map[*child]int{a1: 7, a2: 8, b: 9} {
		e.uses(gpu0, c, 256*mib)
		e.nspid(c, n)
	}
	e.guard.publishMeasured()
	if m := measured(t, root, ctrA); m != nil {
		t.Fatalf("a file before the guard attributed anything: %+v", m)
	}
	e.samples(1)
	e.sampled(gpu0, a1, 1000, 50)
	e.sampled(gpu0, a2, 1000, 20)
	e.sampled(gpu0, b, 1000, 90)
	e.guard.publishMeasured()
	s1, s2, sb := e.startOf(a1), e.startOf(a2), e.startOf(b)
	wantLines(t, measured(t, root, ctrA), line(gpu0, 7, s1, 0, 1000), line(gpu0, 8, s2, 0, 1000))
	if m := measured(t, root, ctrA); m.Written != uint64(feedMono) {
		t.Errorf("written %d, want the monotonic clock %d", m.Written, feedMono)
	}

	e.sampled(gpu0, a1, 3000, 50)  // 50.5% of 2000 us
	e.sampled(gpu0, a1, 4000, 100) // 100% of 1000 us
	e.sampled(gpu0, a2, 5000, 20)  // 20.5% of 4000 us
	e.sampled(gpu0, b, 2000, 90)   // 90.5% of 1000 us
	e.guard.publishMeasured()
	wantLines(t, measured(t, root, ctrA), line(gpu0, 7, s1, 2_010_000, 4000), line(gpu0, 8, s2, 820_000, 5000))
	wantLines(t, measured(t, root, ctrB), line(gpu0, 9, sb, 905_000, 2000))

	// Nothing new: the files are not rewritten. A process gone from the driver's list (it
	// exited) is forgotten at the guard's next sample.
	writes := testutil.ToFloat64(e.guard.metrics.feedbackWrites)
	e.guard.publishMeasured()
	if got := testutil.ToFloat64(e.guard.metrics.feedbackWrites); got != writes {
		t.Errorf("%v writes without a change", got-writes)
	}
	e.mu.Lock()
	e.procs[gpu0] = slices.DeleteFunc(e.procs[gpu0], func(p nvml.ProcessInfo) bool { return p.Pid == a2.pid })
	e.mu.Unlock()
	e.samples(1)
	e.guard.publishMeasured()
	wantLines(t, measured(t, root, ctrA), line(gpu0, 7, s1, 2_010_000, 4000))
}

// feedOne is a share container A on gpu0 with the publisher on and one process (pid 7 in it),
// attributed by a guard sample.
func feedOne(t *testing.T) (*env, string, *child) {
	e := newEnv(t, share(ctrA, "pod-a", gpu0, 1024*mib))
	root := e.withFeedback(ctrA)
	a := e.inContainer(ctrA)
	e.uses(gpu0, a, 256*mib)
	e.nspid(a, 7)
	e.samples(1)
	return e, root, a
}

// TestFeedbackOwnLastSeen: the publisher and the compute guard each read NVML with a lastSeen of
// their own, so each sees every sample. Mutation: the publisher reading and advancing the guard's
// lastSeen (g.compute.lastSeen) leaves the guard without the samples the publisher took.
func TestFeedbackOwnLastSeen(t *testing.T) {
	e, root, a := feedOne(t)
	e.sampled(gpu0, a, 1000, 40)
	e.sampled(gpu0, a, 2000, 40)
	e.guard.publishMeasured()
	if got := e.guard.processUtilization(gpu0); got[a.pid] != 40 {
		t.Errorf("the guard's utilisation after the publisher read: %v, want pid %d at 40", got, a.pid)
	}
	e.sampled(gpu0, a, 3000, 60)
	if got := e.guard.processUtilization(gpu0); got[a.pid] != 60 {
		t.Errorf("the guard's utilisation: %v, want pid %d at 60", got, a.pid)
	}
	e.guard.publishMeasured()
	// 40.5% of 1000 us + 60.5% of 1000 us.
	wantLines(t, measured(t, root, ctrA), line(gpu0, 7, e.startOf(a), 1_010_000, 3000))
}

// TestFeedbackPIDReuse: a host pid the guard attributed but whose start time changed since (the
// process exited and another took its pid) is not counted for the old process; once the guard
// attributes the new one it starts from a new baseline, its busy count its own. Mutation: without
// the start time check the old line takes the new process's busy time.
func TestFeedbackPIDReuse(t *testing.T) {
	e, root, a := feedOne(t)
	old := e.startOf(a)
	e.sampled(gpu0, a, 1000, 100)
	e.sampled(gpu0, a, 2000, 100)
	e.guard.publishMeasured()
	wantLines(t, measured(t, root, ctrA), line(gpu0, 7, old, 1_000_000, 2000))

	renewed := e.restart(a, 5)
	e.sampled(gpu0, a, 3000, 100) // the new process's, before the guard's next sample
	e.guard.publishMeasured()
	wantLines(t, measured(t, root, ctrA), line(gpu0, 7, old, 1_000_000, 2000))

	e.samples(1) // the guard attributes the new process
	e.sampled(gpu0, a, 4000, 100)
	e.guard.publishMeasured()
	wantLines(t, measured(t, root, ctrA), line(gpu0, 7, renewed, 0, 4000))
	e.sampled(gpu0, a, 4500, 30)
	e.guard.publishMeasured()
	wantLines(t, measured(t, root, ctrA), line(gpu0, 7, renewed, 152_500, 4500))
}

// TestFeedbackFailsClosed: an NVML error (NOT_SUPPORTED, or any other) adds nothing and keeps the
// file; a directory the NRI plugin did not make (a share without vcuda files, or gone) is not
// created; a file that cannot be written is counted and logged, the publisher going on.
func TestFeedbackFailsClosed(t *testing.T) {
	e := newEnv(t, share(ctrA, "pod-a", gpu0, 1024*mib), share(ctrB, "pod-b", gpu1, 1024*mib), share(ctrW, "pod-w", gpu1, 1024*mib))
	root := e.withFeedback(ctrA, ctrB) // no directory for W
	a, b, w := e.inContainer(ctrA), e.inContainer(ctrB), e.inContainer(ctrW)
	e.uses(gpu0, a, 256*mib)
	e.uses(gpu1, b, 256*mib)
	e.uses(gpu1, w, 256*mib)
	for _, c := range []*child{a, b, w} {
		e.nspid(c, 7)
	}
	e.samples(1)
	e.sampled(gpu0, a, 1000, 100)
	e.guard.publishMeasured()
	for _, r := range []nvml.Return{nvml.ERROR_NOT_SUPPORTED, nvml.ERROR_UNKNOWN} {
		e.mu.Lock()
		e.utilRet[gpu0] = r
		e.mu.Unlock()
		e.sampled(gpu0, a, 2000, 100)
		e.guard.publishMeasured()
		wantLines(t, measured(t, root, ctrA), line(gpu0, 7, e.startOf(a), 0, 1000))
	}
	e.mu.Lock()
	delete(e.utilRet, gpu0)
	e.mu.Unlock()
	e.guard.publishMeasured()
	wantLines(t, measured(t, root, ctrA), line(gpu0, 7, e.startOf(a), 1_000_000, 2000))

	if _, err := os.Stat(filepath.Join(root, ctrW)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("W's directory, which the plugin never made: %v", err)
	}
	// B's file cannot be replaced (a directory stands in its place).
	bFile := filepath.Join(root, ctrB, api.ComputeMeasuredDir, api.ComputeMeasuredFile)
	if err := os.Remove(bFile); err != nil {
		t.Fatalf("B's file (no process yet: the header alone): %v", err)
	}
	if err := os.Mkdir(bFile, 0o755); err != nil {
		t.Fatal(err)
	}
	e.sampled(gpu1, b, 1000, 100)
	e.guard.publishMeasured()
	if got := testutil.ToFloat64(e.guard.metrics.feedbackWriteErrors); got != 1 {
		t.Errorf("write errors %v, want 1", got)
	}
}

// TestFeedbackSharedClaimAmbiguous: a shared claim's one file covers every container using it,
// which may be in different PID namespaces: a (GPU, pid, start) two processes claim is left out of
// it, since neither could tell its own figure; the rest are sorted. Mutation: keeping duplicates
// (out = lines) fails it.
func TestFeedbackSharedClaimAmbiguous(t *testing.T) {
	l := func(uuid string, pid, start, busy uint64) api.ComputeMeasuredLine {
		return api.ComputeMeasuredLine{UUID: uuid, PID: pid, Start: start, Busy: busy}
	}
	got := ownLines([]api.ComputeMeasuredLine{l(gpu1, 1, 5, 10), l(gpu0, 7, 9, 1), l(gpu0, 1, 5, 2), l(gpu0, 7, 9, 3), l(gpu0, 7, 8, 4)})
	want := []api.ComputeMeasuredLine{l(gpu0, 1, 5, 2), l(gpu0, 7, 8, 4), l(gpu1, 1, 5, 10)}
	if !slices.Equal(got, want) {
		t.Errorf("lines %+v, want %+v", got, want)
	}
}

// TestFeedbackRunsOnItsTicker: RunFeedback publishes on its own interval of the guard's clock,
// beside the guard's samples (run it with -race), and returns when ctx ends.
func TestFeedbackRunsOnItsTicker(t *testing.T) {
	e, root, a := feedOne(t)
	e.sampled(gpu0, a, 1000, 100)
	e.sampled(gpu0, a, 2000, 50)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.guard.RunFeedback(ctx) }()
	// The deadline only keeps a regression from hanging the suite; it is not what is asserted.
	deadline := time.Now().Add(time.Minute)
	for {
		e.guard.Sample() // the guard's samples meanwhile
		if e.clock.HasWaiters() {
			e.clock.Step(e.guard.cfg.Feedback.Interval)
		}
		if m := measured(t, root, ctrA); m != nil && len(m.Lines) == 1 && m.Lines[0].Busy == 505_000 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("RunFeedback published nothing")
		}
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("RunFeedback returned %v, want context.Canceled", err)
	}
}

// TestPeriodBusyNs: NVML's whole percent read as truncated, half a point added between 0 and 100;
// 0 (a process sampled idle) gains nothing and 100 is the whole period. Mutations: no half point
// (a 10% share measured 5% low and granted that much more by vcuda), the half point at 0 or 100.
func TestPeriodBusyNs(t *testing.T) {
	for _, c := range []struct {
		util uint32
		us   uint64
		want uint64
	}{{0, 1000, 0}, {1, 1000, 15_000}, {10, 200_000, 21_000_000}, {99, 1000, 995_000}, {100, 1000, 1_000_000}, {250, 1000, 1_000_000}} {
		if got := PeriodBusyNs(c.util, c.us); got != c.want {
			t.Errorf("PeriodBusyNs(%d, %d) = %d, want %d", c.util, c.us, got, c.want)
		}
	}
}
