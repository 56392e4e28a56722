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
