package e2e

import (
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

func TestParseCPUList(t *testing.T) {
	for in, want := range map[string][]int{"1": {1}, "0-3": {0, 1, 2, 3}, "0,2-3": {0, 2, 3}, " 3,1,1 ": {1, 3}} {
		got, err := parseCPUList(in)
		if err != nil || !slices.Equal(got, want) {
			t.Errorf("parseCPUList(%q) = %v, %v; want %v", in, got, err, want)
		}
		if back := formatCPUList(got); in == "0-3" && back != "0-3" || in == "0,2-3" && back != "0,2-3" {
			t.Errorf("formatCPUList(%v) = %q", got, back)
		}
	}
	for _, in := range []string{"", "a", "3-1", "-1", "1,", "1-"} {
		if got, err := parseCPUList(in); err == nil {
			t.Errorf("parseCPUList(%q) = %v, want an error", in, got)
		}
	}
}

func TestSplitCPUsRefusesWhatCannotRun(t *testing.T) {
	rest, err := splitCPUs([]int{0, 1, 2, 3}, []int{1, 2})
	if err != nil || !slices.Equal(rest, []int{0, 3}) {
		t.Fatalf("splitCPUs = %v, %v; want [0 3]", rest, err)
	}
	if _, err := splitCPUs([]int{0, 1}, []int{2}); err == nil || !strings.Contains(err.Error(), "CPU 2 is not one") {
		t.Errorf("a CPU outside the allowed set: %v", err)
	}
	if _, err := splitCPUs([]int{0, 1}, []int{0, 1}); err == nil || !strings.Contains(err.Error(), "none would be left") {
		t.Errorf("every CPU for the extender: %v", err)
	}
}

// TestStartOnCPUsPinsTheChildOnly starts a child on one CPU: every thread of the child has that
// mask, and this process's thread that forked it is back on its own.
func TestStartOnCPUsPinsTheChildOnly(t *testing.T) {
	allowed, err := allowedCPUs()
	if err != nil {
		t.Fatal(err)
	}
	if len(allowed) < 2 {
		t.Fatalf("this test needs 2 CPUs to tell a pinned child from an unpinned one; this process may use %s", formatCPUList(allowed))
	}
	want := allowed[len(allowed)-1:]
	cmd := exec.Command("sleep", "30")
	if err := startOnCPUs(cmd, want); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	for task, l := range threadCPUs(t, strconv.Itoa(cmd.Process.Pid)) {
		if l != formatCPUList(want) {
			t.Errorf("child thread %s is on CPUs %s, want %s", task, l, formatCPUList(want))
		}
	}
	if got, err := cpusAllowedList(cmd.Process.Pid); err != nil || got != formatCPUList(want) {
		t.Errorf("cpusAllowedList = %q, %v; want %s", got, err, formatCPUList(want))
	}
	for task, l := range threadCPUs(t, "self") {
		if l != formatCPUList(allowed) {
			t.Errorf("this process's thread %s is on CPUs %s after the start, want %s", task, l, formatCPUList(allowed))
		}
	}
}

// threadCPUs is the Cpus_allowed_list of every thread of process pid ("self": this one).
func threadCPUs(t *testing.T, pid string) map[string]string {
	t.Helper()
	tasks, err := filepath.Glob(filepath.Join("/proc", pid, "task", "*"))
	if err != nil || len(tasks) == 0 {
		t.Fatalf("threads of %s: %v %v", pid, tasks, err)
	}
	out := map[string]string{}
	for _, task := range tasks {
		if l, err := statusCPUList(filepath.Join(task, "status")); err == nil { // else the thread ended
			out[filepath.Base(task)] = l
		}
	}
	return out
}
