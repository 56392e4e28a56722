package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// CPU pinning for the live placement benchmark (TESSERA_BENCH_EXTENDER_CPUS): the extender on CPUs
// of its own, the control plane and the benchmark's client on the others, as a deployment gives the
// extender's pod CPU of its own on another node than the API server. Pinning is by affinity only:
// nothing stops other processes of the machine from running on either set.

// parseCPUList reads a CPU list as taskset -c and /proc's Cpus_allowed_list write it ("1", "0-3",
// "0,2-3"): the CPUs in increasing order, each once.
func parseCPUList(s string) ([]int, error) {
	var cpus []int
	for part := range strings.SplitSeq(strings.TrimSpace(s), ",") {
		lo, hi, isRange := strings.Cut(strings.TrimSpace(part), "-")
		a, err := strconv.Atoi(lo)
		b := a
		if err == nil && isRange {
			b, err = strconv.Atoi(hi)
		}
		if err != nil || a < 0 || b < a {
			return nil, fmt.Errorf("CPU list %q: %q is not a CPU number or a range lo-hi (write e.g. 1 or 0-3 or 0,2-3)", s, part)
		}
		for c := a; c <= b; c++ {
			cpus = append(cpus, c)
		}
	}
	slices.Sort(cpus)
	return slices.Compact(cpus), nil
}

// formatCPUList writes cpus (sorted, distinct) as a CPU list, ranges collapsed.
func formatCPUList(cpus []int) string {
	var parts []string
	for i := 0; i < len(cpus); {
		j := i
		for j+1 < len(cpus) && cpus[j+1] == cpus[j]+1 {
			j++
		}
		if j == i {
			parts = append(parts, strconv.Itoa(cpus[i]))
		} else {
			parts = append(parts, fmt.Sprintf("%d-%d", cpus[i], cpus[j]))
		}
		i = j + 1
	}
	return strings.Join(parts, ",")
}

// splitCPUs divides the CPUs this process may use (allowed) into own (the extender's) and the
// rest (everything else of the benchmark). It refuses CPUs outside allowed and an own set that
// leaves nothing for the rest: either would leave a process unable to run where the run says it does.
func splitCPUs(allowed, own []int) (rest []int, err error) {
	if len(own) == 0 {
		return nil, fmt.Errorf("no CPUs named for the extender")
	}
	for _, c := range own {
		if !slices.Contains(allowed, c) {
			return nil, fmt.Errorf("CPU %d is not one this process may use (%s)", c, formatCPUList(allowed))
		}
	}
	for _, c := range allowed {
		if !slices.Contains(own, c) {
			rest = append(rest, c)
		}
	}
	if len(rest) == 0 {
		return nil, fmt.Errorf("CPUs %s are all this process may use (%s): none would be left for the control plane", formatCPUList(own), formatCPUList(allowed))
	}
	return rest, nil
}

func cpuSet(cpus []int) *unix.CPUSet {
	var set unix.CPUSet
	for _, c := range cpus {
		set.Set(c)
	}
	return &set
}

func cpusOf(set *unix.CPUSet) []int {
	var cpus []int
	for c := range len(set) * 64 {
		if set.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	return cpus
}

// allowedCPUs are the CPUs this process's current thread may run on.
func allowedCPUs() ([]int, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		return nil, fmt.Errorf("sched_getaffinity: %w", err)
	}
	return cpusOf(&set), nil
}

// startOnCPUs starts cmd with its affinity set to cpus from its first instruction: a child inherits
// the mask of the thread that forks it, so the fork runs on a thread locked and masked for it (and
// unmasked after). Setting the mask after the start would reach the main thread only: a Go binary
// (kube-apiserver, the extender) has started other threads by then, which keep the old mask.
// A Go child sizes GOMAXPROCS by this mask.
func startOnCPUs(cmd *exec.Cmd, cpus []int) error {
	runtime.LockOSThread()
	var old unix.CPUSet
	if err := unix.SchedGetaffinity(0, &old); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("sched_getaffinity: %w", err)
	}
	if err := unix.SchedSetaffinity(0, cpuSet(cpus)); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("pin to CPUs %s: %w", formatCPUList(cpus), err)
	}
	startErr := cmd.Start()
	if err := unix.SchedSetaffinity(0, &old); err != nil {
		// the thread stays locked, so no other goroutine runs on its narrowed mask; it is
		// discarded when this goroutine ends
		return fmt.Errorf("restore this thread's CPUs after starting %s: %w", cmd.Path, err)
	}
	runtime.UnlockOSThread()
	return startErr
}

// pinSelf sets every thread of this process to cpus; threads started later inherit it from the
// thread that starts them. It goes over /proc/self/task until a pass finds no thread it has not
// pinned, since the runtime may start a thread (from an unpinned one) while it works.
func pinSelf(cpus []int) error {
	set := cpuSet(cpus)
	done := map[int]bool{}
	for {
		tasks, err := os.ReadDir("/proc/self/task")
		if err != nil {
			return fmt.Errorf("list this process's threads: %w", err)
		}
		fresh := 0
		for _, task := range tasks {
			tid, err := strconv.Atoi(task.Name())
			if err != nil || done[tid] {
				continue
			}
			fresh++
			if err := unix.SchedSetaffinity(tid, set); err != nil && err != unix.ESRCH { // ESRCH: the thread ended
				return fmt.Errorf("pin thread %d to CPUs %s: %w", tid, formatCPUList(cpus), err)
			}
			done[tid] = true
		}
		if fresh == 0 {
			return nil
		}
	}
}

// cpusAllowedList is a process's Cpus_allowed_list from /proc/<pid>/status (its main thread's
// mask), for the benchmark's report.
func cpusAllowedList(pid int) (string, error) {
	return statusCPUList(fmt.Sprintf("/proc/%d/status", pid))
}

// statusCPUList is the Cpus_allowed_list of a /proc status file (a process's or a thread's).
func statusCPUList(path string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	for line := range strings.SplitSeq(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "Cpus_allowed_list:"); ok {
			return strings.TrimSpace(v), nil
		}
	}
	return "", fmt.Errorf("%s has no Cpus_allowed_list", path)
}
