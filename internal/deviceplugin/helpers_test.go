package deviceplugin

import (
	"errors"
	"io"
	"os"
	"sync"
	"testing"
	"time"
)

// waitTimeout bounds every wait: generous, because a loaded 2-core machine is slow, and a passing
// test never waits that long.
const waitTimeout = 10 * time.Second

// waitFor polls cond until it holds or waitTimeout passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", waitTimeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// shortTempDir returns a fresh directory with a short path: a unix socket path must fit in 108
// bytes, which t.TempDir() under a long test name or $TMPDIR may exceed.
func shortTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("/tmp", "tdp-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// testWriter sends log lines to the test's log until the test ends; gRPC goroutines may still log
// during shutdown, and t.Log after the end panics.
type testWriter struct {
	mu   sync.Mutex
	t    *testing.T
	done bool
}

func newTestWriter(t *testing.T) io.Writer {
	w := &testWriter{t: t}
	t.Cleanup(func() { w.mu.Lock(); w.done = true; w.mu.Unlock() })
	return w
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.done {
		return 0, errors.New("test finished")
	}
	w.t.Log(string(p))
	return len(p), nil
}
