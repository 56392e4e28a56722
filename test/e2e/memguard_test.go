package e2e

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/memguard"
	"github.com/tessera-gpu/tessera/internal/testing/fakedriver"
)

// TestSecurityMemoryGuard: a share container that goes past vcuda and over its cap is killed by
// the node agent from what the driver reports on the host (the simulated NVML's per-process
// memory, by host pid), with a Warning Event GPUMemoryCapExceeded naming the container, what it
// used and its cap; a share container under its cap, on the same path through vcuda, is left
// alone. One subtest per way past vcuda (issue 28), all in one cluster:
//   - static: cudaprobe-static carries its own copy of the driver, as a static binary would;
//   - region-write: cudabypass writes 0 over its accounting region's used word before each of
//     four allocations through vcuda, which then sees a share under its cap every time;
//   - deepbind: a library linked against libcuda.so.1, opened with RTLD_DEEPBIND, allocates
//     through its linked cuMemAlloc_v2, which binds to the driver;
//   - rtld-next: a library (opened without RTLD_DEEPBIND, its context made through vcuda) looks
//     cuMemAlloc_v2 up with dlsym(RTLD_NEXT, ...), which finds its own dependency, the driver.
//
// Each bypass holds 2 GiB and its context, more than twice the 1 GiB cap. The guard alone stops
// them: with --memory-guard=false every subtest but "polite" fails.
//
// The compute guard in the same cluster (its defaults: a 10 s window, 20 s of grace, 15 points):
//   - compute-static: cudaprobe-static runs kernels back to back past vcuda on a share capped at
//     20% of the GPU; the simulated NVML samples it near 100% per process and the agent kills it
//     (GPUComputeCapExceeded, 137);
//   - compute-polite: the same loop through vcuda, whose limiter holds it near 20%, runs on;
//   - compute-measured: the agent publishes into compute-polite, read-only, the busy time the
//     simulated NVML measured of its CUDA process (api.ComputeMeasured).
//
// With --compute-guard=false (or the compute guard's kill removed) compute-static fails.
func TestSecurityMemoryGuard(t *testing.T) {
	c := StartCluster(t, ClusterOptions{})
	const held = 2 << 30
	share := func(name, script string) *corev1.Pod {
		p := TestPod(name, map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "1Gi"}, nil)
		p.Spec.Containers[0].Command = []string{"sh", "-c", "exec " + script}
		return p
	}
	// Through vcuda: 256 MiB and the A100's context (vcuda charges its table's 384 MiB), under the 1 GiB cap.
	c.CreatePod(t, share("polite", fmt.Sprintf("cudaprobe hold %d 3600", 256<<20)))
	c.CreatePod(t, share("bypass", fmt.Sprintf("cudaprobe-static hold %d 3600", held)))
	c.CreatePod(t, share("region-write", fmt.Sprintf("cudabypass region %d 4 3600", held)))
	c.CreatePod(t, share("deepbind", fmt.Sprintf("cudabypass deepbind %d 3600", held)))
	c.CreatePod(t, share("rtld-next", fmt.Sprintf("cudabypass next %d 3600", held)))
	spin := func(name, probe string) *corev1.Pod {
		p := TestPod(name, map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "1Gi", api.ResourceShareCores: "20"}, nil)
		p.Spec.Containers[0].Command = []string{"sh", "-c", "exec " + probe + " spin 3600"}
		return p
	}
	c.CreatePod(t, spin("compute-static", "cudaprobe-static"))
	c.CreatePod(t, spin("compute-polite", "cudaprobe"))
	c.WaitRunning(t, 2*time.Minute, "polite")

	ctx, err := fakedriver.ContextBytes(8) // the node's A100s: compute capability 8.0
	if err != nil {
		t.Fatal(err)
	}
	used := fmt.Sprintf(`container "main" used %d MiB`, (held+ctx)>>20)
	// sigkilled waits until pod's container ended as the kernel's OOM killer ends one: SIGKILL, 137.
	sigkilled := func(t *testing.T, pod string) {
		if err := waitFor(time.Minute, 200*time.Millisecond, func() (bool, error) {
			for _, cs := range c.Pod(t, pod).Status.ContainerStatuses {
				if term := cs.State.Terminated; term != nil {
					if term.ExitCode != 137 {
						return false, fmt.Errorf("%s ended with %d, want 137 (SIGKILL)", pod, term.ExitCode)
					}
					return true, nil
				}
			}
			return false, fmt.Errorf("%s's container still runs", pod)
		}); err != nil {
			t.Errorf("%v\n%s", err, c.Describe(t, pod))
		}
	}
	// killed waits for pod's GPUMemoryCapExceeded event, checks it names what the container used
	// and its cap, and that the container ended as the kernel's OOM killer ends one: SIGKILL, 137.
	killed := func(t *testing.T, pod string) {
		var events []string
		if err := waitFor(2*time.Minute, 500*time.Millisecond, func() (bool, error) {
			events = c.Events(t, pod, memguard.ReasonCapExceeded)
			return len(events) > 0, fmt.Errorf("no %s event for %s", memguard.ReasonCapExceeded, pod)
		}); err != nil {
			t.Fatalf("%v\n%s", err, c.Describe(t, pod))
		}
		if e := events[0]; !strings.Contains(e, used) || !strings.Contains(e, "cap of 1024 MiB") {
			t.Errorf("event does not say %s (2 GiB and the fake driver's %d MiB context) and its 1024 MiB cap: %s", used, ctx>>20, e)
		}
		sigkilled(t, pod)
	}
	// pastVCUDA checks, from the probe's own line in the container's log, that it holds all it
	// asked for while its region counts less than the cap (vcuda let it, or never saw it), and
	// that the cuMemAlloc_v2 it called lives in wantFrom.
	pastVCUDA := func(t *testing.T, pod, wantFrom string) {
		out, err := c.Kubectl(t, "logs", pod)
		if err != nil {
			t.Fatalf("logs of %s: %v\n%s", pod, err, out)
		}
		t.Logf("%s: %s", pod, strings.TrimSpace(out))
		v := map[string]string{}
		for _, line := range strings.Split(out, "\n") {
			if strings.HasPrefix(line, "held=") {
				for _, f := range strings.Fields(line) {
					if k, val, ok := strings.Cut(f, "="); ok {
						v[k] = val
					}
				}
			}
		}
		region, err := strconv.ParseInt(v["region_used"], 10, 64)
		if v["held"] != strconv.Itoa(held) || v["error"] != "0" || err != nil || region < 0 || region >= 1<<30 {
			t.Errorf("%s did not hold %d bytes (error=0) while its region counts under the 1 GiB cap: %s", pod, held, out)
		}
		if !strings.HasSuffix(v["alloc_from"], wantFrom) {
			t.Errorf("%s's cuMemAlloc_v2 is in %s, want %s", pod, v["alloc_from"], wantFrom)
		}
	}
	// mismatch: the guard also says the container holds more than its region counts. It compares
	// on every sample before it counts the grace, so the event comes with any kill of a share
	// whose region counts low.
	mismatch := func(t *testing.T, pod string) {
		if err := waitFor(30*time.Second, 500*time.Millisecond, func() (bool, error) {
			return len(c.Events(t, pod, memguard.ReasonAccountingMismatch)) > 0, fmt.Errorf("no %s event for %s", memguard.ReasonAccountingMismatch, pod)
		}); err != nil {
			t.Errorf("%v\n%s", err, c.Describe(t, pod))
		}
	}

	t.Run("static", func(t *testing.T) { killed(t, "bypass") })
	t.Run("region-write", func(t *testing.T) {
		killed(t, "region-write")
		pastVCUDA(t, "region-write", "libvcuda.so") // through vcuda, which the written region fooled
		if out, _ := c.Kubectl(t, "logs", "region-write"); !strings.Contains(out, "zeroed=4") {
			t.Errorf("region-write did not write its region before each allocation: %s", out)
		}
		mismatch(t, "region-write")
	})
	t.Run("deepbind", func(t *testing.T) {
		killed(t, "deepbind")
		pastVCUDA(t, "deepbind", "libcuda.so.1")
		mismatch(t, "deepbind")
	})
	t.Run("rtld-next", func(t *testing.T) {
		killed(t, "rtld-next")
		pastVCUDA(t, "rtld-next", "libcuda.so.1")
		mismatch(t, "rtld-next")
	})
	t.Run("compute-static", func(t *testing.T) {
		var events []string
		if err := waitFor(3*time.Minute, time.Second, func() (bool, error) {
			events = c.Events(t, "compute-static", memguard.ReasonComputeCapExceeded)
			return len(events) > 0, fmt.Errorf("no %s event for compute-static", memguard.ReasonComputeCapExceeded)
		}); err != nil {
			t.Fatalf("%v\n%s", err, c.Describe(t, "compute-static"))
		}
		if e := events[0]; !strings.Contains(e, "compute cap of 20%") || !strings.Contains(e, "killed its GPU processes") {
			t.Errorf("event does not name the 20%% cap and the kill: %s", e)
		}
		sigkilled(t, "compute-static")
	})
	// compute-polite ran the same loop over the same period, held to its cap by vcuda.
	t.Run("compute-polite", func(t *testing.T) {
		c.WaitRunning(t, 5*time.Second, "compute-polite")
		if ev := c.Events(t, "compute-polite", memguard.ReasonComputeCapExceeded); len(ev) > 0 {
			t.Errorf("compute-polite (held to its cap by vcuda) got %v", ev)
		}
		if out, _ := c.Kubectl(t, "logs", "compute-polite"); !strings.Contains(out, "spinning=1 error=0") {
			t.Errorf("compute-polite is not running kernels: %q", out)
		}
		// The guard measured it (not merely missed it): its windowed utilisation is near its cap.
		var util float64 = -1
		for _, line := range strings.Split(c.Metrics(t), "\n") {
			if strings.HasPrefix(line, "tessera_container_gpu_sm_utilization_percent{") && strings.Contains(line, `pod="compute-polite"`) {
				f := strings.Fields(line)
				util, _ = strconv.ParseFloat(f[len(f)-1], 64)
			}
		}
		if util < 5 || util > 35 {
			t.Errorf("compute-polite's measured SM utilisation is %v, want 5..35 (capped at 20%%, tolerance 15 points; -1: not measured)", util)
		}
	})
	// The agent publishes what the driver measured of compute-polite's kernels into it, read-only:
	// its CUDA process (pid 1 there, with its start time) with the busy time it ran kernels.
	t.Run("compute-measured", func(t *testing.T) {
		path := api.ComputeMeasuredDirInContainer + "/" + api.ComputeMeasuredFile
		// The output comes back trimmed: a marker keeps the file's final newline.
		out := c.MustExec(t, "compute-polite", "cut -d' ' -f22 /proc/1/stat; cat "+path+"; echo .")
		start, file, _ := strings.Cut(strings.TrimSuffix(out, "."), "\n")
		m, err := api.ParseComputeMeasured([]byte(file))
		if err != nil {
			t.Fatalf("%s in compute-polite: %v\n%s", path, err, out)
		}
		var found bool
		for _, l := range m.Lines {
			if l.PID == 1 && strconv.FormatUint(l.Start, 10) == strings.TrimSpace(start) {
				found = true
				if l.Busy == 0 || l.At == 0 {
					t.Errorf("compute-polite's process has busy %d at %d, want both > 0 after it ran kernels", l.Busy, l.At)
				}
			}
		}
		if !found {
			t.Errorf("%s does not name compute-polite's CUDA process (pid 1, start %s):\n%s", path, strings.TrimSpace(start), file)
		}
		if out, err := c.Exec(t, "compute-polite", "main", "echo x > "+path); err == nil {
			t.Errorf("compute-polite wrote its measured compute file: %q", out)
		}
	})
	// The guard sampled polite in the same passes: under its cap, it runs on, with no event.
	t.Run("polite", func(t *testing.T) {
		c.WaitRunning(t, 5*time.Second, "polite")
		if ev := c.Events(t, "polite", memguard.ReasonCapExceeded); len(ev) > 0 {
			t.Errorf("polite (under its cap) got %v", ev)
		}
		if out := c.MustExec(t, "polite", "cat /proc/1/cmdline | tr '\\0' ' '"); !strings.Contains(out, "cudaprobe hold") {
			t.Errorf("polite's holder is gone: %q\n%s", out, c.Describe(t, "polite"))
		}
	})
}
