package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/vcuda"
)

// inflatedNs is how much longer than solo a sample must be to count as inflated by another
// process's slice: well above event jitter, well below any slice a GPU is known to use.
const inflatedNs = 500_000

// hostGateLine is what vcuda logs once a process when its sampling gate is the host function's
// (src/hooks_launch.c, dgate_say_off); the VCUDA_HOST_GATE_ONLY build always says so.
const hostGateLine = "vcuda: sampling gate: host function ("

// sliceStats is what slicebench's samples say about the GPU's time-slicing, all in ns.
type sliceStats struct {
	Solo               float64 // median of A's kernels alone
	P50, P90, Max      float64 // A's kernels beside B
	InflatedFrac       float64 // of A's samples beside B longer than solo + inflatedNs
	Slice              float64 // median inflation of those: B's slice plus the switches out and back
	DelayMin, DelayP50 float64 // A's first kernel of a batch, launch call to its start event, beside B
	DelayMax           float64
	DelaySolo          float64 // the same alone: the launch latency
	Switch             float64 // DelayMin - DelaySolo: an upper bound on one switch's cost
}

// quantile is the q-quantile of v (nearest rank; v need not be sorted); 0 for none.
func quantile(v []float64, q float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	i := int(q * float64(len(s)))
	if i >= len(s) {
		i = len(s) - 1
	}
	return s[i]
}

// sliceFigures reduces A's samples: solo and beside B (elapsed per kernel), and the first kernel's
// start delay per batch, alone and beside B. An inflated sample is the time the GPU gave B while
// A's kernel was between its events, which is what vcuda's limiter charges A for when it samples it.
func sliceFigures(solo, beside, delaySolo, delayBeside []float64) sliceStats {
	st := sliceStats{Solo: quantile(solo, 0.5), P50: quantile(beside, 0.5), P90: quantile(beside, 0.9), Max: quantile(beside, 1),
		DelayMin: quantile(delayBeside, 0), DelayP50: quantile(delayBeside, 0.5), DelayMax: quantile(delayBeside, 1),
		DelaySolo: quantile(delaySolo, 0.5)}
	var infl []float64
	for _, e := range beside {
		if e-st.Solo > inflatedNs {
			infl = append(infl, e-st.Solo)
		}
	}
	if len(beside) > 0 {
		st.InflatedFrac = float64(len(infl)) / float64(len(beside))
	}
	st.Slice = quantile(infl, 0.5)
	st.Switch = max(st.DelayMin-st.DelaySolo, 0)
	return st
}

// benchOut is one slicebench run's output: its words and its lists.
type benchOut struct {
	kv     map[string]string
	lists  map[string][]float64
	stderr string
}

func parseBench(stdout, stderr string) (benchOut, error) {
	b := benchOut{kv: map[string]string{}, lists: map[string][]float64{}, stderr: stderr}
	for _, line := range strings.Split(stdout, "\n") {
		for k, v := range words(line) {
			if k != "elapsed_ns" && k != "delay_ns" {
				b.kv[k] = v
				continue
			}
			for _, f := range strings.Split(v, ",") {
				x, err := strconv.ParseFloat(f, 64)
				if err != nil {
					return b, fmt.Errorf("slicebench printed %s=%q: %w", k, v, err)
				}
				b.lists[k] = append(b.lists[k], x)
			}
		}
	}
	if e := b.kv["error"]; e != "" {
		return b, fmt.Errorf("slicebench: error %s during %s", e, b.kv["during"])
	}
	return b, nil
}

func slicebench(env []string, bench string, args ...string) (benchOut, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bench, args...)
	cmd.Env, cmd.WaitDelay = env, 5*time.Second
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return benchOut{}, fmt.Errorf("slicebench %s: %w: %s%s", strings.Join(args, " "), err, lastLines(stdout.String(), 3), lastLines(stderr.String(), 5))
	}
	return parseBench(stdout.String(), stderr.String())
}

// startBusy starts process B and returns once its first kernel ran.
func startBusy(env []string, bench string, kernelMs, seconds float64) (*exec.Cmd, error) {
	cmd := exec.Command(bench, "busy", fmt.Sprint(kernelMs), fmt.Sprint(seconds))
	cmd.Env = env
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	pipe, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("slicebench busy: %w", err)
	}
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(pipe)
		for sc.Scan() {
			select {
			case ready <- sc.Text():
			default:
			}
		}
	}()
	select {
	case line := <-ready:
		if strings.HasPrefix(line, "busy") {
			return cmd, nil
		}
		stopBusy(cmd)
		return nil, fmt.Errorf("slicebench busy printed %q: %s", line, lastLines(stderr.String(), 5))
	case <-time.After(30 * time.Second):
		stopBusy(cmd)
		return nil, errors.New("slicebench busy: its first kernel did not finish in 30 s")
	}
}

func stopBusy(cmd *exec.Cmd) {
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
}

// runTimeslice measures how the GPU time-slices two processes (no MPS) with slicebench, and what
// that does to vcuda's samples, with each of vcuda's sampling gates (issue 29).
func runTimeslice(args []string) error {
	fs := flag.NewFlagSet("timeslice", flag.ContinueOnError)
	bench := fs.String("slicebench", "slicebench", "slicebench binary")
	lib := fs.String("vcuda-library", "", "libvcuda.so (required)")
	hostLib := fs.String("vcuda-hostgate", "", "libvcuda.so built with VCUDA_HOST_GATE_ONLY (required)")
	fake := fs.String("fake-dir", "", "the fake driver's folder (with -dry-run)")
	work := fs.String("work", "", "folder for the limits files, regions and the fake's shared state (required)")
	out := fs.String("out", "", "phase result file (required)")
	dry := fs.Bool("dry-run", false, "no GPU: the fake driver, its timeslice scheduler shared by the two processes")
	busyMs := fs.Float64("busy-ms", 20, "process B's kernel length")
	targetUs := fs.Float64("target-us", 1000, "process A's kernel length alone")
	batches := fs.Int("batches", 30, "process A's batches beside B (each after a 5 ms idle)")
	per := fs.Int("per", 10, "kernels per batch")
	cores := fs.Int("cores", 50, "vcuda's compute cap for A in the gate runs")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *lib == "" || *hostLib == "" || *work == "" || *out == "" || (*dry && *fake == "") {
		return errors.New("-vcuda-library, -vcuda-hostgate, -work and -out are required (and -fake-dir with -dry-run)")
	}
	if _, err := os.Stat(api.LimitsPathInContainer); err == nil {
		return fmt.Errorf("%s exists on this machine: vcuda would read it instead of the probe's limits", api.LimitsPathInContainer)
	}
	if err := os.MkdirAll(*work, 0o755); err != nil {
		return err
	}
	start := time.Now()
	p := newPhase("timeslice", *dry)
	// A and B as two processes on one GPU; on the fake they share its scheduler (FAKE_CUDA_SHM) and
	// each kernel lasts a wave: A's well under the fake's 2 ms slice, B's 20 ms.
	envA, envB := cleanEnv(nil), cleanEnv(nil)
	method := "slicebench (CUDA driver API, PTX kernels: A a fixed FMA chain, B a %globaltimer spin), events around each of A's kernels"
	if *dry {
		shm := filepath.Join(*work, "fake-shm")
		_ = os.Remove(shm)
		common := []string{"LD_LIBRARY_PATH=" + *fake, "FAKE_CUDA_DEVICES=1", "FAKE_CUDA_SHM=" + shm}
		envA = cleanEnv(append(slices.Clone(common), "FAKE_CUDA_WAVE_NS=300000"))
		envB = cleanEnv(append(slices.Clone(common), fmt.Sprintf("FAKE_CUDA_WAVE_NS=%d", int64(*busyMs*1e6))))
		method += " (fake driver: its timeslice scheduler, kernels of FAKE_CUDA_WAVE_NS a wave)"
	}
	figure := func(name string, v float64, unit, by string) {
		p.figure(Figure{Name: name, Value: v, Unit: unit, MeasuredBy: by})
	}
	solo, err := slicebench(envA, *bench, "solo", fmt.Sprint(*targetUs), "30")
	if err == nil && len(solo.lists["elapsed_ns"]) == 0 {
		err = errors.New("slicebench solo printed no samples")
	}
	if err != nil {
		p.check("slicebench runs", false, "slicebench solo", "%v", err)
		return finish(p, *out, start)
	}
	p.Env["slicebench_kernel"], p.Env["slicebench_work"] = solo.kv["kernel"], solo.kv["work"]
	alone, err := slicebench(envA, *bench, "run", solo.kv["work"], "10", "1")
	if err != nil {
		p.check("slicebench runs", false, "slicebench run, alone", "%v", err)
		return finish(p, *out, start)
	}
	b, err := startBusy(envB, *bench, *busyMs, 60)
	if err != nil {
		p.check("process B keeps the GPU busy", false, "slicebench busy", "%v", err)
		return finish(p, *out, start)
	}
	defer stopBusy(b)
	beside, err := slicebench(envA, *bench, "run", solo.kv["work"], fmt.Sprint(*batches), fmt.Sprint(*per))
	if err != nil {
		p.check("slicebench runs", false, "slicebench run, beside B", "%v", err)
		return finish(p, *out, start)
	}
	p.check("slicebench runs", true, "slicebench", "A alone and beside B (%g ms kernels back to back), %d samples", *busyMs, len(beside.lists["elapsed_ns"]))
	st := sliceFigures(solo.lists["elapsed_ns"], beside.lists["elapsed_ns"], alone.lists["delay_ns"], beside.lists["delay_ns"])
	by := fmt.Sprintf("%s; B: %g ms kernels back to back; A: %d batches of %d kernels, each batch after a 5 ms idle", method, *busyMs, *batches, *per)
	figure("A's kernel alone (p50)", st.Solo/1e6, "ms", method+", 30 kernels one at a time, no other process")
	figure("A's kernel beside B: p50", st.P50/1e6, "ms", by)
	figure("A's kernel beside B: p90", st.P90/1e6, "ms", by)
	figure("A's kernel beside B: max", st.Max/1e6, "ms", by)
	figure("A's samples inflated by > 0.5 ms beside B", 100*st.InflatedFrac, "%", by+": elapsed - solo > 0.5 ms")
	figure("implied timeslice (median inflation)", st.Slice/1e6, "ms", by+": median of elapsed - solo over the inflated samples (B's slice plus the switches out and back)")
	if st.InflatedFrac == 0 {
		p.skip("implied timeslice", by, "no sample of A was inflated by > 0.5 ms beside B: the GPU did not preempt A's kernels for B's (or B did not run)")
	}
	figure("A's first-kernel start delay beside B: min", st.DelayMin/1e6, "ms", by+": host time from the launch call to its start event, polled")
	figure("A's first-kernel start delay beside B: p50", st.DelayP50/1e6, "ms", by+": host time from the launch call to its start event, polled")
	figure("A's first-kernel start delay beside B: max", st.DelayMax/1e6, "ms", by+": host time from the launch call to its start event, polled")
	figure("implied switch cost (upper bound)", st.Switch/1e6, "ms", by+": min start delay beside B - p50 start delay alone (10 batches)")

	// What vcuda charges A beside B, with each sampling gate: the limiter's busy_ns (the region)
	// against A's own device time (kernels x solo), and which gate each build used (its log).
	uuid := solo.kv["uuid"]
	for _, v := range []struct{ name, lib, want string }{{"device gate", *lib, "device"}, {"host gate", *hostLib, "host"}} {
		dir := filepath.Join(*work, strings.ReplaceAll(v.name, " ", "-"))
		limits, err := writeLimits(dir, uuid, 8<<30, *cores)
		if err != nil {
			return err
		}
		_ = os.Remove(filepath.Join(dir, "region"))
		n := 10 * *per
		got, err := slicebench(append(slices.Clone(envA), "LD_PRELOAD="+v.lib, api.LimitsEnv+"="+limits), *bench, "run", solo.kv["work"], "10", fmt.Sprint(*per))
		if err != nil {
			p.check("vcuda, "+v.name+": A runs beside B", false, "slicebench run under vcuda", "%v", err)
			continue
		}
		gate := "device"
		if i := strings.Index(got.stderr, hostGateLine); i >= 0 {
			gate = "host: " + strings.SplitN(got.stderr[i+len(hostGateLine):], ")", 2)[0]
		}
		p.Env["vcuda_gate_"+v.want+"_build"] = gate
		p.check(fmt.Sprintf("vcuda, %s build: the sampling gate it used", v.name), strings.HasPrefix(gate, v.want), "vcuda's log (stderr): "+hostGateLine+"...) or none",
			"%s (want %s)", gate, v.want)
		reg, err := vcuda.ReadRegion(filepath.Join(dir, "region"))
		if err != nil || len(reg.GPUs) == 0 {
			p.check("vcuda, "+v.name+": region readable", false, "vcuda.ReadRegion", "%v", err)
			continue
		}
		own := float64(n) * st.Solo
		figure(fmt.Sprintf("vcuda at %d%%, %s, beside B: charged / A's own device time", *cores, v.name), float64(reg.GPUs[0].BusyNs)/own, "x",
			fmt.Sprintf("the region's busy_ns (the limiter's charge) / (%d kernels x A's solo p50); %s", n, by))
	}
	return finish(p, *out, start)
}

// runRegion prints the compute limiter's charge (busy_ns) of a vcuda region's first GPU record,
// for torch_checks.py: one reader of the region's layout (vcuda.ReadRegion).
func runRegion(args []string) error {
	fs := flag.NewFlagSet("region", flag.ContinueOnError)
	path := fs.String("path", "", "the region file (required)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *path == "" {
		return errors.New("-path is required")
	}
	reg, err := vcuda.ReadRegion(*path)
	if err != nil {
		return err
	}
	if len(reg.GPUs) == 0 {
		return fmt.Errorf("%s: no GPU record", *path)
	}
	fmt.Println(reg.GPUs[0].BusyNs)
	return nil
}
