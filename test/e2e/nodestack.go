package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/testing/fakekubelet"
)

// nodeStack is one simulated GPU node: real containerd (NRI + CDI), a real API server, the fake
// kubelet and tessera-node on the built-in simulated 8 x A100 node.
type nodeStack struct {
	ctr     *Containerd
	cp      *ControlPlane
	kubelet *fakekubelet.Kubelet
	agent   *Process
	dir     string
	node    string
	metrics string
	inv     *api.NodeInventory
}

const stackNode = "node-a"

func startNodeStack(t testing.TB) *nodeStack {
	t.Helper()
	s := &nodeStack{node: stackNode}
	s.ctr = StartContainerd(t)
	s.dir = s.ctr.Base
	s.cp = StartControlPlane(t, ControlPlaneOptions{NoScheduler: true})
	s.kubelet = fakekubelet.Start(t, filepath.Join(s.dir, "kubelet", "device-plugins"))
	s.kubelet.ServePodResources(t, filepath.Join(s.dir, "kubelet", "pod-resources.sock"))
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: s.node}}
	if _, err := s.cp.Client.CoreV1().Nodes().Create(context.Background(), node, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	lib := filepath.Join(s.dir, "libvcuda.so")
	if err := os.WriteFile(lib, []byte("stand-in for libvcuda.so\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// Per-container files live on tmpfs, as /run is on a node; containerd's teardown unmounts it.
	runDir := filepath.Join(s.dir, "run-tessera")
	if err := os.MkdirAll(runDir, 0o755); err != nil {
		t.Fatal(err)
	}
	mustRun(t, time.Minute, "mount", "-t", "tmpfs", "-o", "size=64m,mode=0755", "tessera-run", runDir)
	s.metrics = fmt.Sprintf("127.0.0.1:%d", freePort(t))
	s.agent = s.cp.StartProcess(t, "tessera-node", tesseraBinary(t, "tessera-node"), "run",
		"--backend=sim", "--state-dir="+filepath.Join(s.dir, "sim"), "--cdi-dir="+s.ctr.CDIDir,
		"--node-name="+s.node, "--data-dir="+filepath.Join(s.dir, "data"), "--run-dir="+filepath.Join(s.dir, "run-tessera"),
		"--device-plugin-dir="+s.kubelet.PluginDir(), "--pod-resources-socket="+s.kubelet.PodResourcesSocket(),
		"--nri-socket="+s.ctr.NRISocket, "--kubeconfig="+s.cp.Kubeconfig, "--listen="+s.metrics,
		"--vcuda-library="+lib, "--sim-driver-dir="+BuildSimDriver(t).FakeDir)
	s.waitReady(t)
	return s
}

// waitReady waits for the agent's device plugins and its published inventory.
func (s *nodeStack) waitReady(t testing.TB) {
	t.Helper()
	err := waitFor(60*time.Second, 100*time.Millisecond, func() (bool, error) {
		n, err := s.cp.Client.CoreV1().Nodes().Get(context.Background(), s.node, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		raw, ok := n.Annotations[api.AnnotationInventory]
		if !ok || len(s.kubelet.Resources()) < 4 || !s.healthz() {
			return false, nil
		}
		s.inv, err = api.DecodeInventory([]byte(raw))
		return err == nil, err
	})
	if err != nil {
		t.Fatalf("tessera-node did not come up (resources %v): %v\n%s", s.kubelet.Resources(), err, s.agent.LogTail(40))
	}
}

func (s *nodeStack) healthz() bool {
	resp, err := http.Get("http://" + s.metrics + "/healthz")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// metric returns the agent's /metrics text.
func (s *nodeStack) metric(t testing.TB) string {
	t.Helper()
	resp, err := http.Get("http://" + s.metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// ledger returns the agent's persisted ledger file.
func (s *nodeStack) ledger(t testing.TB) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(s.dir, "data", "ledger.json"))
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return string(b)
}

// agentPod is a pod to run on the stack: one container "main" with these limits.
type agentPod struct {
	name        string
	limits      map[string]string
	assignment  *api.PodAssignment
	annotations map[string]string
	// ctrAnnotations go on the CRI container config, where containerd reads cdi.k8s.io/* requests.
	ctrAnnotations map[string]string
}

// runningPod is a pod the stack created.
type runningPod struct {
	name, uid, sandbox, container string
}

// run creates the pod in the API server (bound to the node), lets the fake kubelet allocate its
// devices, and creates the sandbox and container through CRI with the CDI names, as the kubelet
// does. It returns crictl's error output when the container is refused.
func (s *nodeStack) run(t testing.TB, p agentPod) (*runningPod, error) {
	t.Helper()
	ann := map[string]string{}
	for k, v := range p.annotations {
		ann[k] = v
	}
	if p.assignment != nil {
		data, err := json.Marshal(p.assignment)
		if err != nil {
			t.Fatal(err)
		}
		ann[api.AnnotationAssignment] = string(data)
	}
	limits := corev1.ResourceList{}
	for k, v := range p.limits {
		limits[corev1.ResourceName(k)] = resource.MustParse(v)
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: p.name, Namespace: "default", Annotations: ann},
		Spec: corev1.PodSpec{NodeName: s.node, Containers: []corev1.Container{{Name: "main", Image: "bbox",
			Resources: corev1.ResourceRequirements{Limits: limits}}}},
	}
	created, err := s.cp.Client.CoreV1().Pods("default").Create(context.Background(), pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	rp := &runningPod{name: p.name, uid: string(created.UID)}
	var cdiNames []string
	for res, q := range p.limits {
		if res == api.ResourceGPU || res == api.ResourceShare || strings.HasPrefix(res, api.MIGResourcePrefix) || strings.HasPrefix(res, api.MdevResourcePrefix) {
			n := resource.MustParse(q)
			cdiNames = append(cdiNames, s.kubelet.Allocate(t, "default", p.name, "main", res, int(n.Value()))...)
		}
	}
	podJSON := map[string]any{
		"metadata":      map[string]any{"name": p.name, "namespace": "default", "uid": rp.uid, "attempt": 0},
		"log_directory": filepath.Join(s.dir, "podlogs", p.name),
		"annotations":   ann,
		"linux":         map[string]any{"security_context": map[string]any{"namespace_options": map[string]any{"network": 2}}},
	}
	var cdi []map[string]string
	for _, n := range cdiNames {
		cdi = append(cdi, map[string]string{"name": n})
	}
	ctrJSON := map[string]any{
		"metadata":    map[string]any{"name": "main"},
		"image":       map[string]any{"image": "docker.io/library/bbox:latest"},
		"command":     []string{"sh", "-c", "sleep 3600"},
		"log_path":    "main.log",
		"CDI_devices": cdi,
		"annotations": p.ctrAnnotations,
		"linux":       map[string]any{},
	}
	podFile, ctrFile := filepath.Join(s.dir, p.name+"-pod.json"), filepath.Join(s.dir, p.name+"-ctr.json")
	writeJSON(t, podFile, podJSON)
	writeJSON(t, ctrFile, ctrJSON)
	out, err := s.ctr.Crictl(t, "runp", podFile)
	if err != nil {
		t.Fatalf("crictl runp %s: %v\n%s", p.name, err, out)
	}
	rp.sandbox = lastLine(out)
	out, err = s.ctr.Crictl(t, "create", rp.sandbox, ctrFile, podFile)
	if err != nil {
		return rp, fmt.Errorf("%s", out)
	}
	rp.container = lastLine(out)
	if out, err := s.ctr.Crictl(t, "start", rp.container); err != nil {
		t.Fatalf("crictl start %s: %v\n%s", p.name, err, out)
	}
	return rp, nil
}

// exec runs a shell command in the pod's container.
func (s *nodeStack) exec(t testing.TB, p *runningPod, script string) string {
	t.Helper()
	out, err := s.ctr.Crictl(t, "exec", p.container, "sh", "-c", script)
	if err != nil {
		t.Fatalf("exec in %s: %v\n%s", p.name, err, out)
	}
	return out
}

// remove stops and removes the pod through CRI and forgets its grant, as the kubelet would.
func (s *nodeStack) remove(t testing.TB, p *runningPod) {
	t.Helper()
	s.ctr.Crictl(t, "stopp", p.sandbox)
	s.ctr.Crictl(t, "rmp", p.sandbox)
	s.kubelet.Forget("default", p.name)
	s.cp.Client.CoreV1().Pods("default").Delete(context.Background(), p.name, metav1.DeleteOptions{})
}

func writeJSON(t testing.TB, path string, v any) {
	t.Helper()
	data, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.TrimSpace(lines[len(lines)-1])
}

// share is a share assignment for the stack's node.
func (s *nodeStack) assign(devs ...api.DeviceAssignment) *api.PodAssignment {
	return &api.PodAssignment{APIVersion: api.Version, Node: s.node, Containers: []api.ContainerAssignment{{Name: "main", Devices: devs}}}
}
