package main

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net/http/httptest"
	"os"
	"slices"
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
	"github.com/tessera-gpu/tessera/internal/dra"
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
	registerStateCollectors(reg, state, hamiNames{current: true, legacy: true})
	m.observeCreate(nil, nil, 2*time.Millisecond, nil)
	m.observeCreate(nil, nil, 3*time.Millisecond, errors.New("over-commit"))
	m.observeAllocate(api.ResourceShare, time.Millisecond, nil)
	m.observeDRA(dra.CallPrepare, time.Millisecond, nil)
	m.observeDRA(dra.CallPrepare, time.Millisecond, errors.New("over-commit"))
	m.observeDRA(dra.CallUnprepare, time.Millisecond, nil)

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
		return `UUID="` + g.UUID + `",device="nvidia` + strconv.Itoa(g.Minor) + `",gpu="` + strconv.Itoa(g.Index) + `",hostname="n",modelName="NVIDIA A100-SXM4-40GB"`
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
		`tessera_container_gpu_allocated_memory_bytes{UUID="` + g2.UUID + `",container="main",device_uuid="` + g2.UUID + `",gpu="2",hostname="n",mode="whole",namespace="ns",pod="w"} 4.294967296e+10`,
		`tessera_container_gpu_memory_used_bytes{UUID="` + g1.UUID + `",container="main",gpu="1",hostname="n",namespace="ns",pod="p"} 1.073741824e+09`,
		`tessera_container_gpu_throttled_seconds_total{UUID="` + g1.UUID + `",container="main",gpu="1",hostname="n",namespace="ns",pod="p"} 1.5`,
		`tessera_container_gpu_oom_events_total{UUID="` + g1.UUID + `",container="main",gpu="1",hostname="n",namespace="ns",pod="p"} 2`,
		// The info series that joins dcgm-exporter's on UUID: one per container and GPU, whole or share.
		`tessera_container_gpu_info{GPU_I_ID="",GPU_I_PROFILE="",UUID="` + g2.UUID + `",container="main",device_uuid="` + g2.UUID + `",gpu="2",hostname="n",mode="whole",namespace="ns",pod="w"} 1`,
		`tessera_container_gpu_info{GPU_I_ID="",GPU_I_PROFILE="",UUID="` + g1.UUID + `",container="main",device_uuid="` + g1.UUID + `",gpu="1",hostname="n",mode="share",namespace="ns",pod="p"} 1`,
		"\ntessera_ledger_entries 2\n",
		`tessera_nri_create_container_duration_seconds_count{result="ok"} 1`,
		`tessera_nri_create_container_duration_seconds_count{result="refused"} 1`,
		`tessera_nri_create_container_duration_seconds_bucket{result="refused",le="0.005"} 1`,
		`tessera_deviceplugin_allocate_duration_seconds_count{resource="tessera.dev/vgpu",result="ok"} 1`,
		`tessera_dra_prepare_duration_seconds_count{result="ok"} 1`,
		`tessera_dra_prepare_duration_seconds_count{result="error"} 1`,
		`tessera_dra_unprepare_duration_seconds_count{result="ok"} 1`,
		`tessera_node_build_info{`,
		`go_goroutines `,
		// HAMi's current names and labels (v2.10).
		`hami_gpu_memory_limit_bytes{device_index="1",device_type="NVIDIA-NVIDIA A100-SXM4-40GB",device_uuid="` + g1.UUID + `",node="n"} 4.294967296e+10`,
		`hami_gpu_core_limit_ratio{device_index="1",device_type="NVIDIA-NVIDIA A100-SXM4-40GB",device_uuid="` + g1.UUID + `",node="n"} 100`,
		`hami_gpu_memory_allocated_bytes{device_cores="100",device_index="1",device_type="NVIDIA-NVIDIA A100-SXM4-40GB",device_uuid="` + g1.UUID + `",node="n"} 3.221225472e+09`,
		`hami_gpu_core_allocated_ratio{device_index="1",device_type="NVIDIA-NVIDIA A100-SXM4-40GB",device_uuid="` + g1.UUID + `",node="n"} 25`,
		`hami_gpu_core_allocated_ratio{device_index="2",device_type="NVIDIA-NVIDIA A100-SXM4-40GB",device_uuid="` + g2.UUID + `",node="n"} 100`,
		`hami_gpu_shared_count{device_index="1",device_type="NVIDIA-NVIDIA A100-SXM4-40GB",device_uuid="` + g1.UUID + `",node="n"} 1`,
		`hami_node_gpu_overview{device_cores="100",device_index="1",device_memory_limit="40960",device_type="NVIDIA-NVIDIA A100-SXM4-40GB",device_uuid="` + g1.UUID + `",node="n"} 3.221225472e+09`,
		`hami_node_gpu_memory_allocated_ratio{device_index="1",device_type="NVIDIA-NVIDIA A100-SXM4-40GB",device_uuid="` + g1.UUID + `",node="n"} 0.075`,
		`hami_vgpu_memory_used_bytes{container="main",device_uuid="` + g1.UUID + `",namespace="ns",pod="p",vdevice_index="0"} 1.073741824e+09`,
		`hami_vgpu_memory_limit_bytes{container="main",device_uuid="` + g1.UUID + `",namespace="ns",pod="p",vdevice_index="0"} 3.221225472e+09`,
		`hami_container_device_memory_bytes{container="main",device_uuid="` + g1.UUID + `",namespace="ns",pod="p",vdevice_index="0"} 1.073741824e+09`,
		// HAMi's legacy names and labels.
		`GPUDeviceMemoryAllocated{devicecores="100",deviceidx="1",devicetype="NVIDIA-NVIDIA A100-SXM4-40GB",deviceuuid="` + g1.UUID + `",nodeid="n"} 3.221225472e+09`,
		`GPUDeviceSharedNum{deviceidx="1",devicetype="NVIDIA-NVIDIA A100-SXM4-40GB",deviceuuid="` + g1.UUID + `",nodeid="n"} 1`,
		`vGPU_device_memory_usage_in_bytes{ctrname="main",deviceuuid="` + g1.UUID + `",podname="p",podnamespace="ns",vdeviceid="0"} 1.073741824e+09`,
		`vGPU_device_memory_limit_in_bytes{ctrname="main",deviceuuid="` + g1.UUID + `",podname="p",podnamespace="ns",vdeviceid="0"} 3.221225472e+09`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	if n := strings.Count(out, "\ntessera_container_gpu_info{"); n != 2 {
		t.Errorf("%d tessera_container_gpu_info series, want one per container and GPU (2)", n)
	}
	if t.Failed() {
		t.Log(out)
	}
}

// HAMi's names double the node's series: the agent serves its current hami_* names only with
// --hami-metrics and its legacy ones only with --hami-legacy-metrics, never by default, and each
// flag brings its own set alone.
func TestHAMiMetricsOnlyOnRequest(t *testing.T) {
	a, share := metricsAgent(t)
	g1 := a.Inventory().GPUs[1]
	state := &nodeState{node: "n", agent: a, regions: func() []containerUsage {
		return []containerUsage{{entry: share, gpus: []vcuda.RegionGPU{{UUID: g1.UUID, MemCap: 3 << 30, Cores: 25, Used: 1 << 30}}}}
	}}
	current := []string{"hami_gpu_memory_limit_bytes{", "hami_gpu_memory_allocated_bytes{", "hami_vgpu_memory_used_bytes{", "hami_vgpu_memory_limit_bytes{"}
	legacy := []string{"GPUDeviceMemoryLimit{", "GPUDeviceMemoryAllocated{", "vGPU_device_memory_usage_in_bytes{", "vGPU_device_memory_limit_in_bytes{"}
	for _, hami := range []hamiNames{{}, {current: true}, {legacy: true}, {current: true, legacy: true}} {
		reg := prometheus.NewRegistry()
		registerStateCollectors(reg, state, hami)
		out := scrape(t, reg)
		if !strings.Contains(out, "tessera_gpu_memory_bytes{") {
			t.Fatalf("%+v: Tessera's own series missing:\n%s", hami, out)
		}
		for _, name := range append(slices.Clone(current), legacy...) {
			want := hami.legacy
			if slices.Contains(current, name) {
				want = hami.current
			}
			if got := strings.Contains(out, "\n"+name); got != want {
				t.Errorf("%+v: %s served: %v", hami, strings.TrimSuffix(name, "{"), got)
			}
		}
	}
	// The flags reach the config: off unless set.
	for _, args := range [][]string{nil, {"--hami-metrics"}, {"--hami-legacy-metrics"}} {
		cfg, err := loadRunFlags(t, args...)
		if err != nil {
			t.Fatal(err)
		}
		want := hamiNames{current: slices.Contains(args, "--hami-metrics"), legacy: slices.Contains(args, "--hami-legacy-metrics")}
		if got := (hamiNames{current: cfg.HAMiMetrics, legacy: cfg.HAMiLegacyMetrics}); got != want {
			t.Errorf("flags %q: %+v, want %+v", args, got, want)
		}
	}
}

// The agent verifies its ledger against the first inventory and counts what it left out: here an
// entry on a GPU this node does not have (Open, knowing no inventory, loaded it).
func TestSecurityLedgerRefusedCounted(t *testing.T) {
	a, _ := metricsAgent(t)
	l := a.Ledger()
	gone := ledger.Entry{ContainerID: "c3", Namespace: "ns", Pod: "q", Container: "main",
		Devices: []api.DeviceAssignment{{UUID: "GPU-ffffffff-0000-4000-8000-ffffffffffff", Whole: true}}}
	if err := l.Reserve(gone, nil); err != nil {
		t.Fatal(err)
	}
	reg := telemetry.NewRegistry("tessera-node")
	m := newNodeMetrics(reg)
	if out := scrape(t, reg); !strings.Contains(out, "\ntessera_ledger_entries_refused_total 0\n") {
		t.Errorf("the counter is not exposed before any refusal: %s", out)
	}
	if err := m.verifyLedger(l, a.Inventory(), nil); err != nil {
		t.Fatal(err)
	}
	if _, held := l.Get("c3"); held || len(l.Entries()) != 2 {
		t.Errorf("the entry on a missing GPU is still held (%d entries)", len(l.Entries()))
	}
	if out := scrape(t, reg); !strings.Contains(out, "\ntessera_ledger_entries_refused_total 1\n") {
		t.Errorf("the refused entry is not counted: %s", out)
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

// regionFile is a vcuda region image (src/region.h's layout) with one GPU record of gpuSize bytes
// ending the file and no process slots.
func regionFile(uuid string, memCap, used uint64, gpuSize uint32) []byte {
	b := make([]byte, 4096+gpuSize)
	le := binary.LittleEndian
	le.PutUint64(b[0:], vcuda.RegionMagic)
	le.PutUint32(b[8:], vcuda.RegionVersion)
	le.PutUint32(b[12:], 4096)
	le.PutUint64(b[16:], uint64(len(b)))
	le.PutUint32(b[24:], 1)
	for i, v := range []uint32{4096, gpuSize, 4096, 576} {
		le.PutUint32(b[32+4*i:], v)
	}
	copy(b[4096:], uuid)
	le.PutUint64(b[4096+48:], memCap)
	le.PutUint64(b[4096+64:], used)
	return b
}

// TestSecurityCraftedRegionMetrics: a share container that crafts its region (a GPU record too
// short for what is read of it, which panicked the reader and blanked /metrics) loses only its own
// usage series: the other containers' are scraped, the refusal is counted at every read and logged
// once.
func TestSecurityCraftedRegionMetrics(t *testing.T) {
	a, share := metricsAgent(t)
	g1 := a.Inventory().GPUs[1]
	evil := ledger.Entry{ContainerID: "c3", Namespace: "ns", Pod: "evil", Container: "main",
		Devices: []api.DeviceAssignment{{UUID: g1.UUID, MemoryBytes: 1 << 30, CoresPercent: 25}}}
	if err := a.Ledger().Reserve(evil, a.Inventory()); err != nil {
		t.Fatal(err)
	}
	images := map[string][]byte{share.ContainerID: regionFile(g1.UUID, 3<<30, 1<<30, 256), evil.ContainerID: regionFile(g1.UUID, 1<<30, 0, 224)}
	read := func(id string) ([]byte, error) {
		if b, ok := images[id]; ok {
			return b, nil
		}
		return nil, os.ErrNotExist
	}
	var logged bytes.Buffer
	reg := prometheus.NewRegistry()
	m := newNodeMetrics(reg)
	bad := &badRegions{total: m.badRegions, log: slog.New(slog.NewTextHandler(&logged, nil))}
	state := &nodeState{node: "n", agent: a, regions: func() []containerUsage { return readContainerRegions(a, read, bad) }}
	registerStateCollectors(reg, state, hamiNames{legacy: true})
	var out string
	for range 2 {
		out = scrape(t, reg)
	}
	for _, want := range []string{
		`tessera_container_gpu_memory_used_bytes{UUID="` + g1.UUID + `",container="main",gpu="1",hostname="n",namespace="ns",pod="p"} 1.073741824e+09`,
		`vGPU_device_memory_limit_in_bytes{ctrname="main",deviceuuid="` + g1.UUID + `",podname="p",podnamespace="ns",vdeviceid="0"} 3.221225472e+09`,
		`tessera_container_gpu_allocated_memory_bytes{UUID="` + g1.UUID + `",container="main",device_uuid="` + g1.UUID + `",gpu="1",hostname="n",mode="share",namespace="ns",pod="evil"} 1.073741824e+09`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	if strings.Contains(out, `tessera_container_gpu_memory_used_bytes{UUID="`+g1.UUID+`",container="main",gpu="1",hostname="n",namespace="ns",pod="evil"}`) {
		t.Error("the crafted region's usage was exported")
	}
	if n := testutil.ToFloat64(m.badRegions); n != 4 { // two collectors read the regions at each of two scrapes
		t.Errorf("tessera_container_region_errors_total = %v, want 4", n)
	}
	if n := strings.Count(logged.String(), "vcuda region refused"); n != 1 || !strings.Contains(logged.String(), "pod=evil") ||
		!strings.Contains(logged.String(), "gpu record size 224") {
		t.Errorf("want the refusal logged once, naming the pod and the field:\n%s", logged.String())
	}
	if t.Failed() {
		t.Log(out)
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

// A container's MIG instance is named as dcgm-exporter names its series: the parent GPU's UUID and
// the instance's GPU instance id and profile (GPU_I_ID, GPU_I_PROFILE), so the two join on them.
func TestContainerGPUInfoMIG(t *testing.T) {
	a, _ := metricsAgent(t)
	inv := a.Inventory()
	var parent *api.GPU
	for i := range inv.GPUs {
		if inv.GPUs[i].MIG != nil && len(inv.GPUs[i].MIG.Instances) > 0 {
			parent = &inv.GPUs[i]
		}
	}
	if parent == nil {
		t.Fatal("the simulated node has no MIG instance")
	}
	in := parent.MIG.Instances[0]
	if err := a.Ledger().Reserve(ledger.Entry{ContainerID: "c-mig", Namespace: "ns", Pod: "m", Container: "main", MIG: []string{in.UUID}}, inv); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	registerStateCollectors(reg, &nodeState{node: "n", agent: a, regions: func() []containerUsage { return nil }}, hamiNames{})
	out := scrape(t, reg)
	want := `tessera_container_gpu_info{GPU_I_ID="` + strconv.Itoa(in.GPUInstanceID) + `",GPU_I_PROFILE="` + in.Profile + `",UUID="` + parent.UUID +
		`",container="main",device_uuid="` + in.UUID + `",gpu="` + strconv.Itoa(parent.Index) + `",hostname="n",mode="mig",namespace="ns",pod="m"} 1`
	if !strings.Contains(out, want) {
		t.Errorf("metrics lack %s\n%s", want, out)
	}
}
