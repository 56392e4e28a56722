// Package gpu holds the real-GPU proof's scripts (run.sh, torch_checks.py, gpuproof) and the dry
// run that keeps them working where there is no GPU.
package gpu

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"
	"time"
)

func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// run runs a command with a deadline and returns its combined output and exit code.
func run(t *testing.T, timeout time.Duration, env []string, dir, name string, args ...string) (string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir, cmd.Env, cmd.WaitDelay = dir, append(os.Environ(), env...), 5*time.Second
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if ctx.Err() != nil {
		t.Fatalf("%s %v: timed out after %v\n%s", name, args, timeout, out.String())
	}
	if ee, ok := err.(*exec.ExitError); ok {
		return out.String(), ee.ExitCode()
	}
	if err != nil {
		t.Fatalf("%s %v: %v\n%s", name, args, err, out.String())
	}
	return out.String(), 0
}

// vmmNotYet are the memory phase's VMM checks allowed to fail, with why. Empty: vcuda and the fake
// driver keep VMM memory charged while mapped, so every VMM check must pass.
var vmmNotYet = map[string]string{}

// TestGPUBundleDryRun builds the GPU bundle as `make gpu-bundle` does and runs the one command the
// device tool runs on a GPU machine, test/gpu/device-run.sh, on the simulated node with vcuda's
// fake driver: the preflight (which container runtime works), discovery and CDI specs, the realnvml
// test built, CUDA in containers made only from the CDI edits (whole GPU and a vcuda share), the
// memory phase (per-context overhead read from the host's NVML by host pid, the VMM patterns under
// a cap), cuGetProcAddress against dlsym for every hooked symbol, the guard phase (tessera-node's
// memory guard kills a share allocating past vcuda, leaves one under its cap), the feedback phase
// (the agent's measured compute file against a probe's known busy schedule, and the raw NVML
// samples under it, held to the sim's exact figures), the call overhead on
// the fake driver; then the one results file, the one log tarball and both markdown tables; then
// the container phase again on the namespace fallback (what runs where runc cannot). The PyTorch
// phases cannot run here and must say so in the results; torch_checks.py is compiled and its
// helpers self-tested. Needs root (runc, device nodes, namespaces), go, gcc, make, python3, unshare
// and `make tools`' busybox and glibc: a missing one fails the test.
func TestGPUBundleDryRun(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("the dry run needs root: runc and the simulated node's device nodes")
	}
	for _, tool := range []string{"go", "gcc", "make", "python3", "tar", "objdump", "unshare", "nsenter", "timeout"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is required: %v", tool, err)
		}
	}
	root, dir := repoRoot(), t.TempDir()
	tarball := filepath.Join(dir, "bundle.tar.gz")
	if out, rc := run(t, 10*time.Minute, nil, root, "bash", "test/gpu/bundle.sh", tarball); rc != 0 {
		t.Fatalf("bundle.sh: exit %d\n%s", rc, out)
	}
	st, err := os.Stat(tarball)
	if err != nil {
		t.Fatal(err)
	}
	// The device tool carries at most 64 MiB with the checkout.
	if st.Size() > 56<<20 {
		t.Errorf("the bundle is %d MiB; it must stay well under the device tool's 64 MiB", st.Size()>>20)
	}
	// The one command, as the device tool runs it: $OUT is what comes back.
	runDir, ret := filepath.Join(dir, "run"), filepath.Join(dir, "returned")
	env := []string{"DRY_RUN=1", "GPU_BUNDLE=" + tarball, "GPU_RUN_DIR=" + runDir, "OUT=" + ret}
	out, rc := run(t, 9*time.Minute, env, root, "bash", "test/gpu/device-run.sh")
	t.Logf("device-run.sh:\n%s", out)
	// exit 2: torch and compute could not run (no GPU); every other phase must have passed
	if rc != 2 {
		t.Errorf("device-run.sh: exit %d, want 2 (torch and compute cannot run in a dry run)", rc)
	}
	order := regexp.MustCompile(`(?m)^\[device-run\] (\w+): exit (\d+) after`).FindAllStringSubmatch(out, -1)
	var ran []string
	for _, m := range order {
		ran = append(ran, m[1])
		want := "0"
		if m[1] == "torch" || m[1] == "compute" {
			want = "2"
		}
		if m[2] != want {
			t.Errorf("phase %s: exit %s, want %s", m[1], m[2], want)
		}
	}
	if got := strings.Join(ran, " "); got != "preflight node refusals container torch memory procaddr guard feedback overhead timeslice compute" {
		t.Errorf("phases ran in the order %q: want the issue's order, most important first", got)
	}
	returned, _ := os.ReadDir(ret)
	var names []string
	for _, e := range returned {
		names = append(names, e.Name())
	}
	if len(names) != 2 || !strings.HasSuffix(names[0], "-NVIDIA-A100-SXM4-40GB.json") || names[1] != "logs.tar.gz" {
		t.Fatalf("$OUT holds %v: want one results JSON and logs.tar.gz", names)
	}
	logs, _ := run(t, time.Minute, nil, ret, "tar", "tzf", "logs.tar.gz")
	for _, want := range []string{"device-run.log", "nvidia-smi.txt", "partial/procaddr.json", "work/guard/tessera-node.log", "work/containers/share/output.txt",
		"work/feedback/tessera-node.log", "work/feedback/feedback-raw.json", "work/feedback/containers/feedback-probe/output.txt"} {
		if !strings.Contains(logs, want+"\n") {
			t.Errorf("logs.tar.gz lacks %s:\n%s", want, logs)
		}
	}
	b := filepath.Join(runDir, "tessera-gpu-bundle")
	files := []string{filepath.Join(ret, names[0])}
	var res struct {
		DryRun  bool     `json:"dry_run"`
		Driver  string   `json:"driver_version"`
		CUDA    string   `json:"cuda_driver_version"`
		Failed  int      `json:"failed"`
		Missing []string `json:"phases_missing"`
		Phases  []struct {
			Phase   string `json:"phase"`
			Checks  []struct{ Name, Status, Detail string }
			Figures []struct {
				Name, Status string
				Value        float64
				MeasuredBy   string `json:"measured_by"`
			}
		}
	}
	data, err := os.ReadFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &res); err != nil {
		t.Fatal(err)
	}
	if !res.DryRun || res.Failed != len(vmmNotYet) || res.Driver != "580.95.05" || res.CUDA != "13.0" || len(res.Missing) != 0 {
		t.Errorf("results: dry_run=%v failed=%d (want %d) driver=%q cuda=%q missing=%v\n%s", res.DryRun, res.Failed, len(vmmNotYet), res.Driver, res.CUDA, res.Missing, data)
	}
	passed := map[string]bool{}
	checks := map[string]string{} // name -> status: detail
	figures := map[string]string{}
	values := map[string]float64{}
	for _, p := range res.Phases {
		for _, c := range p.Checks {
			passed[p.Phase+": "+c.Name] = c.Status == "pass"
			checks[p.Phase+": "+c.Name] = c.Status + ": " + c.Detail
		}
		for _, f := range p.Figures {
			figures[p.Phase+": "+f.Name] = f.MeasuredBy
			values[p.Phase+": "+f.Name] = f.Value
			passed[p.Phase+": "+f.Name] = f.Status == "pass"
		}
	}
	want := []string{
		"preflight: runc starts a container", "preflight: fallback starts a container", "preflight: a container runtime works",
		"refusals: the realnvml test is built",
		"procaddr: queries asked", "procaddr: every driver answer is vcuda's hook of the same variant, as dlsym names it",
		"node: specs load", "node: specs mount libcuda.so", "node: specs mount nvidia-smi", "node: GPU count",
		"container: whole: nvidia-smi -L lists exactly that GPU", "container: whole: CUDA sees all its memory",
		"container: share: ld.so.preload names vcuda", "container: share: CUDA reports the cap",
		"container: share: OOM at the cap", "container: share: nvidia-smi shows the cap",
		// the context overhead where a pod's processes live: NVML lists them by host pid
		"memory: context overhead: NVML lists the container's process by host pid",
		"memory: context overhead: NVIDIA A100-SXM4-40GB (cc 8.0): vcuda's table is right",
		// the agent kills the share past vcuda, from NVML's per-process memory, and only it
		"guard: agent runs with the memory guard", "guard: bypass: killed (SIGKILL)",
		"guard: bypass: the agent logs the kill (GPUMemoryCapExceeded without an API server)",
		"guard: the agent counts one kill", "guard: polite: the agent measures it", "guard: polite: under its cap, left alone",
		// the agent's measured compute file names the probe's process as its container knows it, and
		// the container reads it through its read-only mount
		"feedback: agent runs with the memory guard", "feedback: probe: ran its schedule",
		"feedback: probe: reads its own measured file in the container (read-only mount), naming its pid",
		"feedback: file: names the probe (its pid in the container, its start time)", "feedback: file: busy and at never decrease, every read parses",
		"feedback: raw: the driver gives per-process samples of the probe",
		// each vcuda build says which sampling gate it used: the production one the device's, the
		// VCUDA_HOST_GATE_ONLY one the host function's
		"timeslice: slicebench runs", "timeslice: vcuda, device gate build: the sampling gate it used",
		"timeslice: vcuda, host gate build: the sampling gate it used",
	}
	if len(vmmNotYet) == 0 {
		for _, pattern := range []string{"pool", "loop"} {
			want = append(want, "memory: vmm "+pattern+": OOM at the cap", "memory: vmm "+pattern+": the unmap gives the memory back",
				"memory: vmm "+pattern+": most host NVML showed")
		}
	}
	for _, name := range want {
		if !passed[name] {
			t.Errorf("check %q did not pass (or is missing): %s", name, checks[name])
		}
	}
	for name, why := range vmmNotYet {
		if c := checks[name]; !strings.HasPrefix(c, "fail: ") || !strings.Contains(c, why) {
			t.Errorf("check %q: %q, want a failure saying %q (passing now? then empty vmmNotYet)", name, c, why)
		}
	}
	for _, phase := range []string{"torch", "compute"} {
		if c := checks[phase+": "+phase+": not run"]; !strings.HasPrefix(c, "not_checked: ") || !strings.Contains(c, "needs a GPU") {
			t.Errorf("the results must say the %s phase did not run, and why: %q", phase, c)
		}
	}
	// the compute phase's cases are each listed as not run (issue 32): the elementwise mix and the
	// CUDA-graph decode loop at each share, and the model in two shares, never missing
	for _, name := range []string{"elementwise at 10%: busy share", "elementwise at 70%: busy share", "decode-graph at 10%: busy share",
		"matmul, two containers, host gate: the 30% one's busy share", "matmul, two containers, host gate: the 70% one's busy share",
		"decode-graph at 10% beside a 70% matmul co-tenant, device gate: busy share", "decode-graph at 10% beside a 70% matmul co-tenant, host gate: busy share",
		"decode-graph at 10% beside a 70% matmul co-tenant, device gate: charged / its own GPU time",
		"decode-graph at 10% beside a 70% matmul co-tenant, host gate: charged / its own GPU time",
		"decode-graph at 30%: busy share", "decode-graph at 70%: busy share", "model: alone, no vcuda: tokens_per_s",
		"model: 40% memory / 30% compute: tokens_per_s", "model: 40% memory / 70% compute: tokens_per_s",
		"model: 40% memory / 30% compute: host NVML peak within the memory cap", "model: 40% memory / 70% compute: host NVML peak within the memory cap",
		"model: tokens_per_s ratio, 70% / 30% compute"} {
		if c := checks["compute: "+name]; !strings.HasPrefix(c, "not_checked: ") || !strings.Contains(c, "needs a GPU") {
			t.Errorf("compute case %q: %q, want not_checked with the reason (a dry run lists every case it could not run)", name, c)
		}
	}
	// The time-slicing probe on the fake's scheduler (2 ms slices, 2 us switches): A's kernels (0.3 ms
	// alone) preempted by B's slice measure it; the implied slice must be the fake's own, which
	// tests the probe's arithmetic (the solo time, or a p90 of all samples, would not be).
	ts := func(name string) float64 { return values["timeslice: "+name] }
	if s := ts("implied timeslice (median inflation)"); s < 1.5 || s > 3 {
		t.Errorf("timeslice: implied slice %.3f ms on the fake, want its 2 ms (1.5-3 ms)", s)
	}
	if solo := ts("A's kernel alone (p50)"); solo < 0.2 || solo > 0.5 {
		t.Errorf("timeslice: A's solo kernel %.3f ms, want the fake's 0.3 ms wave", solo)
	}
	if f := ts("A's samples inflated by > 0.5 ms beside B"); f <= 0 || f >= 100 {
		t.Errorf("timeslice: %.1f%% of A's samples inflated beside B: want some, not all", f)
	}
	// The start delay is polled from the host, so its upper end is the machine's load (5.3 ms once
	// in CI beside the e2e clusters), not the fake's slice: only that A waited at all is held.
	if d := ts("A's first-kernel start delay beside B: max"); d < 0.2 {
		t.Errorf("timeslice: A's longest start delay beside B %.3f ms, want A to have waited for B's slice", d)
	}
	for _, gate := range []string{"device gate", "host gate"} {
		name := "timeslice: vcuda at 50%, " + gate + ", beside B: charged / A's own device time"
		if v, ok := values[name]; !ok || v <= 0 || !strings.Contains(figures[name], "busy_ns") {
			t.Errorf("figure %q: %v (%q), want the region's charge over A's own time", name, v, figures[name])
		}
	}
	// The measured compute file against the probe's own events, on the simulated driver (whose samples
	// each cover the time since the process's previous one, exactly what the agent integrates): each
	// busy segment's ratio within 5%, the duty segment's within 10%, and the idle gap (1.5 s) adds
	// under 50 ms either way; the raw samples, integrated as the agent does, agree. A driver double
	// that stamped an after-gap sample with a short window's utilisation, or an agent counting a
	// gap's time as busy, fails the gap bound; a file that names the host pid, or none, fails the
	// checks above.
	fbv := func(name string) float64 { return values["feedback: "+name] }
	for _, src := range []string{"file", "raw"} {
		for seg, tol := range map[string]float64{"busy1": 0.05, "busy2": 0.05, "duty": 0.1} {
			if r := fbv(src + ": " + seg + ": busy / the probe's own"); r < 1-tol || r > 1+tol {
				t.Errorf("feedback: %s %s: busy ratio %.3f on the sim, want 1 +- %.2f", src, seg, r, tol)
			}
		}
		name := src + ": busy gained across the idle gap, beyond the probe's"
		if g, ok := values["feedback: "+name]; !ok || g < -50 || g > 50 {
			t.Errorf("feedback: %s: %.1f ms (present %v), want |gain| < 50 ms on the sim", name, g, ok)
		}
	}
	// the sim samples only a process that ran (no sample in the gap), every caller gets every sample
	if n, gap, second := fbv("raw: samples of the probe"), fbv("raw: samples in the idle gap"), fbv("raw: a second caller (every 5 reads, its own lastSeen) gets the first caller's samples"); n < 10 || gap != 0 || second != 1 {
		t.Errorf("feedback: raw samples %v, %v in the gap, second caller got %v of them: want >= 10, 0, 1", n, gap, second)
	}
	// its timestamps are wall-clock us of the period's end, as the agent converts them: never after the call
	if lo, med := fbv("raw: call time - sample timestamp (as wall-clock us): min"), fbv("raw: call time - sample timestamp (as wall-clock us): median"); lo < -2 || med > 1000 {
		t.Errorf("feedback: a sample's age when returned: min %.1f ms, median %.1f ms: want >= 0 (2 ms slack) and well under a second", lo, med)
	}
	if c := checks["refusals: the strict NVML's refusal table matches the real driver"]; !strings.HasPrefix(c, "not_checked: ") {
		t.Errorf("a dry run must not claim the refusal table was held to a real driver: %q", c)
	}
	for _, want := range []string{"overhead: fake driver: alloc, added by vcuda at 100% compute", "overhead: fake driver: launch, added by vcuda at 100% compute"} {
		if !strings.Contains(figures[want], "fake driver") {
			t.Errorf("figure %q missing or not labelled with the fake driver: %q", want, figures[want])
		}
	}
	for section, wants := range map[string][]string{
		"node": {"| share: OOM at the cap | pass |", "| bypass: killed (SIGKILL) | pass |"},
		"vcuda": {"| `cuLaunchKernel` (empty kernel, 1 block) | added by vcuda, container at 100% compute | not measured | ",
			"| context overhead: NVIDIA A100-SXM4-40GB (cc 8.0): vcuda's table is right | pass |", "| torch: not run | not_checked |"},
	} {
		out, rc := run(t, time.Minute, nil, b, "bin/gpuproof", "tables", "-section", section, files[0])
		for _, want := range wants {
			if rc != 0 || !strings.HasPrefix(out, "**DRY RUN") || !strings.Contains(out, want) {
				t.Errorf("tables -section %s: exit %d, want the dry-run banner and %q:\n%s", section, rc, want, out)
			}
		}
	}
	// The namespace fallback (where runc cannot run): the same container phase, the same specs.
	fenv := []string{"DRY_RUN=1", "OUT=" + filepath.Join(runDir, "out"), "CONTAINER_RUNTIME=fallback"}
	if out, rc := run(t, 2*time.Minute, fenv, b, "./run.sh", "preflight"); rc != 0 || !strings.Contains(out, "using fallback") {
		t.Errorf("run.sh preflight with CONTAINER_RUNTIME=fallback: exit %d\n%s", rc, out)
	}
	for _, phase := range []string{"container", "guard"} { // the guard: cgroups, kills, exit 137 through the fallback
		if out, rc := run(t, 2*time.Minute, fenv, b, "./run.sh", phase); rc != 0 {
			t.Errorf("run.sh %s on the namespace fallback: exit %d\n%s", phase, rc, out)
		}
	}
	var fb struct {
		Env    map[string]string
		Checks []struct{ Name, Status, Detail string }
	}
	if data, err := os.ReadFile(filepath.Join(runDir, "out", "partial", "container.json")); err != nil || json.Unmarshal(data, &fb) != nil {
		t.Fatalf("the fallback's container phase wrote no result: %v", err)
	}
	if fb.Env["container_runtime"] != "nsrunc" {
		t.Errorf("the container phase ran on %q, want nsrunc", fb.Env["container_runtime"])
	}
	if len(fb.Checks) < 8 {
		t.Errorf("the fallback's container phase made only %d checks", len(fb.Checks))
	}

	// A phase the time budget no longer fits is not started and says so; it never passes.
	benv := append(env, "BUDGET_S=1") //nolint:gocritic // env is not used after this
	out, rc = run(t, time.Minute, benv, root, "bash", "test/gpu/device-run.sh", "procaddr")
	if rc != 1 || !strings.Contains(out, "[device-run] procaddr: not started") {
		t.Errorf("device-run.sh procaddr with BUDGET_S=1: exit %d, want 1 and the phase not started\n%s", rc, out)
	}
	if data, err := os.ReadFile(filepath.Join(ret, names[0])); err != nil || !regexp.MustCompile(`"name": "procaddr: not run",\s*"status": "not_checked",\s*"detail": "not started: \d+ s of device-run.sh's 1 s budget left`).Match(data) {
		t.Errorf("the results must say procaddr was not started for want of time (%v)", err)
	}
	// A phase past its own limit is killed, its containers removed, and its result says so.
	tenv := append(env, "LIMIT_S_guard=3") //nolint:gocritic // env is not used after this
	out, rc = run(t, 2*time.Minute, tenv, root, "bash", "test/gpu/device-run.sh", "guard")
	if rc != 1 || !strings.Contains(out, "[device-run] guard: exit 124 after") {
		t.Errorf("device-run.sh guard with LIMIT_S_guard=3: exit %d, want 1 after the guard phase timed out (124)\n%s", rc, out)
	}
	if data, err := os.ReadFile(filepath.Join(ret, names[0])); err != nil || !regexp.MustCompile(`"name": "guard: not run",\s*"status": "not_checked",\s*"detail": "timed out after its 3 s limit`).Match(data) {
		t.Errorf("the results must say the guard phase timed out (%v)", err)
	}
	// (on the fallback: the preflight above chose it)
	if left, _ := os.ReadDir("/run/gpuproof-nsrunc"); len(left) > 0 {
		t.Errorf("containers left after the guard phase timed out: %v", left)
	}
	if out, rc := run(t, time.Minute, nil, b, "python3", "-m", "py_compile", "torch_checks.py"); rc != 0 {
		t.Errorf("torch_checks.py does not compile:\n%s", out)
	}
	if out, rc := run(t, time.Minute, nil, b, "python3", "torch_checks.py", "selftest"); rc != 0 {
		t.Errorf("torch_checks.py selftest:\n%s", out)
	}
}
