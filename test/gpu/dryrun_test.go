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

// TestGPUBundleDryRun builds the GPU bundle as `make gpu-bundle` does, unpacks it, and runs every
// phase that needs no GPU on the simulated node with vcuda's fake driver: discovery and CDI specs,
// CUDA in runc containers made only from the CDI edits (whole GPU and a vcuda share), the memory
// phase (per-context overhead read from the host's NVML by host pid, the VMM patterns under a cap),
// the guard phase (tessera-node's memory guard kills a share allocating past vcuda, leaves one under
// its cap), the call overhead on the fake driver; then the results file and both markdown tables.
// The PyTorch phases cannot run here and must say so in the results; torch_checks.py is compiled
// and its helpers self-tested. Needs root (runc, device nodes), go, gcc, make, python3 and `make
// tools`' busybox and glibc: a missing one fails the test.
func TestGPUBundleDryRun(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("the dry run needs root: runc and the simulated node's device nodes")
	}
	for _, tool := range []string{"go", "gcc", "make", "python3", "tar", "objdump"} {
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
	if out, rc := run(t, time.Minute, nil, dir, "tar", "xzf", tarball); rc != 0 {
		t.Fatalf("unpack: %s", out)
	}
	b := filepath.Join(dir, "tessera-gpu-bundle")
	env := []string{"DRY_RUN=1", "OUT=" + filepath.Join(dir, "out")}
	for _, phase := range []string{"node", "container", "memory", "guard", "overhead"} {
		out, rc := run(t, 5*time.Minute, env, b, "./run.sh", phase)
		want := 0
		if phase == "memory" && len(vmmNotYet) > 0 {
			want = 1 // some check failed, its results written all the same
		}
		if rc != want {
			t.Fatalf("run.sh %s: exit %d, want %d\n%s", phase, rc, want, out)
		}
		t.Logf("run.sh %s:\n%s", phase, out)
	}
	// The GPU-only phases refuse a dry run instead of pretending, and say so in the results.
	for _, phase := range []string{"torch", "compute"} {
		if out, rc := run(t, time.Minute, env, b, "./run.sh", phase); rc != 2 || !strings.Contains(out, "needs a GPU") {
			t.Errorf("run.sh %s in a dry run: exit %d, want 2 with a reason\n%s", phase, rc, out)
		}
	}

	files, _ := filepath.Glob(filepath.Join(dir, "out", "results", "*.json"))
	if len(files) != 1 || !strings.HasSuffix(files[0], "-NVIDIA-A100-SXM4-40GB.json") {
		t.Fatalf("want one results file named <date>-<gpu model>.json, got %v", files)
	}
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
	for _, p := range res.Phases {
		for _, c := range p.Checks {
			passed[p.Phase+": "+c.Name] = c.Status == "pass"
			checks[p.Phase+": "+c.Name] = c.Status + ": " + c.Detail
		}
		for _, f := range p.Figures {
			figures[p.Phase+": "+f.Name] = f.MeasuredBy
			passed[p.Phase+": "+f.Name] = f.Status == "pass"
		}
	}
	want := []string{
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
	if out, rc := run(t, time.Minute, nil, b, "python3", "-m", "py_compile", "torch_checks.py"); rc != 0 {
		t.Errorf("torch_checks.py does not compile:\n%s", out)
	}
	if out, rc := run(t, time.Minute, nil, b, "python3", "torch_checks.py", "selftest"); rc != 0 {
		t.Errorf("torch_checks.py selftest:\n%s", out)
	}
}
