package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/agent"
)

// publishedHealth is what the node's published inventory (the extenders' view) says of the GPU:
// "healthy", "unhealthy", or why it cannot say.
func (m *MultiNode) publishedHealth(t testing.TB, node, uuid string) string {
	t.Helper()
	n, err := m.CP.Client.CoreV1().Nodes().Get(context.Background(), node, metav1.GetOptions{})
	if err != nil {
		return err.Error()
	}
	inv, err := api.DecodeInventory([]byte(n.Annotations[api.AnnotationInventory]))
	if err != nil {
		return err.Error()
	}
	g := inv.GPUByUUID(uuid)
	switch {
	case g == nil:
		return "not in the inventory"
	case g.Healthy:
		return "healthy"
	}
	return "unhealthy"
}

// gpuHealthMetric is the agent's tessera_gpu_healthy sample for the GPU ("" when there is none).
func gpuHealthMetric(t testing.TB, c *Cluster, uuid string) string {
	t.Helper()
	for _, l := range strings.Split(c.Metrics(t), "\n") {
		if strings.HasPrefix(l, "tessera_gpu_healthy{") && strings.Contains(l, `UUID="`+uuid+`"`) {
			return l[strings.LastIndexByte(l, ' ')+1:]
		}
	}
	return ""
}

// tesseraGPU is one GPU as `kubectl tessera nodes NODE -o json` shows it.
type tesseraGPU struct {
	UUID    string
	Healthy bool
	Holders []struct{ Pod string }
}

// tesseraGPUs runs `kubectl tessera nodes NODE -o json`, what an operator runs to see which pods
// hold which GPU.
func tesseraGPUs(t testing.TB, c *Cluster, node string) map[string]tesseraGPU {
	t.Helper()
	out, err := c.kubectlTessera(t, "nodes", node, "-o", "json")
	if err != nil {
		t.Fatalf("kubectl tessera nodes %s: %v\n%s", node, err, out)
	}
	var list struct {
		Items []struct {
			Status struct {
				GPUs []tesseraGPU `json:"gpus"`
			} `json:"status"`
		} `json:"items"`
	}
	if err := json.Unmarshal([]byte(out), &list); err != nil || len(list.Items) != 1 {
		t.Fatalf("kubectl tessera nodes %s -o json: %v\n%s", node, err, out)
	}
	gpus := map[string]tesseraGPU{}
	for _, g := range list.Items[0].Status.GPUs {
		gpus[g.UUID] = g
	}
	return gpus
}

// testMultiNodeXID: a GPU of the H100 node raises XID 79 (fallen off the bus) every few seconds
// under a running share, as a failing GPU does. Expectation: the agent marks it unhealthy and says
// so where an operator looks: a Warning GPUUnhealthy Event on the Node naming the GPU and the XID,
// tessera_gpu_healthy 0, `kubectl tessera nodes` showing it unhealthy with the share's pod as its
// holder, and the published inventory. The running share keeps running with its cap (the agent
// evicts nothing: what to do with the pod is the operator's call). A new share asking for an H100,
// which placement packs onto the fullest GPU, the failing one, lands on another H100 GPU. When the
// XIDs stop, one quiet health-check interval later the GPU is healthy again (a GPURecovered Event,
// the metric 1), and the next share packs onto it again.
func testMultiNodeXID(t *testing.T, m *MultiNode) {
	h := m.Node(t, NodeH100)
	h100 := m.model(t, NodeH100)
	share := func(name string) {
		h.CreatePod(t, TestPod(name, map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "8Gi", api.ResourceShareCores: "30"},
			map[string]string{api.AnnotationGPUModel: h100}))
	}
	gpuOf := func(pod string) string {
		return h.Assignment(t, h.Pod(t, pod)).Containers[0].Devices[0].UUID
	}
	share("xid-run")
	m.placedOn(t, map[string]string{"xid-run": NodeH100})
	sick := gpuOf("xid-run")
	m.waitHolds(t, NodeH100, "xid-run")

	stop := h.injectXIDs(t, sick)
	defer stop()
	wait := func(what string, cond func() (bool, error)) {
		t.Helper()
		if err := waitFor(2*time.Minute, 500*time.Millisecond, cond); err != nil {
			t.Fatalf("%s: %v\n%s", what, err, h.AgentLogTail(t, 30))
		}
	}
	injected := time.Now()
	wait("the failing GPU unhealthy in the published inventory", func() (bool, error) {
		got := m.publishedHealth(t, NodeH100, sick)
		return got == "unhealthy", fmt.Errorf("the inventory says %s of %s", got, sick)
	})
	t.Logf("%s unhealthy in the inventory %.1fs after the first XID", sick, time.Since(injected).Seconds())
	wait("a GPUUnhealthy Event on the Node", func() (bool, error) {
		ev := h.Events(t, NodeH100, agent.EventGPUUnhealthy)
		return len(ev) > 0 && strings.Contains(ev[len(ev)-1], sick) && strings.Contains(ev[len(ev)-1], "XID 79"), fmt.Errorf("events %v", ev)
	})
	t.Logf("Node event: %s", h.Events(t, NodeH100, agent.EventGPUUnhealthy)[0])
	if got := gpuHealthMetric(t, h, sick); got != "0" {
		t.Errorf("tessera_gpu_healthy for %s is %q, want 0", sick, got)
	}
	g := tesseraGPUs(t, h, NodeH100)[sick]
	if g.Healthy || len(g.Holders) != 1 || g.Holders[0].Pod != "xid-run" {
		t.Errorf("kubectl tessera nodes shows %s as %+v, want unhealthy and held by xid-run", sick, g)
	}
	checkShareCUDA(t, h, "xid-run", 8<<30)

	share("xid-new")
	m.placedOn(t, map[string]string{"xid-new": NodeH100})
	if got := gpuOf("xid-new"); got == sick {
		t.Errorf("xid-new was placed on the unhealthy %s", sick)
	}
	if p := h.Pod(t, "xid-run"); p.DeletionTimestamp != nil {
		t.Errorf("xid-run is being deleted under an unhealthy GPU; the agent evicts nothing")
	}

	stop()
	stopped := time.Now()
	wait("the GPU healthy again", func() (bool, error) {
		got := m.publishedHealth(t, NodeH100, sick)
		return got == "healthy", fmt.Errorf("the inventory says %s of %s", got, sick)
	})
	t.Logf("%s healthy again %.1fs after the last XID", sick, time.Since(stopped).Seconds())
	if ev := h.Events(t, NodeH100, agent.EventGPURecovered); len(ev) == 0 || !strings.Contains(ev[len(ev)-1], sick) {
		t.Errorf("no GPURecovered Event naming %s on the Node: %v", sick, ev)
	}
	if got := gpuHealthMetric(t, h, sick); got != "1" {
		t.Errorf("tessera_gpu_healthy for %s is %q after the recovery, want 1", sick, got)
	}
	// With xid-new gone, the recovered GPU is the fullest H100 again.
	h.DeletePods(t, "xid-new")
	m.waitHeld(t, NodeH100, "xid-new", false)
	share("xid-healed")
	m.placedOn(t, map[string]string{"xid-healed": NodeH100})
	if got := gpuOf("xid-healed"); got != sick {
		t.Errorf("xid-healed was placed on %s, want the recovered (and fullest) %s", got, sick)
	}
}
