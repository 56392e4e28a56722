package e2e

import (
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/testing/fakedriver"
)

// TestSecurityMemoryGuard: a share container that allocates past vcuda (cudaprobe-static carries
// its own copy of the driver, as a static binary would) and goes over its cap is killed by the node
// agent from what the driver reports on the host (the simulated NVML's per-process memory, by host
// pid), with a Warning Event GPUMemoryCapExceeded naming the container, what it used and its cap;
// a share container under its cap, on the same path through vcuda, is left alone.
func TestSecurityMemoryGuard(t *testing.T) {
	c := StartCluster(t, ClusterOptions{})
	hold := func(name, probe string, bytes int64) *corev1.Pod {
		p := TestPod(name, map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "1Gi"}, nil)
		p.Spec.Containers[0].Command = []string{"sh", "-c", fmt.Sprintf("exec %s hold %d 3600", probe, bytes)}
		return p
	}
	// Through vcuda: 256 MiB and the A100's context (vcuda charges its table's 384 MiB), under the 1 GiB cap.
	c.CreatePod(t, hold("polite", "cudaprobe", 256<<20))
	// Past vcuda: 2 GiB and the context, more than twice the cap.
	c.CreatePod(t, hold("bypass", "cudaprobe-static", 2<<30))
	c.WaitRunning(t, 2*time.Minute, "polite")

	var events []string
	if err := waitFor(2*time.Minute, 500*time.Millisecond, func() (bool, error) {
		events = c.Events(t, "bypass", "GPUMemoryCapExceeded")
		return len(events) > 0, fmt.Errorf("no GPUMemoryCapExceeded event for bypass")
	}); err != nil {
		t.Fatalf("%v\n%s", err, c.Describe(t, "bypass"))
	}
	ctx, err := fakedriver.ContextBytes(8) // the node's A100s: compute capability 8.0
	if err != nil {
		t.Fatal(err)
	}
	used := fmt.Sprintf(`container "main" used %d MiB`, (2<<30+ctx)>>20)
	if e := events[0]; !strings.Contains(e, used) || !strings.Contains(e, "cap of 1024 MiB") {
		t.Errorf("event does not say %s (2 GiB and the fake driver's %d MiB context) and its 1024 MiB cap: %s", used, ctx>>20, e)
	}
	// Killed, as the kernel's OOM killer kills: SIGKILL, so the container ends with 137.
	if err := waitFor(time.Minute, 200*time.Millisecond, func() (bool, error) {
		for _, cs := range c.Pod(t, "bypass").Status.ContainerStatuses {
			if term := cs.State.Terminated; term != nil {
				if term.ExitCode != 137 {
					return false, fmt.Errorf("bypass ended with %d, want 137 (SIGKILL)", term.ExitCode)
				}
				return true, nil
			}
		}
		return false, fmt.Errorf("bypass's container still runs")
	}); err != nil {
		t.Errorf("%v\n%s", err, c.Describe(t, "bypass"))
	}
	// The guard sampled polite in the same passes: under its cap, it runs on, with no event.
	c.WaitRunning(t, 5*time.Second, "polite")
	if ev := c.Events(t, "polite", "GPUMemoryCapExceeded"); len(ev) > 0 {
		t.Errorf("polite (under its cap) got %v", ev)
	}
	if out := c.MustExec(t, "polite", "cat /proc/1/cmdline | tr '\\0' ' '"); !strings.Contains(out, "cudaprobe hold") {
		t.Errorf("polite's holder is gone: %q\n%s", out, c.Describe(t, "polite"))
	}
}
