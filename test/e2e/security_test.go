package e2e

import (
	"fmt"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestSecurityCluster attacks the node through what a kubelet really passes (pod specs through the
// API server) and faults the agent, on the real containerd/kubelet stack. Every step checks that a
// victim share pod keeps running with its GPU.
func TestSecurityCluster(t *testing.T) {
	c := StartCluster(t, ClusterOptions{})
	c.CreatePod(t, TestPod("victim", map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "4Gi", api.ResourceShareCores: "20"}, nil))
	c.WaitRunning(t, 2*time.Minute, "victim")
	victimGPU := victimEntry(t, c)
	steps := []struct {
		name string
		fn   func(*testing.T, *Cluster)
	}{
		{"AgentStalled", testSecurityAgentStalled},
		{"HostPathGPUDevice", testSecurityHostPathDevice},
		{"VisibleDevicesEnv", testSecurityVisibleDevicesEnv},
		{"PrivilegedRuns", testSecurityPrivilegedRuns},
	}
	for _, s := range steps {
		t.Run(s.name, func(t *testing.T) {
			s.fn(t, c)
			c.WaitRunning(t, time.Minute, "victim")
			if g := victimEntry(t, c); g != victimGPU {
				t.Errorf("victim's GPU changed from %s to %s", victimGPU, g)
			}
		})
	}
}

// victimEntry is the GPU the victim's share is on, from the agent's ledger.
func victimEntry(t *testing.T, c *Cluster) string {
	t.Helper()
	for _, e := range c.LedgerEntries(t) {
		if e.Pod == "victim" && len(e.Devices) == 1 {
			return e.Devices[0].UUID
		}
	}
	t.Fatalf("victim not in the ledger:\n%s", c.Ledger(t))
	return ""
}

// waitContainerError waits until the pod's container is refused at creation with a message
// containing want.
func waitContainerError(t *testing.T, c *Cluster, pod, want string) string {
	t.Helper()
	var msg string
	err := waitFor(2*time.Minute, 300*time.Millisecond, func() (bool, error) {
		p := c.Pod(t, pod)
		for _, cs := range p.Status.ContainerStatuses {
			if cs.State.Running != nil {
				return false, fmt.Errorf("container %s is running", cs.Name)
			}
			if w := cs.State.Waiting; w != nil && strings.Contains(w.Message, want) {
				msg = w.Message
				return true, nil
			}
		}
		return false, fmt.Errorf("no refusal containing %q yet", want)
	})
	if err != nil {
		t.Fatalf("%v\n%s", err, c.Describe(t, pod))
	}
	return msg
}

// The agent stalls (SIGSTOP) past NRI's 2 s timeout: NRI drops the plugin and would create the
// container unrealised, but the realisation hook in the CDI spec refuses it. After SIGCONT the
// plugin reconnects and the kubelet's retry succeeds.
func testSecurityAgentStalled(t *testing.T, c *Cluster) {
	pid := c.Agent.Pid()
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := true
	defer func() {
		if stopped {
			syscall.Kill(pid, syscall.SIGCONT)
		}
	}()
	p := TestPod("stalled", map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "2Gi", api.ResourceShareCores: "10"}, nil)
	p.Spec.RestartPolicy = corev1.RestartPolicyAlways
	c.CreatePod(t, p)
	msg := waitContainerError(t, c, "stalled", "did not realise it")
	t.Logf("refused while the agent was stalled: %s", msg)
	syscall.Kill(pid, syscall.SIGCONT)
	stopped = false
	c.WaitAgentReady(t)
	c.WaitRunning(t, 3*time.Minute, "stalled")
	out := c.MustExec(t, "stalled", "cat /etc/ld.so.preload; ls /dev")
	if !strings.Contains(out, "libvcuda") || len(deviceNodes(out)) != 1 {
		t.Errorf("the retried container is not realised:\n%s", out)
	}
	c.DeletePods(t, "stalled")
}

// A hostPath volume of a GPU's device node under another name is refused by its number.
func testSecurityHostPathDevice(t *testing.T, c *Cluster) {
	host := filepath.Join(c.Dir, "sim", "dev", "nvidia3")
	p := TestPod("hostdev", nil, nil)
	cd := corev1.HostPathCharDev
	p.Spec.Volumes = []corev1.Volume{{Name: "gpu", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: host, Type: &cd}}}}
	p.Spec.Containers[0].VolumeMounts = []corev1.VolumeMount{{Name: "gpu", MountPath: "/dev/gpu3"}}
	c.CreatePod(t, p)
	msg := waitContainerError(t, c, "hostdev", "/dev/gpu3 (195:")
	t.Logf("refused: %s", msg)
	c.DeletePods(t, "hostdev")
}

// NVIDIA_VISIBLE_DEVICES from the pod is overridden with void.
func testSecurityVisibleDevicesEnv(t *testing.T, c *Cluster) {
	p := TestPod("envgpu", nil, nil)
	p.Spec.Containers[0].Env = []corev1.EnvVar{{Name: "NVIDIA_VISIBLE_DEVICES", Value: "all"}}
	c.CreatePod(t, p)
	c.WaitRunning(t, 2*time.Minute, "envgpu")
	if out := strings.TrimSpace(c.MustExec(t, "envgpu", "echo $NVIDIA_VISIBLE_DEVICES")); out != "void" {
		t.Errorf("NVIDIA_VISIBLE_DEVICES in the container: %q", out)
	}
	c.DeletePods(t, "envgpu")
}

// A privileged pod (every host device) runs: it is root on the node and outside isolation. (The
// simulated GPUs are not under the host's /dev, so the count of privileged GPU containers is
// asserted by the unit test TestSecurityPrivilegedRuns.)
func testSecurityPrivilegedRuns(t *testing.T, c *Cluster) {
	p := TestPod("priv", nil, nil)
	yes := true
	p.Spec.Containers[0].SecurityContext = &corev1.SecurityContext{Privileged: &yes}
	c.CreatePod(t, p)
	c.WaitRunning(t, 2*time.Minute, "priv")
	c.DeletePods(t, "priv")
}
