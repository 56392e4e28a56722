package vcuda

import (
	"context"
	"fmt"
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
