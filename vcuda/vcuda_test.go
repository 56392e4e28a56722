package vcuda

import (
	"bufio"
	"bytes"
	"context"
	"debug/elf"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"
)

// The C side is built once per test binary into a temporary directory.
var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	for _, d := range []string{buildDir, helperDir} {
		if d != "" {
			os.RemoveAll(d)
		}
	}
	os.Exit(code)
}

// build runs vcuda/Makefile: libvcuda.so, its test-hooks build, the fake
// libcuda.so.1 / libnvidia-ml.so.1, the C test and bench binaries.
func build(tb testing.TB) string {
	tb.Helper()
	buildOnce.Do(func() {
		if buildErr = toolchainErr(exec.LookPath); buildErr != nil {
			return
		}
		dir, err := os.MkdirTemp("", "vcuda-build-")
		if err != nil {
			buildErr = err
			return
		}
		buildDir = dir
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, "make", "-s", "-j2", "BUILD="+dir)
		cmd.WaitDelay = 10 * time.Second
		out, err := cmd.CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("make: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		tb.Fatal(buildErr)
	}
	return buildDir
}

// toolchainErr: a missing toolchain is a broken test machine, not a reason
// to pass, so the suite fails (never skips) without it.
func toolchainErr(lookPath func(string) (string, error)) error {
	for _, tool := range []string{"make", "gcc", "objdump"} {
		if _, err := lookPath(tool); err != nil {
			return fmt.Errorf("%s not found (vcuda's tests need gcc, make, objdump): %v", tool, err)
		}
	}
	return nil
}

func TestMissingToolchainFails(t *testing.T) {
	for _, missing := range []string{"make", "gcc", "objdump"} {
		err := toolchainErr(func(name string) (string, error) {
			if name == missing {
				return "", exec.ErrNotFound
			}
			return "/usr/bin/" + name, nil
		})
		if err == nil || !strings.Contains(err.Error(), missing) {
			t.Errorf("without %s: %v", missing, err)
		}
	}
	if err := toolchainErr(func(name string) (string, error) { return "/usr/bin/" + name, nil }); err != nil {
		t.Errorf("with everything: %v", err)
	}
}

type cCase struct{ name, lib string }

// listCases asks a C test binary (vcuda_tests, harness_selftest) for its cases.
func listCases(t *testing.T, dir, bin string) []cCase {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(dir, bin), "--list")
	cmd.WaitDelay = 5 * time.Second
	cmd.Env = caseEnv(dir, "", t.TempDir())
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s --list: %v", bin, err)
	}
	var cases []cCase
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Split(sc.Text(), "\t")
		if len(f) == 2 {
			cases = append(cases, cCase{f[0], f[1]})
		}
	}
	sort.Slice(cases, func(i, j int) bool { return cases[i].name < cases[j].name })
	return cases
}

// caseEnv is the environment of one C case: the parent's minus anything that
// would steer vcuda or the fake, plus the preload and the fake driver.
func caseEnv(dir, lib, tmp string) []string {
	var env []string
	for _, kv := range os.Environ() {
		k := kv[:strings.IndexByte(kv, '=')+1]
		switch {
		case strings.HasPrefix(k, "TESSERA_VCUDA"), strings.HasPrefix(k, "FAKE_"),
			strings.HasPrefix(k, "VCUDA_TEST"), k == "LD_PRELOAD=", k == "LD_LIBRARY_PATH=",
			k == "CUDA_MODULE_LOADING=": // the fake loads lazily unless a case says otherwise
			continue
		}
		env = append(env, kv)
	}
	// FAKE_CUDA_DEVICES selects the fake's environment mode (two GPUs unless
	// a case says otherwise); cases of its node-file mode unset it.
	env = append(env, "LD_LIBRARY_PATH="+filepath.Join(dir, "fake"), "VCUDA_TEST_TMP="+tmp, "FAKE_CUDA_DEVICES=2",
		// where the test build of vcuda looks for the node agent's file
		"VCUDA_TEST_ETC_LIMITS="+filepath.Join(dir, "etc/tessera/vcuda/limits"))
	switch lib {
	case "vcuda":
		env = append(env, "LD_PRELOAD="+filepath.Join(dir, "libvcuda.so"))
	case "testhooks":
		env = append(env, "LD_PRELOAD="+filepath.Join(dir, "libvcuda-testhooks.so"))
	default:
		if strings.HasPrefix(lib, "mut-") { // a limiter mutant (see Makefile)
			env = append(env, "LD_PRELOAD="+filepath.Join(dir, "libvcuda-"+lib+".so"))
		}
	}
	return env
}

// execCase runs one C case of bin in its own process, with scratch
// directory tmp, for at most timeout (timedOut says it was killed for that).
// extra is appended to the case's environment (a fake driver's knob).
func execCase(dir, bin string, c cCase, tmp string, timeout time.Duration, extra ...string) (out []byte, timedOut bool, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(dir, bin), c.name)
	// A grandchild holding the output pipe must not keep us waiting after
	// the case has ended (children also die with their parent: PDEATHSIG).
	cmd.WaitDelay = 5 * time.Second
	cmd.Env = append(caseEnv(dir, c.lib, tmp), extra...)
	out, err = cmd.CombinedOutput()
	return out, ctx.Err() != nil, err
}

// runCase runs one C case; it returns the case's scratch directory (the
// region file, if any, is left there as tmp/region).
func runCase(t *testing.T, dir string, c cCase) string {
	tmp := t.TempDir()
	out, timedOut, err := execCase(dir, "vcuda_tests", c, tmp, 2*time.Minute)
	if timedOut {
		t.Fatalf("%s timed out\n%s", c.name, out)
	}
	if err != nil {
		t.Fatalf("%s: %v\n%s", c.name, err, out)
	}
	if testing.Verbose() {
		t.Logf("%s", bytes.TrimSpace(out))
	}
	return tmp
}

// runGroup runs, as subtests, the C cases whose names start with prefix;
// after, if given, inspects what a case left behind.
func runGroup(t *testing.T, prefix string, after ...func(t *testing.T, name, tmp string)) {
	dir := build(t)
	n := 0
	for _, c := range listCases(t, dir, "vcuda_tests") {
		if !strings.HasPrefix(c.name, prefix) {
			continue
		}
		n++
		t.Run(strings.TrimPrefix(c.name, prefix), func(t *testing.T) {
			tmp := runCase(t, dir, c)
			for _, f := range after {
				f(t, c.name, tmp)
			}
		})
	}
	if n == 0 {
		t.Fatalf("no C test cases named %s*", prefix)
	}
}

// Every allocation path x {1, 4 processes}: never over the cap, exact OOM,
// frees credited to the allocation's own device.
func TestMemory(t *testing.T) { runGroup(t, "mem_") }

// The limits file: strict parser, fail-closed on a bad file, pass-through
// without one, the mounted file wins over the environment.
func TestLimits(t *testing.T) { runGroup(t, "limits_") }

// cuMemGetInfo, cuDeviceTotalMem and NVML report the cap and the container's
// use; null out-parameters never crash.
func TestInfo(t *testing.T) { runGroup(t, "info_") }

// cuGetProcAddress (v1, v2, per-thread-stream variants), dlsym on a dlopen()ed
// driver, RTLD_NEXT semantics, linked symbols.
func TestProcAddr(t *testing.T) { runGroup(t, "procaddr_") }

// The fake driver's node-file mode: GPUs from the node file, visible where
// their /dev nodes are; NVML per-process accounting; the driver version.
func TestFakeNodeFile(t *testing.T) { runGroup(t, "nodefile_") }

// Where the fake driver mirrors the real one, on the fake alone (no vcuda):
// one row per documented rule (NVML's process-list sizing, ...).
func TestFakeDriver(t *testing.T) { runGroup(t, "fake_") }

// Every allocation path a tenant can use to pass the cap with the driver's real
// semantics (vcuda/README.md's allocation-path table cites these cases): VMM
// memory released while mapped or retained, create/map/release loops, graph
// memory nodes added through cuGraphAddNode and moved child graphs, captures
// ended on the per-thread stream, IPC and shareable-handle imports.
func TestSecurityAllocationPaths(t *testing.T) { runGroup(t, "security_") }

// groupPrefixes are the C case prefixes the tests above run; a case named
// otherwise would never run.
var groupPrefixes = []string{"mem_", "limits_", "info_", "procaddr_", "nodefile_", "fake_", "identity_",
	"harness_", "crash_", "limiter_", "security_", "hooktable_", "ctxoverhead_"}

func TestEveryCaseRuns(t *testing.T) {
	dir := build(t)
	for _, c := range listCases(t, dir, "vcuda_tests") {
		found := false
		for _, p := range groupPrefixes {
			found = found || strings.HasPrefix(c.name, p)
		}
		if !found {
			t.Errorf("C case %s matches no test group (%v): it would never run", c.name, groupPrefixes)
		}
	}
}

// Liveness survives nested PID namespaces and pid reuse (a per-slot OFD
// lock), allocations after the exit handler are refused, and a stopped
// process holding the region lock cannot stall the container.
func TestIdentity(t *testing.T) { runGroup(t, "identity_") }

// The node agent's measured context overhead: charged where above the table, ignored when below
// it, stale, from the future or malformed; and the slot's context record (slot.ctx[], written by
// C) reads in Go as what was charged: two contexts of 700 MiB on GPU record 0, an allocation beside.
func TestContextOverhead(t *testing.T) {
	runGroup(t, "ctxoverhead_", func(t *testing.T, name, tmp string) {
		if name != "ctxoverhead_file_charged" {
			return
		}
		r, err := ReadRegion(filepath.Join(tmp, "region.contexts"))
		if err != nil {
			t.Fatal(err)
		}
		var live []RegionProcess
		for _, p := range r.Processes {
			if len(p.Contexts) > 0 {
				live = append(live, p)
			}
		}
		want := []RegionContexts{{GPU: 0, Count: 2, Charged: 1400 << 20}}
		if len(live) != 1 || !slices.Equal(live[0].Contexts, want) || live[0].Used[0] != 1464<<20 || !live[0].Live || live[0].PIDNS == 0 || live[0].StartTime == 0 {
			t.Fatalf("processes with contexts %+v, want one holding %+v and 1464 MiB", live, want)
		}
	})
}

// The harness fails fast: a forked child dies with its parent.
func TestHarness(t *testing.T) { runGroup(t, "harness_") }

// The harness fails fast the other way round: a child that crashes, fails or
// exits without sending fails its case at once, naming the case, the child
// and its exit status or signal, where the parent used to wait on the pipe
// until runCase's 2-minute timeout. The cases (harness_selftest, never in
// the suite) fail on purpose; each must end well within selfTestTimeout.
func TestHarnessReportsDeadChildren(t *testing.T) {
	const selfTestTimeout = 20 * time.Second
	want := map[string]string{ // case -> what its failure must say
		"selftest_child_crashes":               "child crashes(0), pid ",
		"selftest_child_exits_without_sending": "child says_nothing(0), pid ",
		"selftest_sibling_holds_the_pipe":      "child fails(0), pid ",
		"selftest_child_dies_before_its_file":  "child fails(0), pid ",
		"selftest_passes":                      "",
	}
	how := map[string]string{
		"selftest_child_crashes":               "was killed by signal 11 (Segmentation fault)",
		"selftest_child_exits_without_sending": "exited with status 0 while the parent waited for a message on a pipe (every writer closed it without sending)",
		"selftest_sibling_holds_the_pipe":      "exited with status 3 while the parent waited for a message on a pipe",
		"selftest_child_dies_before_its_file":  "exited with status 3 while the parent waited for ",
	}
	dir := build(t)
	cases := listCases(t, dir, "harness_selftest")
	if len(cases) != len(want) {
		t.Errorf("harness_selftest lists %v; this test knows %d cases", cases, len(want))
	}
	for _, c := range cases {
		t.Run(strings.TrimPrefix(c.name, "selftest_"), func(t *testing.T) {
			w, ok := want[c.name]
			if !ok {
				t.Fatalf("no expectation for %s", c.name)
			}
			out, timedOut, err := execCase(dir, "harness_selftest", c, t.TempDir(), selfTestTimeout)
			switch {
			case timedOut:
				t.Fatalf("still running after %v: the parent did not notice its child\n%s", selfTestTimeout, out)
			case w == "":
				if err != nil {
					t.Fatalf("%v\n%s", err, out)
				}
			case err == nil:
				t.Fatalf("passed\n%s", out)
			case !strings.Contains(string(out), "FAIL case "+c.name+": "+w) || !strings.Contains(string(out), how[c.name]):
				t.Fatalf("failed without naming the case, the child and how it ended (want %q ... %q)\n%s",
					"FAIL case "+c.name+": "+w, how[c.name], out)
			}
			if testing.Verbose() {
				t.Logf("%s", bytes.TrimSpace(out))
			}
		})
	}
}

// SIGKILL inside the driver's allocation, inside vcuda's reservation, inside a
// reclaim, and during concurrent churn: the region stays exact.
func TestCrash(t *testing.T) {
	runGroup(t, "crash_", func(t *testing.T, name, tmp string) {
		r, err := ReadRegion(filepath.Join(tmp, "region"))
		if err != nil {
			t.Fatal(err)
		}
		g := r.GPUs[0]
		if g.Used != 0 || g.Reclaiming || len(r.Processes) != 0 || g.Reclaims == 0 || g.OOMEvents == 0 {
			t.Errorf("region after %s: %+v, %d processes", name, g, len(r.Processes))
		}
	})
}

// The compute limiter holds launch loops (kernels, Ex, cooperative, graphs,
// per-thread-stream variants; one or two processes; 16 to 132 SMs) to their
// percent of the fake device's modelled capacity, within 10%.
// The Go reader (what the node agent exports) sees the throttling in the
// region each case left behind, and nothing still charged.
func TestLimiter(t *testing.T) {
	runGroup(t, "limiter_", func(t *testing.T, name, tmp string) {
		regions := []string{"region"}
		if strings.Contains(name, "two_containers") { // one region per container
			regions = []string{"c0-region", "c1-region"}
		}
		for _, rf := range regions {
			r, err := ReadRegion(filepath.Join(tmp, rf))
			if err != nil {
				t.Fatal(err)
			}
			if len(r.GPUs) != 1 || !strings.HasPrefix(r.GPUs[0].UUID, "GPU-fa4e0000-") {
				t.Fatalf("region gpus %+v", r.GPUs)
			}
			g := r.GPUs[0]
			// Every limited loop runs over its share and is throttled; an unlimited one never is. The
			// launch-bound loop's bound (under 5% of its time) is the C case's own: on a loaded machine a
			// descheduled launcher can look like a device that fell behind, so a little throttling is fair.
			throttled := g.ThrottledNs > 0 && g.ThrottleEvents > 0
			if !strings.Contains(name, "launch_bound") && throttled != (g.Cores < 100) {
				t.Errorf("%s: cores %d%%: throttled %v ns in %d waits", rf, g.Cores, g.ThrottledNs, g.ThrottleEvents)
			}
			// The limiter's charged device time is exported for utilisation.
			if g.Cores < 100 && g.BusyNs == 0 {
				t.Errorf("%s: no busy time exported", rf)
			}
			if g.Used != 0 || len(r.Processes) != 0 {
				t.Errorf("%s: left behind: %d bytes, %d processes", rf, g.Used, len(r.Processes))
			}
		}
	})
}

// The accuracy cases can fail: each limiter mutant (one part broken on
// purpose, built by the Makefile) must fail the case that guards that part.
func TestLimiterMutation(t *testing.T) {
	dir := build(t)
	for _, m := range []struct{ mutant, kase, why string }{
		// Device-time cases (tests_limiter_device.c): what the limiter
		// charges against what the fake device ran, so a loaded machine
		// cannot make a mutant pass (the wall-time cases relax their lower
		// bound for CPU starvation, which let mutants through under load).
		{"nonorm", "limiter_prices_partial_waves", "pricing"},
		{"rate", "limiter_prices_partial_waves", "pricing"},
		{"nosm", "limiter_prices_partial_waves", "pricing"},
		{"nobuckets", "limiter_prices_each_wave_bucket", "pricing"},
		{"asymmetric", "limiter_prices_steady_beside_varying", "estimator"},
		{"nofeedback", "limiter_unbiased_jitter", "biased"},
		{"noloop", "limiter_loop_follows_growing_kernel", "the loop does not follow"},
		{"nooverlap", "limiter_multi_stream_small_grids_30pct", "serialised"},
		{"norelax", "limiter_never_invalidates_a_capture", "invalidated"},
		{"expiredfull", "limiter_settles_an_expired_gate_at_its_kernel", "settled in full"},
		{"nobacklogcap", "limiter_caps_the_backlog_behind_a_held_gate", "behind a held stream"},
		{"dgatestuck", "limiter_device_gate_opens_with_the_launch", "did not open it"},
		{"nowatchdog", "limiter_device_gate_watchdog_opens_a_held_gate", "no watchdog gave up"},
		// The node agent's measured file (src/measured.c).
		{"nomeasured", "limiter_measured_two_containers_graphs_10_90", "the driver's measurement unused"},
		{"measuredpidonly", "limiter_measured_own_line_until_stale", "its own line"},
		{"measurednostale", "limiter_measured_own_line_until_stale", "a stale factor kept"},
	} {
		t.Run(m.mutant+"/"+strings.TrimPrefix(m.kase, "limiter_"), func(t *testing.T) {
			out, timedOut, err := execCase(dir, "vcuda_tests", cCase{m.kase, "mut-" + m.mutant}, t.TempDir(), 2*time.Minute)
			if timedOut {
				t.Fatalf("timed out\n%s", out)
			}
			if err == nil || !strings.Contains(string(out), m.why) {
				t.Errorf("the %s mutant passes %s (err %v): the case cannot catch that regression\n%s",
					m.mutant, m.kase, err, out)
			} else if testing.Verbose() {
				t.Logf("%s", bytes.TrimSpace(out))
			}
		})
	}
}

// The limiter's accuracy on the host-function gate, the fallback where the
// driver has no stream memory operations (the fake's FAKE_CUDA_STREAM_MEMOPS=0):
// the device gate is the default everywhere else in the suite.
func TestLimiterHostGate(t *testing.T) {
	dir := build(t)
	for _, kase := range []string{"limiter_prices_partial_waves", "limiter_unbiased_jitter",
		"limiter_multi_stream_small_grids_30pct", "limiter_grid_mix_30pct"} {
		t.Run(strings.TrimPrefix(kase, "limiter_"), func(t *testing.T) {
			out, timedOut, err := execCase(dir, "vcuda_tests", cCase{kase, "vcuda"}, t.TempDir(), 2*time.Minute,
				"FAKE_CUDA_STREAM_MEMOPS=0")
			if timedOut || err != nil {
				t.Fatalf("%s with the host-function gate (timed out %v): %v\n%s", kase, timedOut, err, out)
			}
			if testing.Verbose() {
				t.Logf("%s", bytes.TrimSpace(out))
			}
		})
	}
}

// The production library reads nothing from the environment but the limits
// path (no test hooks compiled in), and exports only hooks.
func TestLibrarySurface(t *testing.T) {
	dir := build(t)
	lib := filepath.Join(dir, "libvcuda.so")
	f, err := elf.Open(lib)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	syms, err := f.DynamicSymbols()
	if err != nil {
		t.Fatal(err)
	}
	exported := 0
	for _, s := range syms {
		if s.Section == elf.SHN_UNDEF {
			if s.Name == "getenv" {
				t.Errorf("libvcuda.so imports getenv; only secure_getenv of the limits path is allowed")
			}
			continue
		}
		if elf.ST_BIND(s.Info) == elf.STB_LOCAL || s.Name == "" {
			continue
		}
		exported++
		if !strings.HasPrefix(s.Name, "cu") && !strings.HasPrefix(s.Name, "nvml") && s.Name != "dlsym" {
			t.Errorf("libvcuda.so exports %q", s.Name)
		}
	}
	if exported < 40 {
		t.Errorf("only %d exports", exported)
	}
	raw, err := os.ReadFile(lib)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"VCUDA_TEST", "FAKE_CUDA"} {
		if bytes.Contains(raw, []byte(s)) {
			t.Errorf("libvcuda.so mentions %s", s)
		}
	}
	if !bytes.Contains(raw, []byte("TESSERA_VCUDA_LIMITS")) || !bytes.Contains(raw, []byte("/etc/tessera/vcuda/limits")) {
		t.Errorf("libvcuda.so does not name its limits file")
	}
}

// The simulated node's nvidia-smi prints what NVML answers, in the format
// vcuda/README.md documents; with no control device it fails as the real
// one does (exit 9).
func TestFakeNvidiaSMI(t *testing.T) {
	dir := build(t)
	tmp := t.TempDir()
	dev := filepath.Join(tmp, "dev")
	if err := os.Mkdir(dev, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"nvidiactl", "nvidia0", "nvidia3"} {
		if err := os.Symlink("/dev/null", filepath.Join(dev, n)); err != nil {
			t.Fatal(err)
		}
	}
	nodeFile := filepath.Join(tmp, "gpus")
	if err := os.WriteFile(nodeFile, []byte(
		"3 GPU-7063a1b2-0000-4000-8000-000000000003 42949672960 108 8.0 NVIDIA A100-SXM4-40GB\n"+
			"0 GPU-7063a1b2-0000-4000-8000-000000000000 85899345920 132 9.0 NVIDIA H100 80GB HBM3\n"+
			"1 GPU-7063a1b2-0000-4000-8000-000000000001 85899345920 132 9.0 NVIDIA H100 80GB HBM3\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	smiEnv := func(devRoot string, extra []string, args ...string) (string, int) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, filepath.Join(dir, "fake", "nvidia-smi"), args...)
		cmd.WaitDelay = 5 * time.Second
		var env []string
		for _, kv := range caseEnv(dir, "", tmp) {
			if kv != "FAKE_CUDA_DEVICES=2" {
				env = append(env, kv)
			}
		}
		cmd.Env = append(append(env, "FAKE_GPU_NODE_FILE="+nodeFile, "FAKE_DEV_ROOT="+devRoot), extra...)
		out, err := cmd.CombinedOutput()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatalf("nvidia-smi: %v", err)
		}
		return string(out), code
	}
	smi := func(devRoot string, args ...string) (string, int) { return smiEnv(devRoot, nil, args...) }
	out, code := smi(dev, "-L")
	want := "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-7063a1b2-0000-4000-8000-000000000000)\n" +
		"GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-7063a1b2-0000-4000-8000-000000000003)\n"
	if code != 0 || out != want {
		t.Errorf("nvidia-smi -L: exit %d\n%s\nwant\n%s", code, out, want)
	}
	out, code = smi(dev)
	want = "Driver Version: 580.95.05   CUDA Version: 13.0\n" +
		"GPU 0: NVIDIA H100 80GB HBM3\n  uuid: GPU-7063a1b2-0000-4000-8000-000000000000\n" +
		"  memory: 0 MiB / 81920 MiB\n  utilization: 0 %\n  processes:\n    none\n" +
		"GPU 1: NVIDIA A100-SXM4-40GB\n  uuid: GPU-7063a1b2-0000-4000-8000-000000000003\n" +
		"  memory: 0 MiB / 40960 MiB\n  utilization: 0 %\n  processes:\n    none\n"
	if code != 0 || out != want {
		t.Errorf("nvidia-smi: exit %d\n%s\nwant\n%s", code, out, want)
	}
	// Under vcuda (a container with a 10 GiB share of the H100): the cap, and
	// no GPU outside the share.
	limits := filepath.Join(tmp, "limits")
	if err := os.WriteFile(limits, []byte("tessera-vcuda-limits 1\ncontainer smi\nregion "+
		filepath.Join(tmp, "region")+"\ngpu GPU-7063a1b2-0000-4000-8000-000000000000 10737418240 50\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out, code = smiEnv(dev, []string{"LD_PRELOAD=" + filepath.Join(dir, "libvcuda.so"), "TESSERA_VCUDA_LIMITS=" + limits})
	want = "Driver Version: 580.95.05   CUDA Version: 13.0\n" +
		"GPU 0: NVIDIA H100 80GB HBM3\n  uuid: GPU-7063a1b2-0000-4000-8000-000000000000\n" +
		"  memory: 0 MiB / 10240 MiB\n  utilization: 0 %\n  processes:\n    none\n" +
		"GPU 1: NVIDIA A100-SXM4-40GB\n  uuid: GPU-7063a1b2-0000-4000-8000-000000000003\n" +
		"  memory: 0 MiB / 0 MiB\n  utilization: 0 %\n  processes:\n    none\n"
	if code != 0 || out != want {
		t.Errorf("nvidia-smi under vcuda: exit %d\n%s\nwant\n%s", code, out, want)
	}
	if err := os.Remove(filepath.Join(dev, "nvidiactl")); err != nil {
		t.Fatal(err)
	}
	if out, code = smi(dev); code != 9 || !strings.Contains(out, "couldn't communicate with the NVIDIA driver") {
		t.Errorf("without nvidiactl: exit %d\n%s", code, out)
	}
}
