package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/gpu"
	"github.com/tessera-gpu/tessera/internal/hostproc"
	"github.com/tessera-gpu/tessera/internal/memguard"
	"github.com/tessera-gpu/tessera/internal/nri"
)

// The feedback phase (issue 29): what the node agent's measured compute file
// (internal/memguard/feedback.go, api.ComputeMeasured) says of a share container's process whose
// device-busy schedule is known, and the raw NVML samples it is integrated from. The agent
// integrates NVML's per-process SmUtil x (this sample's timestamp - the same process's previous
// sample's) into a cumulative busy; that is right only if the driver's samples of a process come
// back to back. Nothing but a real driver tells whether it does: whether it samples a process that
// is idle (if not, the first sample after an idle gap multiplies its utilisation by the whole gap),
// how its samples are spaced, and whether a second caller with its own lastSeen gets every sample.
// So the probe (slicebench feedback, in a share container) runs busy1 (kernels back to back), an
// idle gap, busy2, a duty-cycled segment, timing its own kernels with events; meanwhile this phase
// reads the host's file every readEvery and asks NVML itself, as two more callers (every readEvery
// and every 5 x readEvery), for the probe's samples, keeping every one.

// fbSegment is one segment of the probe's schedule: host CLOCK_MONOTONIC ns and its own device
// busy (the sum of its kernels' event times).
type fbSegment struct {
	Name             string
	Start, End, Busy int64
	Kernels          int64
}

func (s fbSegment) duty() float64 { return float64(s.Busy) / float64(max(1, s.End-s.Start)) }

// fbPoint is a cumulative busy (ns) at a host CLOCK_MONOTONIC ns.
type fbPoint struct{ At, Busy int64 }

// fbReading is one read of the host's measured compute file: when (mono ns), and the probe's line.
type fbReading struct {
	Read  int64
	Found bool
	Line  api.ComputeMeasuredLine
	Err   string `json:",omitempty"`
}

// rawSample is one NVML sample of the probe's host pid: when it was asked for (mono ns), its
// timestamp (wall-clock us, and converted to mono ns) and SmUtil.
type rawSample struct {
	Call, Mono int64
	TS         uint64
	SmUtil     uint32
}

// rawCaller asks NVML for a GPU's per-process utilisation every interval with a lastSeen of its own,
// keeping every sample of one pid.
type rawCaller struct {
	mu      sync.Mutex
	samples []rawSample
	calls   []int64 // mono ns of each call
	repeats int     // samples not newer than the lastSeen asked with
	errs    map[string]int
	stop    chan struct{}
	done    chan struct{}
}

func startRawCaller(dev nvml.Device, pid uint32, every time.Duration, offset int64) *rawCaller {
	c := &rawCaller{errs: map[string]int{}, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(c.done)
		var lastSeen uint64
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			call := monoNow()
			samples, ret := dev.GetProcessUtilization(lastSeen)
			c.mu.Lock()
			c.calls = append(c.calls, call)
			if ret != nvml.SUCCESS {
				c.errs[nvml.ErrorString(ret)]++ // NOT_FOUND: no sample newer than lastSeen
			}
			asked := lastSeen
			for _, s := range samples {
				if s.TimeStamp <= asked {
					c.repeats++
				}
				lastSeen = max(lastSeen, s.TimeStamp)
				if s.Pid == pid {
					c.samples = append(c.samples, rawSample{Call: call, TS: s.TimeStamp, Mono: int64(s.TimeStamp)*1000 - offset, SmUtil: s.SmUtil})
				}
			}
			c.mu.Unlock()
			select {
			case <-c.stop:
				return
			case <-t.C:
			}
		}
	}()
	return c
}

func (c *rawCaller) finish() {
	close(c.stop)
	<-c.done
}

func monoNow() int64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

// wallMinusMono is CLOCK_REALTIME - CLOCK_MONOTONIC in ns, as the agent measures it (around one
// wall-clock read).
func wallMinusMono() int64 {
	m1 := monoNow()
	w := time.Now().UnixNano()
	m2 := monoNow()
	return w - (m1+m2)/2
}

// integrateRaw is the agent's integration of a process's samples: the first only sets the baseline;
// each later one adds what the agent reads of SmUtil over the time since the previous one
// (memguard.PeriodBusyNs; samples not newer are repeats).
func integrateRaw(samples []rawSample) []fbPoint {
	s := slices.Clone(samples)
	slices.SortStableFunc(s, func(a, b rawSample) int { return int(int64(a.TS) - int64(b.TS)) })
	var out []fbPoint
	var prev uint64
	var busy int64
	for _, x := range s {
		if len(out) > 0 && x.TS <= prev {
			continue
		}
		if len(out) > 0 {
			busy += int64(memguard.PeriodBusyNs(x.SmUtil, x.TS-prev))
		}
		prev = x.TS
		out = append(out, fbPoint{At: x.Mono, Busy: busy})
	}
	return out
}

// filePoints are the file's (at, busy) for the probe's line, each at once.
func filePoints(readings []fbReading) []fbPoint {
	var out []fbPoint
	for _, r := range readings {
		if r.Found && (len(out) == 0 || int64(r.Line.At) > out[len(out)-1].At) {
			out = append(out, fbPoint{At: int64(r.Line.At), Busy: int64(r.Line.Busy)})
		}
	}
	return out
}

// segmentRatio is the busy rate the points show within the segment (between the first and the last
// point whose period ends in it: the periods that began before it are left out) over the probe's
// own rate in it; ok false with fewer than two such points.
func segmentRatio(points []fbPoint, s fbSegment) (ratio float64, n int, ok bool) {
	var in []fbPoint
	for _, p := range points {
		if p.At >= s.Start && p.At <= s.End {
			in = append(in, p)
		}
	}
	if len(in) < 2 || s.Busy <= 0 {
		return 0, len(in), false
	}
	a, b := in[0], in[len(in)-1]
	if b.At <= a.At {
		return 0, len(in), false
	}
	rate := float64(b.Busy-a.Busy) / float64(b.At-a.At)
	return rate / s.duty(), len(in), true
}

// gapGain is the busy the points gained from their last period ending before the idle gap to their
// first ending after it, less what the probe was busy in those spans (at its segments' duty): ~0
// where each sample's period is its own, the gap x some utilisation where a sample after the gap
// carries a rate over the whole gap. inGap counts the points whose period ended in the gap.
func gapGain(points []fbPoint, before, gap, after fbSegment) (gain float64, inGap int, ok bool) {
	var a, b *fbPoint
	for i := range points {
		p := &points[i]
		switch {
		case p.At <= gap.Start:
			a = p
		case p.At < gap.End:
			inGap++
		case b == nil:
			b = p
		}
	}
	if a == nil || b == nil {
		return 0, inGap, false
	}
	truth := before.duty()*float64(max(0, before.End-a.At)) + after.duty()*float64(max(0, b.At-after.Start))
	return float64(b.Busy-a.Busy) - truth, inGap, true
}

// parseFeedbackProbe reads slicebench feedback's output: its segments and its warm line.
func parseFeedbackProbe(out string) (segs map[string]fbSegment, warm map[string]string, done bool) {
	segs = map[string]fbSegment{}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		kv := map[string]string{}
		for _, w := range f[1:] {
			if k, v, ok := strings.Cut(w, "="); ok {
				kv[k] = v
			}
		}
		num := func(k string) int64 { v, _ := strconv.ParseInt(kv[k], 10, 64); return v }
		switch f[0] {
		case "segment":
			segs[kv["name"]] = fbSegment{Name: kv["name"], Start: num("start"), End: num("end"), Busy: num("busy"), Kernels: num("kernels")}
		case "warm":
			warm = kv
		case "done":
			done = true
		}
	}
	return segs, warm, done
}

func runFeedback(args []string) error {
	fs := flag.NewFlagSet("feedback", flag.ContinueOnError)
	o := agentFlags(fs)
	nvmlLib := fs.String("nvml-library", "auto", "the host's libnvidia-ml.so.1 for this phase's own NVML calls (auto: the driver root's); the dry run uses the sim backend of the flags after --")
	kernelMs := fs.Float64("kernel-ms", 5, "the probe's kernel length")
	busyS := fs.Float64("busy-s", 2, "each busy segment's length (busy1, busy2, duty)")
	gapS := fs.Float64("gap-s", 3, "the idle gap's length")
	dutyPct := fs.Float64("duty-pct", 30, "the duty segment's busy percent")
	waitS := fs.Float64("wait-s", 15, "how long the probe waits, busy, for the file to name it")
	publish := fs.Duration("publish", 200*time.Millisecond, "the agent's --compute-guard-feedback-interval")
	readEvery := fs.Duration("read-every", 100*time.Millisecond, "how often the file is read and NVML asked")
	if err := fs.Parse(args); err != nil {
		return err
	}
	start := time.Now()
	p := newPhase("feedback", o.dry)
	const capBytes = 1 << 30
	// Cores 100: the file is what is measured, not vcuda's limiter (which does not throttle at 100%).
	a, err := startAgent(p, o, fs.Args(), "feedback", map[string]shareSpec{"probe": {capBytes, 100}},
		"--memory-guard-interval=500ms", "--compute-guard-feedback-interval="+publish.String())
	if err != nil {
		return err
	}
	if a == nil {
		return finish(p, o.out, start)
	}
	defer a.stop()
	g, id := a.gpu, a.ids["probe"]
	// The file where the agent writes it: the NRI plugin's own layout for the container.
	file, err := nri.New(nri.Config{StateDir: a.runDir()}, nil, nil, nil).MeasuredComputeFile(id)
	if err != nil {
		return err
	}
	p.Env["measured_file"] = file
	mounts, err := shareMounts(filepath.Dir(filepath.Dir(file)), id, g.UUID, capBytes, 100, true)
	if err != nil {
		return err
	}
	// The host's NVML as a third caller beside the agent's guard and publisher.
	var dev nvml.Device
	if o.backend == "sim" {
		b, err := gpu.Open(simOptions(fs.Args()))
		if err != nil {
			return fmt.Errorf("the simulated node's NVML: %w", err)
		}
		defer b.Close()
		if dev, err = deviceByUUID(b.NVML(), g.UUID); err != nil {
			return err
		}
	} else {
		lib, err := openNVML(*nvmlLib)
		if err != nil {
			return err
		}
		defer lib.Shutdown()
		if dev, err = deviceByUUID(lib, g.UUID); err != nil {
			return err
		}
	}
	gen := &cdi.Generator{Vendor: configv1.DefaultCDIVendor}
	env := ""
	if o.dry { // the fake's kernel lasts a wave, whatever the spin kernel's argument
		env = fmt.Sprintf("export FAKE_CUDA_WAVE_NS=%d; ", int64(*kernelMs*1e6))
	}
	cmd := fmt.Sprintf("%sexec slicebench feedback %s/%s %g %g %g %g %g", env, api.ComputeMeasuredDirInContainer, api.ComputeMeasuredFile,
		*kernelMs, *busyS, *gapS, *dutyPct, *waitS)
	p.Env["probe"] = cmd
	c, err := a.runner.start("feedback-probe", []string{gen.Name(cdi.ClassGPU, g.UUID), gen.Name(cdi.ClassShare, cdi.ShareName)}, mounts, cmd, "/tessera-gpuproof/"+id)
	if err != nil {
		p.check("probe: container runs", false, "runc run", "%v", err)
		return finish(p, o.out, start)
	}
	defer c.stop()
	var hostPID int
	_ = wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		hostPID, _ = c.pid()
		return hostPID != 0 || !c.running(), nil
	})
	if hostPID == 0 {
		p.check("probe: container runs", false, "runc state", "no pid: %s", lastLines(c.out.String(), 5))
		return finish(p, o.out, start)
	}
	pstart, err1 := hostproc.Start("/proc", uint32(hostPID))
	status, err2 := hostproc.ReadFile("/proc", uint32(hostPID), "status")
	nspid, err3 := hostproc.NSpid(status)
	if err := first3(err1, err2, err3); err != nil {
		p.check("probe: container runs", false, "/proc of its host pid", "host pid %d: %v", hostPID, err)
		return finish(p, o.out, start)
	}
	offset := wallMinusMono()
	fast := startRawCaller(dev, uint32(hostPID), *readEvery, offset)
	slow := startRawCaller(dev, uint32(hostPID), 5**readEvery, offset)
	var readings []fbReading
	readFile := func() {
		r := fbReading{Read: monoNow()}
		data, err := os.ReadFile(file)
		if err == nil {
			var m *api.ComputeMeasured
			if m, err = api.ParseComputeMeasured(data); err == nil {
				for _, l := range m.Lines {
					if l.UUID == "GPU-"+strings.ToLower(strings.TrimPrefix(g.UUID, "GPU-")) && l.PID == nspid && l.Start == pstart {
						r.Found, r.Line = true, l
					}
				}
			}
		}
		if err != nil && !os.IsNotExist(err) {
			r.Err = err.Error()
		}
		readings = append(readings, r)
	}
	// the schedule and 5 s: within the phase's 40 s limit, so a probe that hangs still leaves results
	limit := time.Duration((*waitS+3**busyS+*gapS+1)*float64(time.Second)) + 5*time.Second
	_ = wait.PollUntilContextTimeout(context.Background(), *readEvery, limit, true, func(context.Context) (bool, error) {
		readFile()
		return !c.running(), nil
	})
	readFile()
	fast.finish()
	slow.finish()
	out := c.stop()
	segs, warm, done := parseFeedbackProbe(out)
	raw, _ := json.MarshalIndent(map[string]any{"segments": segs, "readings": readings,
		"raw_every_read": fast.samples, "raw_every_5_reads": slow.samples, "host_pid": hostPID, "nspid": nspid, "start": pstart}, "", " ")
	_ = os.WriteFile(filepath.Join(a.dir, "feedback-raw.json"), raw, 0o644)
	byProbe := "slicebench feedback in the share container (events around each kernel)"
	names := []string{"busy1", "gap", "busy2", "duty", "tail"}
	ranAll := done
	for _, n := range names {
		_, ok := segs[n]
		ranAll = ranAll && ok
	}
	p.check("probe: ran its schedule", ranAll, byProbe, "segments %v, done %v: %s", slices.Sorted(maps.Keys(segs)), done, lastLines(out, 3))
	p.check("probe: reads its own measured file in the container (read-only mount), naming its pid", warm["named"] == "1", byProbe+" reading "+api.ComputeMeasuredDirInContainer+"/"+api.ComputeMeasuredFile,
		"warm line %v", warm)
	var last *fbReading
	monotonic, badParse := true, ""
	for i := range readings {
		r := &readings[i]
		if r.Err != "" && badParse == "" {
			badParse = r.Err
		}
		if r.Found {
			if last != nil && (r.Line.Busy < last.Line.Busy || r.Line.At < last.Line.At) {
				monotonic = false
			}
			last = r
		}
	}
	byFile := "the host's measured compute file (api.ParseComputeMeasured), read every " + readEvery.String()
	p.check("file: names the probe (its pid in the container, its start time)", last != nil, byFile,
		"host pid %d is pid %d start %d in its container; %d readings, %d name it; parse errors: %s", hostPID, nspid, pstart, len(readings), countFound(readings), first(badParse, "none"))
	p.check("file: busy and at never decrease, every read parses", monotonic && badParse == "", byFile, "monotonic %v, first parse error %q", monotonic, badParse)
	if !ranAll {
		return finish(p, o.out, start)
	}
	fp := filePoints(readings)
	rawPts := integrateRaw(fast.samples)
	bounds := map[string][2]float64{"busy1": {0.8, 1.2}, "busy2": {0.8, 1.2}, "duty": {0.7, 1.3}}
	for _, src := range []struct {
		name, by string
		pts      []fbPoint
	}{{"file", byFile, fp}, {"raw", "this phase's own NVML calls every " + readEvery.String() + ", integrated as the agent does (SmUtil x the time since the previous sample)", rawPts}} {
		for _, n := range []string{"busy1", "busy2", "duty"} {
			s := segs[n]
			ratio, k, ok := segmentRatio(src.pts, s)
			f := Figure{Name: src.name + ": " + n + ": busy / the probe's own", Value: ratio, Unit: "ratio",
				MeasuredBy: fmt.Sprintf("%s, over the probe's events (%.0f%% busy for %.1f s); %d points in the segment", src.by, 100*s.duty(), float64(s.End-s.Start)/1e9, k),
				Goal:       fmt.Sprintf("%.1f..%.1f", bounds[n][0], bounds[n][1])}
			f.Status = passFail(ok && ratio >= bounds[n][0] && ratio <= bounds[n][1])
			p.figure(f)
		}
		gain, inGap, ok := gapGain(src.pts, segs["busy1"], segs["gap"], segs["busy2"])
		gapLen := float64(segs["gap"].End - segs["gap"].Start)
		f := Figure{Name: src.name + ": busy gained across the idle gap, beyond the probe's", Value: gain / 1e6, Unit: "ms",
			MeasuredBy: fmt.Sprintf("%s: from its last period ending before the %.1f s gap to its first ending after, less the probe's busy in those spans; %d periods ended in the gap", src.by, gapLen/1e9, inGap),
			Goal:       fmt.Sprintf("<= %.0f ms (5%% of the gap)", 0.05*gapLen/1e6)}
		f.Status = passFail(ok && gain <= 0.05*gapLen)
		p.figure(f)
		p.figure(Figure{Name: src.name + ": periods ending in the idle gap", Value: float64(inGap), Unit: "count", MeasuredBy: src.by})
	}
	// The file's lag: how old its newest period is when read during busy2, and how long until a
	// period ending after busy1's end is published (across the gap: the wait for the next sample).
	var stale []float64
	for _, r := range readings {
		if r.Found && r.Read >= segs["busy2"].Start && r.Read <= segs["busy2"].End {
			stale = append(stale, float64(r.Read-int64(r.Line.At))/1e6)
		}
	}
	p.figure(Figure{Name: "file: staleness in busy2 (read time - at): median", Value: quantile(stale, 0.5), Unit: "ms", MeasuredBy: byFile + fmt.Sprintf(" (%d reads)", len(stale))})
	p.figure(Figure{Name: "file: staleness in busy2 (read time - at): max", Value: quantile(stale, 1), Unit: "ms", MeasuredBy: byFile})
	covered := -1.0
	for _, r := range readings {
		if r.Found && int64(r.Line.At) >= segs["busy1"].End {
			covered = float64(r.Read-segs["busy1"].End) / 1e6
			break
		}
	}
	p.figure(Figure{Name: "file: busy1's end first covered (a period ending after it read) after", Value: covered, Unit: "ms", MeasuredBy: byFile + "; -1: never"})
	// The raw samples: how many, how spaced, whether the idle gap has any, whether a second caller
	// with its own lastSeen gets them all.
	byRaw := "this phase's own nvmlDeviceGetProcessUtilization(lastSeen) of the probe's host pid every " + readEvery.String()
	var spacing, age []float64
	inGap, zeroInGap := 0, 0
	for i, s := range fast.samples {
		age = append(age, float64(s.Call-s.Mono)/1e6)
		if i > 0 && s.TS > fast.samples[i-1].TS {
			spacing = append(spacing, float64(s.TS-fast.samples[i-1].TS)/1e3)
		}
		if s.Mono > segs["gap"].Start && s.Mono < segs["gap"].End {
			inGap++
			if s.SmUtil == 0 {
				zeroInGap++
			}
		}
	}
	p.check("raw: the driver gives per-process samples of the probe", len(fast.samples) > 0, byRaw, "%d samples, %d calls, errors %v, repeats %d", len(fast.samples), len(fast.calls), fast.errs, fast.repeats)
	for _, f := range []Figure{
		{Name: "raw: samples of the probe", Value: float64(len(fast.samples)), Unit: "count"},
		{Name: "raw: spacing of successive samples: min", Value: quantile(spacing, 0), Unit: "ms"},
		{Name: "raw: spacing of successive samples: median", Value: quantile(spacing, 0.5), Unit: "ms"},
		{Name: "raw: spacing of successive samples: max", Value: quantile(spacing, 1), Unit: "ms"},
		{Name: "raw: samples in the idle gap", Value: float64(inGap), Unit: "count"},
		{Name: "raw: samples in the idle gap with SmUtil 0", Value: float64(zeroInGap), Unit: "count"},
		{Name: "raw: samples not newer than the lastSeen asked with", Value: float64(fast.repeats), Unit: "count"},
		// NVML's timestamps are wall-clock us, as the agent converts them: a sample's age when first
		// returned is then >= 0 and under a call interval plus the driver's own delay
		{Name: "raw: call time - sample timestamp (as wall-clock us): min", Value: quantile(age, 0), Unit: "ms"},
		{Name: "raw: call time - sample timestamp (as wall-clock us): median", Value: quantile(age, 0.5), Unit: "ms"},
		{Name: "raw: call time - sample timestamp (as wall-clock us): max", Value: quantile(age, 1), Unit: "ms"},
	} {
		f.MeasuredBy = byRaw
		p.figure(f)
	}
	got, missing := secondCaller(fast.samples, slow.samples, slow.calls)
	p.figure(Figure{Name: "raw: a second caller (every 5 reads, its own lastSeen) gets the first caller's samples", Value: got, Unit: "ratio",
		MeasuredBy: fmt.Sprintf("the first caller's samples after the second's first call and up to its last, found among the second's (%d missing); 1: each caller gets every sample", missing)})
	p.Env["raw_samples"] = rawString(fast.samples, segs["busy1"].Start)
	p.Env["file_readings"] = readingsString(readings, segs["busy1"].Start)
	p.Env["segments"] = segmentsString(segs, names, segs["busy1"].Start)
	return finish(p, o.out, start)
}

// secondCaller is the share of the first caller's samples (after the second's first call, up to its
// last) the second caller got too, and how many it did not.
func secondCaller(a, b []rawSample, bCalls []int64) (float64, int) {
	if len(bCalls) < 2 {
		return 0, 0
	}
	have := map[uint64]bool{}
	for _, s := range b {
		have[s.TS] = true
	}
	n, missing := 0, 0
	for _, s := range a {
		if s.Call > bCalls[0] && s.Call <= bCalls[len(bCalls)-1] {
			n++
			if !have[s.TS] {
				missing++
			}
		}
	}
	if n == 0 {
		return 0, 0
	}
	return float64(n-missing) / float64(n), missing
}

// The raw data in the results, relative to busy1's start (ms): "<mono>:<SmUtil>" per sample,
// "<read>:<at>:<busy>" per reading naming the probe, "<name>:<start>-<end>:<busy>" per segment.
func rawString(s []rawSample, t0 int64) string {
	var b strings.Builder
	for _, x := range s {
		fmt.Fprintf(&b, "%.1f:%d ", float64(x.Mono-t0)/1e6, x.SmUtil)
	}
	return strings.TrimSpace(b.String())
}

func readingsString(rs []fbReading, t0 int64) string {
	var b strings.Builder
	for _, r := range rs {
		if r.Found {
			fmt.Fprintf(&b, "%.1f:%.1f:%.1f ", float64(r.Read-t0)/1e6, float64(int64(r.Line.At)-t0)/1e6, float64(r.Line.Busy)/1e6)
		}
	}
	return strings.TrimSpace(b.String())
}

func segmentsString(segs map[string]fbSegment, names []string, t0 int64) string {
	var b strings.Builder
	for _, n := range names {
		s := segs[n]
		fmt.Fprintf(&b, "%s:%.1f-%.1f:%.1f ", n, float64(s.Start-t0)/1e6, float64(s.End-t0)/1e6, float64(s.Busy)/1e6)
	}
	return strings.TrimSpace(b.String())
}

func countFound(rs []fbReading) int {
	n := 0
	for _, r := range rs {
		if r.Found {
			n++
		}
	}
	return n
}

func first3(errs ...error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

// simOptions are the sim backend's options from tessera-node's flags (--state-dir, --sim-driver-dir).
func simOptions(flags []string) gpu.Options {
	o := gpu.Options{Backend: "sim"}
	for _, f := range flags {
		if v, ok := strings.CutPrefix(f, "--state-dir="); ok {
			o.StateDir = v
		}
		if v, ok := strings.CutPrefix(f, "--sim-driver-dir="); ok {
			o.SimDriverDir = v
		}
	}
	return o
}

func deviceByUUID(lib nvml.Interface, uuid string) (nvml.Device, error) {
	dev, ret := lib.DeviceGetHandleByUUID(uuid)
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("NVML device %s: %v", uuid, nvml.ErrorString(ret))
	}
	return dev, nil
}
