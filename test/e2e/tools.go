package e2e

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// repoRoot is the module root, found from this file's location.
func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// toolsDir is where `make tools` puts the upstream binaries.
func toolsDir() string {
	if d := os.Getenv("TESSERA_TOOLS"); d != "" {
		return d
	}
	return filepath.Join(repoRoot(), ".cache", "tools")
}

// tool returns the path of an upstream binary, failing the test with what to do when it is missing.
func tool(t testing.TB, name string) string {
	t.Helper()
	p := filepath.Join(toolsDir(), "bin", name)
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("%s is not built: run `make tools` (or `make test`, which does) first: %v", p, err)
	}
	return p
}

var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
)

// tesseraBinary builds a command of this module once per test binary run and returns its path.
func tesseraBinary(t testing.TB, name string) string {
	t.Helper()
	buildOnce.Do(func() {
		buildDir, buildErr = os.MkdirTemp("", "tessera-e2e-bin-")
		if buildErr != nil {
			return
		}
		cmd := exec.Command("go", "build", "-o", buildDir+"/", "./cmd/...")
		cmd.Dir = repoRoot()
		cmd.Env = append(os.Environ(), "CGO_CFLAGS=-O2 -g -Wno-deprecated-declarations")
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = &buildError{err: err, out: string(out)}
		}
	})
	if buildErr != nil {
		t.Fatalf("build tessera commands: %v", buildErr)
	}
	return filepath.Join(buildDir, name)
}

type buildError struct {
	err error
	out string
}

func (e *buildError) Error() string { return e.err.Error() + "\n" + e.out }

// runCmd runs a command with a timeout and returns its combined output.
func runCmd(t testing.TB, timeout time.Duration, name string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return strings.TrimSpace(out.String()), err
}

// mustRun is runCmd that fails the test on error.
func mustRun(t testing.TB, timeout time.Duration, name string, args ...string) string {
	t.Helper()
	out, err := runCmd(t, timeout, name, args...)
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", filepath.Base(name), strings.Join(args, " "), err, out)
	}
	return out
}

// SimDriver is what `make vcuda` builds for the simulated node, once per test binary run: the fake
// driver (libcuda.so.1, libnvidia-ml.so.1, nvidia-smi) that the agent's --sim-driver-dir installs
// as the simulated driver root, the real libvcuda.so, and an image overlay holding
// /usr/local/bin/cudaprobe (test/image/cudaprobe.c, linked against libcuda.so.1) and
// /usr/local/bin/cudaprobe-static (the same with the fake driver linked in, past vcuda).
type SimDriver struct {
	FakeDir      string // --sim-driver-dir
	VCUDALibrary string // --vcuda-library
	ProbeOverlay string // copied over the test image's root
}

var (
	simDriverOnce sync.Once
	simDriver     SimDriver
	simDriverErr  error
)

// BuildSimDriver builds the simulated driver, libvcuda.so and cudaprobe (gcc and make are required:
// a missing toolchain fails the test).
func BuildSimDriver(t testing.TB) SimDriver {
	t.Helper()
	simDriverOnce.Do(func() {
		dir, err := os.MkdirTemp("", "tessera-e2e-vcuda-")
		if err != nil {
			simDriverErr = err
			return
		}
		fake := filepath.Join(dir, "fake")
		probe := filepath.Join(dir, "probe-root", "usr", "local", "bin")
		steps := [][]string{
			{"make", "-s", "-C", filepath.Join(repoRoot(), "vcuda"), "BUILD=" + dir,
				filepath.Join(dir, "libvcuda.so"), filepath.Join(fake, "libcuda.so.1"), filepath.Join(fake, "libnvidia-ml.so.1"), filepath.Join(fake, "nvidia-smi")},
			{"mkdir", "-p", probe},
			{"gcc", "-O2", "-Wall", "-Werror", "-o", filepath.Join(probe, "cudaprobe"), filepath.Join(repoRoot(), "test", "image", "cudaprobe.c"),
				"-L" + fake, "-l:libcuda.so.1"},
			// cudaprobe-static carries its own copy of the driver, as a static binary or one making raw
			// ioctls would: vcuda never sees its calls, while the simulated driver still charges its
			// memory to it (the node agent's NVML reports it).
			{"gcc", "-O2", "-Wall", "-Werror", "-o", filepath.Join(probe, "cudaprobe-static"), filepath.Join(repoRoot(), "test", "image", "cudaprobe.c"),
				filepath.Join(repoRoot(), "vcuda", "test", "fake_cuda.c"), filepath.Join(repoRoot(), "vcuda", "test", "fake_device_model.c"), "-lpthread", "-lm"},
		}
		for _, s := range steps {
			if out, err := exec.Command(s[0], s[1:]...).CombinedOutput(); err != nil {
				simDriverErr = &buildError{err: err, out: strings.Join(s, " ") + "\n" + string(out)}
				return
			}
		}
		simDriver = SimDriver{FakeDir: fake, VCUDALibrary: filepath.Join(dir, "libvcuda.so"), ProbeOverlay: filepath.Join(dir, "probe-root")}
	})
	if simDriverErr != nil {
		t.Fatalf("build the simulated driver (make vcuda, gcc): %v", simDriverErr)
	}
	return simDriver
}
