package main

import (
	"errors"
	"io"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"k8s.io/client-go/tools/record"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/agent"
	"github.com/tessera-gpu/tessera/internal/ledger"
	"github.com/tessera-gpu/tessera/internal/telemetry"
	"github.com/tessera-gpu/tessera/internal/testing/simagent"
	"github.com/tessera-gpu/tessera/vcuda"
)

// metricsAgent is a simulated node with one share container (3 GiB, 25%) on GPU 1 and one whole
// GPU 2.
func metricsAgent(t *testing.T) (*agent.Agent, *ledger.Entry) {
	a, _ := simagent.New(t, t.TempDir(), agent.Config{NodeName: "n", SharesPerGPU: 4})
	l := a.Ledger()
	inv := a.Inventory()
	share := ledger.Entry{ContainerID: "c1", Namespace: "ns", Pod: "p", Container: "main",
		Devices: []api.DeviceAssignment{{UUID: inv.GPUs[1].UUID, MemoryBytes: 3 << 30, CoresPercent: 25}}}
	for _, e := range []ledger.Entry{share, {ContainerID: "c2", Namespace: "ns", Pod: "w", Container: "main",
		Devices: []api.DeviceAssignment{{UUID: inv.GPUs[2].UUID, Whole: true}}}} {
		if err := l.Reserve(e, inv); err != nil {
			t.Fatal(err)
		}
	}
	return a, &share
}

// scrape serves reg like the agent does and returns the text exposition.
func scrape(t *testing.T, reg *prometheus.Registry) string {
	srv := httptest.NewServer(telemetry.MetricsHandler(reg))
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func TestMetrics(t *testing.T) {
	a, share := metricsAgent(t)
	g1, g2 := a.Inventory().GPUs[1], a.Inventory().GPUs[2]
	state := &nodeState{node: "n", agent: a, regions: func() []containerUsage {
		return []containerUsage{{entry: share, gpus: []vcuda.RegionGPU{{UUID: g1.UUID, MemCap: 3 << 30, Cores: 25, Used: 1 << 30, ThrottledNs: 1.5e9, OOMEvents: 2}}}}
	}}
	reg := telemetry.NewRegistry("tessera-node")
	m := newNodeMetrics(reg)
	reg.MustRegister(&stateCollector{state}, &hamiCollector{state})
	m.observeCreate(nil, nil, 2*time.Millisecond, nil)
	m.observeCreate(nil, nil, 3*time.Millisecond, errors.New("over-commit"))
	m.observeAllocate(api.ResourceShare, time.Millisecond, nil)

	// Tessera's own names follow the Prometheus conventions (HAMi's are HAMi's); the camelCase label
	// names are dcgm-exporter's, kept so the series join.
	problems, err := testutil.CollectAndLint(&stateCollector{state})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		if !strings.Contains(p.Text, "camelCase") {
			t.Errorf("metric lint: %s: %s", p.Metric, p.Text)
		}
	}
	out := scrape(t, reg)
	dcgm := func(g api.GPU) string {
		return `Hostname="n",UUID="` + g.UUID + `",device="nvidia` + strconv.Itoa(g.Minor) + `",gpu="` + strconv.Itoa(g.Index) + `",modelName="NVIDIA A100-SXM4-40GB"`
	}
	for _, want := range []string{
		`tessera_gpu_memory_bytes{` + dcgm(g1) + `} 4.294967296e+10`,
		`tessera_gpu_allocated_shares{` + dcgm(g1) + `} 1`,
		`tessera_gpu_allocated_memory_bytes{` + dcgm(g1) + `} 3.221225472e+09`,
		`tessera_gpu_allocated_compute_ratio{` + dcgm(g1) + `} 0.25`,
		`tessera_gpu_allocated_compute_ratio{` + dcgm(g2) + `} 1`,
		`tessera_gpu_mode{` + strings.Replace(dcgm(g2), "modelName", `mode="whole",modelName`, 1) + `} 1`,
		`tessera_gpu_mode{` + strings.Replace(dcgm(g1), "modelName", `mode="shared",modelName`, 1) + `} 1`,
		`tessera_gpu_healthy{` + dcgm(g1) + `} 1`,
		`tessera_container_gpu_allocated_memory_bytes{Hostname="n",UUID="` + g2.UUID + `",container="main",device_uuid="` + g2.UUID + `",gpu="2",mode="whole",namespace="ns",pod="w"} 4.294967296e+10`,
		`tessera_container_gpu_memory_used_bytes{Hostname="n",UUID="` + g1.UUID + `",container="main",gpu="1",namespace="ns",pod="p"} 1.073741824e+09`,
		`tessera_container_gpu_throttled_seconds_total{Hostname="n",UUID="` + g1.UUID + `",container="main",gpu="1",namespace="ns",pod="p"} 1.5`,
		`tessera_container_gpu_oom_events_total{Hostname="n",UUID="` + g1.UUID + `",container="main",gpu="1",namespace="ns",pod="p"} 2`,
		"\ntessera_ledger_entries 2\n",
		`tessera_nri_create_container_duration_seconds_count{result="ok"} 1`,
		`tessera_nri_create_container_duration_seconds_count{result="refused"} 1`,
		`tessera_nri_create_container_duration_seconds_bucket{result="refused",le="0.005"} 1`,
		`tessera_deviceplugin_allocate_duration_seconds_count{resource="tessera.dev/vgpu",result="ok"} 1`,
		`tessera_node_build_info{`,
		`go_goroutines `,
		// HAMi's names and labels.
		`GPUDeviceMemoryAllocated{devicecores="25",deviceidx="1",devicetype="NVIDIA-NVIDIA A100-SXM4-40GB",deviceuuid="` + g1.UUID + `",nodeid="n"} 3.221225472e+09`,
		`GPUDeviceSharedNum{deviceidx="1",devicetype="NVIDIA-NVIDIA A100-SXM4-40GB",deviceuuid="` + g1.UUID + `",nodeid="n"} 1`,
		`vGPU_device_memory_usage_in_bytes{ctrname="main",deviceuuid="` + g1.UUID + `",podname="p",podnamespace="ns",vdeviceid="0"} 1.073741824e+09`,
		`vGPU_device_memory_limit_in_bytes{ctrname="main",deviceuuid="` + g1.UUID + `",podname="p",podnamespace="ns",vdeviceid="0"} 3.221225472e+09`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	if t.Failed() {
		t.Log(out)
	}
}

// TestMetricsEscaping: label values are escaped as the exposition format says (a quote and a
// backslash in a pod name), not as Go's %q would.
func TestMetricsEscaping(t *testing.T) {
	a, share := metricsAgent(t)
	odd := *share
	odd.Pod = `we"ird\pod` + "\u00e9"
	state := &nodeState{node: "n", agent: a, regions: func() []containerUsage {
		return []containerUsage{{entry: &odd, gpus: []vcuda.RegionGPU{{UUID: share.Devices[0].UUID, Used: 1}}}}
	}}
	reg := prometheus.NewRegistry()
	reg.MustRegister(&stateCollector{state})
	if out := scrape(t, reg); !strings.Contains(out, `pod="we\"ird\\pod`+"\u00e9"+`"`) {
		t.Errorf("pod label not escaped per the exposition format:\n%s", out)
	}
}

// TestRefusalEvents: a refused container puts a Warning Event on its pod, with the reason; an
// admitted one puts none.
func TestRefusalEvents(t *testing.T) {
	rec := record.NewFakeRecorder(2)
	on := refusalEvents(rec)
	pod := &nriapi.PodSandbox{Name: "p", Namespace: "ns", Uid: "u1"}
	on(pod, &nriapi.Container{Name: "main"}, time.Millisecond, nil)
	on(pod, &nriapi.Container{Name: "main"}, time.Millisecond, errors.New("GPU device nodes [/dev/nvidia1] that the kubelet did not grant"))
	select {
	case e := <-rec.Events:
		if want := `Warning GPUContainerRefused container "main" refused by the Tessera node agent: GPU device nodes [/dev/nvidia1] that the kubelet did not grant`; e != want {
			t.Errorf("event %q, want %q", e, want)
		}
	default:
		t.Fatal("no Event for the refused container")
	}
	if len(rec.Events) != 0 {
		t.Errorf("an admitted container got an Event: %q", <-rec.Events)
	}
	refusalEvents(nil)(pod, &nriapi.Container{Name: "main"}, 0, errors.New("x")) // no API server: no Events, no panic
}
