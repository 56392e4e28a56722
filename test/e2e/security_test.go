package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

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
		{"ForgedAssignmentRejected", testSecurityForgedAssignmentRejected},
		{"AgentStalled", testSecurityAgentStalled},
		{"AgentKilledBeforeCreate", testSecurityAgentKilled},
		{"ContainerdRestartDuringCreate", testSecurityContainerdRestartDuringCreate},
		{"HostPathGPUDevice", testSecurityHostPathDevice},
		{"CDIAnnotationPassthrough", testSecurityCDIAnnotationPassthrough},
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

// initPod is a share pod whose init container sleeps for a while: the kubelet's Allocate is done
// once the init container runs, and the share container is created only after it ends, so a fault
// injected meanwhile falls between Allocate and CreateContainer. It waits for the init container.
func initPod(t *testing.T, c *Cluster, name string, sleep int) {
	t.Helper()
	p := TestPod(name, map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "2Gi", api.ResourceShareCores: "10"}, nil)
	p.Spec.RestartPolicy = corev1.RestartPolicyAlways
	p.Spec.InitContainers = []corev1.Container{{Name: "wait", Image: "docker.io/library/bbox:latest", ImagePullPolicy: corev1.PullNever,
		Command: []string{"sh", "-c", fmt.Sprintf("sleep %d", sleep)}}}
	c.CreatePod(t, p)
	if err := waitFor(time.Minute, 100*time.Millisecond, func() (bool, error) {
		for _, cs := range c.Pod(t, name).Status.InitContainerStatuses {
			if cs.State.Running != nil {
				return true, nil
			}
		}
		return false, fmt.Errorf("init container not running")
	}); err != nil {
		t.Fatalf("%v\n%s", err, c.Describe(t, name))
	}
}

// checkRealised checks the pod's share container got its GPU and vcuda, then deletes the pod.
func checkRealised(t *testing.T, c *Cluster, name string) {
	t.Helper()
	c.WaitRunning(t, 3*time.Minute, name)
	out := c.MustExec(t, name, "cat /etc/ld.so.preload; ls /dev")
	if !strings.Contains(out, "libvcuda") || len(deviceNodes(out)) != 1 {
		t.Errorf("%s: the retried container is not realised:\n%s", name, out)
	}
	c.DeletePods(t, name)
}

// The agent stalls (SIGSTOP) past NRI's 2 s timeout between Allocate and CreateContainer: NRI drops
// the plugin and would create the container unrealised, but the realisation hook in the CDI spec
// refuses it. After SIGCONT the plugin reconnects and the kubelet's retry succeeds.
func testSecurityAgentStalled(t *testing.T, c *Cluster) {
	initPod(t, c, "stalled", 6)
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
	msg := waitContainerError(t, c, "stalled", "did not realise it")
	t.Logf("refused while the agent was stalled: %s", msg)
	syscall.Kill(pid, syscall.SIGCONT)
	stopped = false
	c.WaitAgentReady(t)
	checkRealised(t, c, "stalled")
}

// The agent is killed between Allocate and CreateContainer: the container is refused (hook) while
// it is gone; once it is back (ledger intact) the kubelet's retry succeeds.
func testSecurityAgentKilled(t *testing.T, c *Cluster) {
	initPod(t, c, "orphan", 4)
	c.Agent.Kill(t)
	msg := waitContainerError(t, c, "orphan", "did not realise it")
	t.Logf("refused while the agent was down: %s", msg)
	c.Agent.Start(t)
	c.WaitAgentReady(t)
	checkRealised(t, c, "orphan")
}

// containerd goes down while the kubelet is about to create the share container and comes back:
// the plugin reconnects (Synchronize) and the container is created realised.
func testSecurityContainerdRestartDuringCreate(t *testing.T, c *Cluster) {
	initPod(t, c, "crestart", 3)
	c.Ctr.Stop(t)
	time.Sleep(4 * time.Second) // the init container ends while containerd is down
	c.Ctr.Start(t)
	c.WaitAgentReady(t)
	c.Kubelet.WaitReady(t)
	checkRealised(t, c, "crestart")
}

// forgedAssignmentPolicy applies the chart's ValidatingAdmissionPolicy, with the e2e extender's
// user name as the assignment writer, and waits until the API server enforces it.
func testSecurityForgedAssignmentRejected(t *testing.T, c *Cluster) {
	manifest, err := helm(t, "template", "tessera", helmChart(), "--namespace", "tessera-system", "-s", "templates/admission.yaml",
		"--set", "admission.assignmentWriters={tessera-extender}")
	if err != nil {
		t.Fatalf("helm template: %v\n%s", err, manifest)
	}
	if out, err := c.KubectlStdin(t, manifest, "apply", "-f", "-"); err != nil {
		t.Fatalf("kubectl apply: %v\n%s", err, out)
	}
	g := c.Inventory.GPUs[0]
	forged, _ := api.EncodeAssignment(&api.PodAssignment{APIVersion: api.Version, Node: c.Node,
		Containers: []api.ContainerAssignment{{Name: "main", Devices: []api.DeviceAssignment{{UUID: g.UUID, Whole: true}}}}})
	var msg string
	if err := waitFor(time.Minute, 500*time.Millisecond, func() (bool, error) {
		_, err := c.CP.Client.CoreV1().Pods("default").Create(context.Background(),
			TestPod("forged-vap", map[string]string{api.ResourceGPU: "1"}, map[string]string{api.AnnotationAssignment: string(forged)}), metav1.CreateOptions{})
		if err == nil {
			c.DeletePods(t, "forged-vap")
			return false, fmt.Errorf("pod with a forged assignment was admitted")
		}
		msg = err.Error()
		return strings.Contains(msg, "only tessera-extender may set or change the tessera.dev/assignment annotation"), err
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("rejected: %s", msg)
	p := TestPod("forged-label", nil, nil)
	p.Labels = map[string]string{api.LabelAssignedNode: c.Node}
	if _, err := c.CP.Client.CoreV1().Pods("default").Create(context.Background(), p, metav1.CreateOptions{}); err == nil ||
		!strings.Contains(err.Error(), "tessera.dev/assigned-node label") {
		t.Errorf("pod with the assigned-node label: %v", err)
	}
	// The extender still writes assignments: a share pod is bound and realised.
	c.CreatePod(t, TestPod("after-policy", map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "1Gi"}, nil))
	c.WaitRunning(t, 2*time.Minute, "after-policy")
	if a := c.Assignment(t, c.Pod(t, "after-policy")); a == nil {
		t.Error("the extender's assignment is missing")
	}
	c.DeletePods(t, "after-policy")
}

// A hostPath volume of a GPU's device node under another name is refused by its number.
func testSecurityHostPathDevice(t *testing.T, c *Cluster) {
	host := filepath.Join(c.Dir, "sim", "root", "dev", "nvidia3")
	p := TestPod("hostdev", nil, nil)
	cd := corev1.HostPathCharDev
	p.Spec.Volumes = []corev1.Volume{{Name: "gpu", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: host, Type: &cd}}}}
	p.Spec.Containers[0].VolumeMounts = []corev1.VolumeMount{{Name: "gpu", MountPath: "/dev/gpu3"}}
	c.CreatePod(t, p)
	msg := waitContainerError(t, c, "hostdev", "/dev/gpu3 (195:")
	t.Logf("refused: %s", msg)
	c.DeletePods(t, "hostdev")
}

// A CDI annotation on the pod, passed through to the OCI spec by the runtime (for a runtime that
// resolves CDI itself, after NRI), is refused.
func testSecurityCDIAnnotationPassthrough(t *testing.T, c *Cluster) {
	g := c.Inventory.GPUs[5]
	c.CreatePod(t, TestPod("cdi-ann", nil, map[string]string{"cdi.k8s.io/evil": "tessera.dev/gpu=" + g.UUID}))
	msg := waitContainerError(t, c, "cdi-ann", "cdi.k8s.io/evil")
	t.Logf("refused: %s", msg)
	c.DeletePods(t, "cdi-ann")
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
