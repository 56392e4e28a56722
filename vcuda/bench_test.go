package vcuda

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// runBench runs the C bench binary once and returns its ns per operation
// (best of five rounds). lib: "" (the fake driver, called directly) or
// "vcuda" (preloaded). cores: "" for no limits file (vcuda passes through),
// else the compute percent written into the limits file.
func runBench(b *testing.B, mode, lib, cores string, iters int) float64 {
	b.Helper()
	dir := build(b)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(dir, "vcuda_bench"), mode, strconv.Itoa(iters))
	cmd.WaitDelay = 5 * time.Second
	cmd.Env = append(caseEnv(dir, lib, b.TempDir()),
		// launches cost ~nothing on the fake device, so the limiter never
		// has to wait: this measures the under-the-cap path
		"FAKE_CUDA_WAVE_NS=1")
	if cores != "" {
		cmd.Env = append(cmd.Env, "BENCH_LIMITS="+cores)
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		b.Fatalf("vcuda_bench %s: %v\n%s", mode, err, out)
	}
	var ns float64
	if _, err := fmt.Sscanf(strings.TrimSpace(string(out)), "ns_per_op %g", &ns); err != nil {
		b.Fatalf("vcuda_bench output %q: %v", out, err)
	}
	return ns
}

// benchPair reports the fake driver called directly, the same calls through
// vcuda, and the difference per intercepted call. Timing is reported, never
// asserted (goal: <= 50 ns added under the cap).
func benchPair(b *testing.B, mode, cores string, callsPerOp float64) {
	iters := b.N
	if iters < 200000 {
		iters = 200000
	}
	direct := runBench(b, mode, "", "", iters) / callsPerOp
	hooked := runBench(b, mode, "vcuda", cores, iters) / callsPerOp
	b.ReportMetric(direct, "direct-ns/call")
	b.ReportMetric(hooked, "vcuda-ns/call")
	b.ReportMetric(hooked-direct, "added-ns/call")
}

// cuMemAlloc_v2 + cuMemFree_v2 of 4 KiB, under the cap: reservation (CAS in
// the shared region), handle table insert/remove, device lookup.
func BenchmarkMemAllocFree(b *testing.B) { benchPair(b, "alloc", "100", 2) }

// cuLaunchKernel with the container at 100% compute: the limiter is off.
func BenchmarkLaunchKernel(b *testing.B) { benchPair(b, "launch", "100", 1) }

// cuLaunchKernel with the limiter on (50%) but under its budget: clock read,
// estimate lookup, virtual-time update, one sampled launch in 64.
func BenchmarkLaunchKernelLimited(b *testing.B) { benchPair(b, "launch", "50", 1) }

// BenchmarkVcudaGrid runs the compute limiter's grid on the fake device
// (vcuda_grid: workloads x caps {10..90} x mixes {alone, 30+70, 10+30+60},
// 3 s a cell, each after the same cell uncapped for its ceiling) and
// prints one "vcuda-grid ..." line a cell. Reported, never asserted: the
// accuracy cases (tests_limiter_device.c, tests_launch.c) are the
// assertions. VCUDA_GRID_MS shortens or lengthens a cell. Two counts: cells
// within 10% of the cap (error_pct), and within 10% of what the cell is
// expected to reach (expected_err_pct: alone, min(cap, the workload's
// ceiling measured beside it), since a cap is a ceiling, not a guarantee;
// in a mix, the cap).
func BenchmarkVcudaGrid(b *testing.B) {
	dir := build(b)
	ms := os.Getenv("VCUDA_GRID_MS")
	if ms == "" {
		ms = "3000"
	}
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(dir, "vcuda_grid"), "grid", ms)
	cmd.WaitDelay = 5 * time.Second
	cmd.Env = caseEnv(dir, "vcuda", b.TempDir())
	out, err := cmd.Output()
	if err != nil {
		b.Fatalf("vcuda_grid: %v\n%s", err, out)
	}
	cells, within, withinExp, worst := 0, 0, 0, 0.0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		fmt.Println(line)
		got := 0
		for _, f := range strings.Fields(line) {
			k, v, ok := strings.Cut(f, "=")
			if !ok || (k != "error_pct" && k != "expected_err_pct") {
				continue
			}
			e, err := strconv.ParseFloat(v, 64)
			if err != nil {
				b.Fatalf("vcuda_grid line %q: %v", line, err)
			}
			got++
			in := e >= -10 && e <= 10
			if k == "expected_err_pct" {
				if in {
					withinExp++
				}
				continue
			}
			cells++
			if in {
				within++
			}
			if e < 0 {
				e = -e
			}
			if e > worst {
				worst = e
			}
		}
		if got != 2 {
			b.Fatalf("vcuda_grid line %q: want error_pct and expected_err_pct", line)
		}
	}
	if cells != 8*5*3 {
		b.Fatalf("vcuda_grid printed %d cells, want 120", cells)
	}
	fmt.Printf("vcuda-grid-summary within_10pct_of_cap=%d within_10pct_of_expected=%d cells=%d\n", within, withinExp, cells)
	b.ReportMetric(float64(within), "cells-within-10pct")
	b.ReportMetric(float64(withinExp), "cells-within-10pct-of-expected")
	b.ReportMetric(worst, "worst-abs-error-pct")
}

// BenchmarkVcudaLaunchOverhead: the launch path at 100% (the limiter off),
// the fake driver alone and under vcuda: the median ns a launch (31 rounds)
// and a launch-heavy loop's launches a second.
func BenchmarkVcudaLaunchOverhead(b *testing.B) {
	dir := build(b)
	run := func(lib string) (ns, rate float64) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, filepath.Join(dir, "vcuda_grid"), "overhead", "20000")
		cmd.WaitDelay = 5 * time.Second
		cmd.Env = append(caseEnv(dir, lib, b.TempDir()), "FAKE_CUDA_WAVE_NS=1")
		out, err := cmd.Output()
		if err != nil {
			b.Fatalf("vcuda_grid overhead: %v\n%s", err, out)
		}
		for _, f := range strings.Fields(string(out)) {
			if v, ok := strings.CutPrefix(f, "median_ns_per_launch="); ok {
				ns, _ = strconv.ParseFloat(v, 64)
			}
			if v, ok := strings.CutPrefix(f, "tiny_launches_per_s="); ok {
				rate, _ = strconv.ParseFloat(v, 64)
			}
		}
		if ns == 0 || rate == 0 {
			b.Fatalf("vcuda_grid overhead printed %q", out)
		}
		return ns, rate
	}
	dNs, dRate := run("")
	vNs, vRate := run("vcuda")
	fmt.Printf("vcuda-overhead added_median_ns_per_launch=%.1f tiny_throughput_loss_pct=%.1f\n", vNs-dNs, (dRate-vRate)/dRate*100)
	b.ReportMetric(vNs-dNs, "added-median-ns/launch")
	b.ReportMetric((dRate-vRate)/dRate*100, "tiny-loop-loss-pct")
}
