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

// TestGPUBundleDryRun builds the GPU bundle as `make gpu-bundle` does, unpacks it, and runs every
// phase that needs no GPU on the simulated node with vcuda's fake driver: discovery and CDI specs,
// CUDA in runc containers made only from the CDI edits (whole GPU and a vcuda share), the call
// overhead on the fake driver; then the results file and both markdown tables. The PyTorch parts
// are compiled and their helpers self-tested. Needs root (runc, device nodes), go, gcc, make,
// python3 and `make tools`' busybox and glibc: a missing one fails the test.
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
	for _, phase := range []string{"node", "container", "overhead"} {
		out, rc := run(t, 5*time.Minute, env, b, "./run.sh", phase)
		if rc != 0 {
			t.Fatalf("run.sh %s: exit %d\n%s", phase, rc, out)
		}
		t.Logf("run.sh %s:\n%s", phase, out)
	}
	// The GPU-only phases refuse a dry run instead of pretending.
	if out, rc := run(t, time.Minute, env, b, "./run.sh", "torch"); rc != 2 || !strings.Contains(out, "needs a GPU") {
		t.Errorf("run.sh torch in a dry run: exit %d, want 2 with a reason\n%s", rc, out)
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
			Checks  []struct{ Name, Status string }
			Figures []struct {
				Name       string
				MeasuredBy string `json:"measured_by"`
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
	if !res.DryRun || res.Failed != 0 || res.Driver != "580.95.05" || res.CUDA != "13.0" || strings.Join(res.Missing, ",") != "torch,compute" {
		t.Errorf("results: dry_run=%v failed=%d driver=%q cuda=%q missing=%v\n%s", res.DryRun, res.Failed, res.Driver, res.CUDA, res.Missing, data)
	}
	passed := map[string]bool{}
	figures := map[string]string{}
	for _, p := range res.Phases {
		for _, c := range p.Checks {
			passed[p.Phase+": "+c.Name] = c.Status == "pass"
		}
		for _, f := range p.Figures {
			figures[p.Phase+": "+f.Name] = f.MeasuredBy
		}
	}
	for _, want := range []string{
		"node: specs load", "node: specs mount libcuda.so", "node: specs mount nvidia-smi", "node: GPU count",
		"container: whole: nvidia-smi -L lists exactly that GPU", "container: whole: CUDA sees all its memory",
		"container: share: ld.so.preload names vcuda", "container: share: CUDA reports the cap",
		"container: share: OOM at the cap", "container: share: nvidia-smi shows the cap",
	} {
		if !passed[want] {
			t.Errorf("check %q did not pass (or is missing)", want)
		}
	}
	for _, want := range []string{"overhead: fake driver: alloc, added by vcuda at 100% compute", "overhead: fake driver: launch, added by vcuda at 100% compute"} {
		if !strings.Contains(figures[want], "fake driver") {
			t.Errorf("figure %q missing or not labelled with the fake driver: %q", want, figures[want])
		}
	}
	for section, want := range map[string]string{"node": "| share: OOM at the cap | pass |", "vcuda": "| `cuLaunchKernel` (empty kernel, 1 block) | added by vcuda, container at 100% compute | not measured | "} {
		out, rc := run(t, time.Minute, nil, b, "bin/gpuproof", "tables", "-section", section, files[0])
		if rc != 0 || !strings.HasPrefix(out, "**DRY RUN") || !strings.Contains(out, want) {
			t.Errorf("tables -section %s: exit %d, want the dry-run banner and %q:\n%s", section, rc, want, out)
		}
	}
	if out, rc := run(t, time.Minute, nil, b, "python3", "-m", "py_compile", "torch_checks.py"); rc != 0 {
		t.Errorf("torch_checks.py does not compile:\n%s", out)
	}
	if out, rc := run(t, time.Minute, nil, b, "python3", "torch_checks.py", "selftest"); rc != 0 {
		t.Errorf("torch_checks.py selftest:\n%s", out)
	}
}
