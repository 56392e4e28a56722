package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// On a node without NVIDIA's driver, `tessera-node run` (no --backend) and `cdi generate` fail with
// a message that says what was looked for, where, and which flags to set; they never fall back to
// the simulated node.
func TestNoDriverFailsLoud(t *testing.T) {
	empty := t.TempDir()
	data := t.TempDir()
	for _, args := range [][]string{
		{"run", "--driver-root=" + empty, "--data-dir=" + data, "--cdi-dir=" + filepath.Join(data, "cdi")},
		{"cdi", "generate", "--driver-root=" + empty, "--data-dir=" + data, "--cdi-dir=" + filepath.Join(data, "cdi")},
	} {
		err := run(args, testLog(t))
		if err == nil {
			t.Fatalf("%v: no error on a node without a driver", args)
		}
		for _, want := range []string{"libnvidia-ml.so.1 not found under --driver-root " + empty, filepath.Join(empty, "usr/lib/x86_64-linux-gnu"),
			"set --driver-root", "/run/nvidia/driver", "--backend=sim"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%v: error %q lacks %q", args, err, want)
			}
		}
		if entries, _ := os.ReadDir(filepath.Join(data, "cdi")); len(entries) > 0 {
			t.Errorf("%v wrote CDI specs without a driver", args)
		}
	}
	// "auto" is gone: a config or flag asking for it is refused, not quietly simulated.
	if err := run([]string{"cdi", "generate", "--backend=auto", "--data-dir=" + data}, testLog(t)); err == nil || !strings.Contains(err.Error(), `backend: Invalid value: must be nvml`) {
		t.Errorf("--backend=auto: %v", err)
	}
}
