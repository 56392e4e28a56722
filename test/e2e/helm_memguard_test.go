package e2e

import (
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
)

// TestSecurityHelmAgentSeesHostPIDs renders the node agent (no cluster): the memory guard reads
// NVML's per-process memory, which names host pids, maps each through /proc/<pid>/cgroup and kills
// over-cap processes by pid: without the host's PID namespace it would find none of them, and every
// share's cap would rest on vcuda alone. --memory-guard=false and a --host-proc elsewhere are not
// what the chart ships.
func TestSecurityHelmAgentSeesHostPIDs(t *testing.T) {
	var ds appsv1.DaemonSet
	chartObject(t, chartObjects(t), "DaemonSet/tessera-node", &ds)
	spec := ds.Spec.Template.Spec
	if !spec.HostPID {
		t.Error("the node agent does not run in the host's PID namespace: the memory guard cannot see or kill NVML's host pids")
	}
	args := spec.Containers[0].Args
	if i := slices.IndexFunc(args, func(a string) bool {
		return strings.HasPrefix(a, "--memory-guard=") && a != "--memory-guard=true" || strings.HasPrefix(a, "--host-proc=") && a != "--host-proc=/proc"
	}); i >= 0 {
		t.Errorf("the chart passes %q: the memory guard must run on the host's /proc", args[i])
	}
}
