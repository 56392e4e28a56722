package main

import (
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"
	"github.com/prometheus/client_golang/prometheus"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/agent"
	"github.com/tessera-gpu/tessera/internal/dra"
	"github.com/tessera-gpu/tessera/internal/ledger"
	"github.com/tessera-gpu/tessera/internal/nri"
	"github.com/tessera-gpu/tessera/internal/telemetry"
	"github.com/tessera-gpu/tessera/vcuda"
)

// Label names (telemetry.GPULabels, telemetry.ContainerLabels: dcgm-exporter's).
var (
	gpuLabels       = telemetry.GPULabels
	containerLabels = telemetry.ContainerLabels
	// HAMi's label sets, for the dashboards written for HAMi's vGPU metrics.
	hamiGPULabels       = []string{"nodeid", "deviceuuid", "deviceidx", "devicetype"}
	hamiContainerLabels = []string{"podnamespace", "podname", "ctrname", "vdeviceid", "deviceuuid"}
	// HAMi's current label sets (since its hami_* names).
	hamiCurrentGPULabels       = []string{"node", "device_uuid", "device_index", "device_type"}
	hamiCurrentContainerLabels = []string{"namespace", "pod", "container", "vdevice_index", "device_uuid"}
)

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(name, help, labels, nil)
}

var (
	gpuMemory       = desc("tessera_gpu_memory_bytes", "Memory of the GPU.", gpuLabels...)
	gpuHealthy      = desc("tessera_gpu_healthy", "1 if the GPU is healthy (no fatal XID).", gpuLabels...)
	gpuMode         = desc("tessera_gpu_mode", "1 for the GPU's current mode: free, whole, shared, mig or mdev.", append(gpuLabels, "mode")...)
	gpuShares       = desc("tessera_gpu_allocated_shares", "tessera.dev/vgpu shares held on the GPU.", gpuLabels...)
	gpuAllocMemory  = desc("tessera_gpu_allocated_memory_bytes", "GPU memory promised to containers: share caps, or all of it when held whole.", gpuLabels...)
	gpuAllocCompute = desc("tessera_gpu_allocated_compute_ratio", "Compute promised to containers, 0 to 1: share caps, or 1 when held whole.", gpuLabels...)
	ctrAllocMemory  = desc("tessera_container_gpu_allocated_memory_bytes", "GPU memory a container holds: its share's cap, or the GPU's memory when whole (MIG: the instance's).", append(containerLabels, "mode", "device_uuid")...)
	ctrAllocCompute = desc("tessera_container_gpu_allocated_compute_ratio", "Compute a container holds, 0 to 1 (0: a share without a compute cap).", append(containerLabels, "mode", "device_uuid")...)
	ctrMemoryUsed   = desc("tessera_container_gpu_memory_used_bytes", "GPU memory the container's processes hold, as vcuda counts it.", containerLabels...)
	ctrMemoryLimit  = desc("tessera_container_gpu_memory_limit_bytes", "The container's GPU memory cap, as vcuda enforces it.", containerLabels...)
	ctrThrottled    = desc("tessera_container_gpu_throttled_seconds_total", "Time the container's kernel launches waited for vcuda's compute limiter.", containerLabels...)
	ctrOOM          = desc("tessera_container_gpu_oom_events_total", "Allocations vcuda refused at the container's memory cap.", containerLabels...)
	ledgerEntries   = desc("tessera_ledger_entries", "Containers holding GPU devices on this node.")
	// ctrInfo names each container's GPUs with dcgm-exporter's own labels (UUID of the physical GPU,
	// GPU_I_ID and GPU_I_PROFILE of a MIG instance), so dcgm-exporter's series join to pods on
	// UUID: its own pod labels come from the kubelet's device IDs, which are Tessera's tokens.
	ctrInfo = desc("tessera_container_gpu_info", "1 for each GPU (or MIG instance) a container holds; joins dcgm-exporter's series to pods on UUID (and GPU_I_ID for MIG).",
		append(containerLabels, "mode", "device_uuid", "GPU_I_ID", "GPU_I_PROFILE")...)
	// HAMi's legacy names (HAMi's --legacy-metrics; Tessera's --hami-legacy-metrics).
	hamiMemLimit      = desc("GPUDeviceMemoryLimit", "HAMi-compatible (legacy): memory of the GPU, in bytes.", hamiGPULabels...)
	hamiCoreLimit     = desc("GPUDeviceCoreLimit", "HAMi-compatible (legacy): compute of the GPU, in percent (100).", hamiGPULabels...)
	hamiMemAllocated  = desc("GPUDeviceMemoryAllocated", "HAMi-compatible (legacy): GPU memory allocated to containers, in bytes.", "nodeid", "deviceuuid", "deviceidx", "devicecores", "devicetype")
	hamiCoreAllocated = desc("GPUDeviceCoreAllocated", "HAMi-compatible (legacy): compute allocated to containers, in percent.", hamiGPULabels...)
	hamiSharedNum     = desc("GPUDeviceSharedNum", "HAMi-compatible (legacy): containers sharing the GPU.", hamiGPULabels...)
	hamiVGPUMemUsage  = desc("vGPU_device_memory_usage_in_bytes", "HAMi-compatible (legacy): GPU memory a container's processes hold.", hamiContainerLabels...)
	hamiVGPUMemLimit  = desc("vGPU_device_memory_limit_in_bytes", "HAMi-compatible (legacy): a container's GPU memory cap.", hamiContainerLabels...)
	// HAMi's current names and labels (HAMi v2.10.0: cmd/scheduler/metrics.go, cmd/vGPUmonitor/metrics.go).
	hamiGPUMemLimit      = desc("hami_gpu_memory_limit_bytes", "HAMi-compatible: memory of the GPU, in bytes.", hamiCurrentGPULabels...)
	hamiGPUCoreLimit     = desc("hami_gpu_core_limit_ratio", "HAMi-compatible: compute of the GPU, in percent (100).", hamiCurrentGPULabels...)
	hamiGPUMemAllocated  = desc("hami_gpu_memory_allocated_bytes", "HAMi-compatible: GPU memory allocated to containers, in bytes.", "node", "device_uuid", "device_index", "device_cores", "device_type")
	hamiGPUCoreAllocated = desc("hami_gpu_core_allocated_ratio", "HAMi-compatible: compute allocated to containers, in percent (0-100).", hamiCurrentGPULabels...)
	hamiGPUSharedCount   = desc("hami_gpu_shared_count", "HAMi-compatible: containers sharing the GPU.", hamiCurrentGPULabels...)
	hamiNodeGPUOverview  = desc("hami_node_gpu_overview", "HAMi-compatible: GPU memory allocated, in bytes, with the GPU's compute (percent) and memory (MiB) as labels.", "node", "device_uuid", "device_index", "device_cores", "device_memory_limit", "device_type")
	hamiNodeGPUMemRatio  = desc("hami_node_gpu_memory_allocated_ratio", "HAMi-compatible: share of the GPU's memory allocated, 0 to 1.", hamiCurrentGPULabels...)
	hamiVGPUMemUsed      = desc("hami_vgpu_memory_used_bytes", "HAMi-compatible: GPU memory a container's processes hold, in bytes.", hamiCurrentContainerLabels...)
	hamiVGPUMemLimitB    = desc("hami_vgpu_memory_limit_bytes", "HAMi-compatible: a container's GPU memory cap, in bytes.", hamiCurrentContainerLabels...)
	hamiCtrDeviceMemory  = desc("hami_container_device_memory_bytes", "HAMi-compatible: GPU memory a container's processes hold, in bytes.", hamiCurrentContainerLabels...)
)

// nodeMetrics are the agent's metrics: its state, read at every scrape, and the latency histograms
// of the calls the kubelet and containerd wait on.
type nodeMetrics struct {
	create     *prometheus.HistogramVec
	allocate   *prometheus.HistogramVec
	prepare    *prometheus.HistogramVec
	unprepare  *prometheus.HistogramVec
	badRegions prometheus.Counter
	// ledgerRefused counts the ledger entries Verify left out against the first inventory.
	ledgerRefused prometheus.Counter
}

func newNodeMetrics(reg prometheus.Registerer) *nodeMetrics {
	m := &nodeMetrics{
		create: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "tessera_nri_create_container_duration_seconds", Buckets: telemetry.LatencyBuckets,
			Help: "Time the NRI plugin took for CreateContainer; result is ok or refused.",
		}, []string{"result"}),
		allocate: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "tessera_deviceplugin_allocate_duration_seconds", Buckets: telemetry.LatencyBuckets,
			Help: "Time a kubelet Allocate call took, per resource; result is ok or error.",
		}, []string{"resource", "result"}),
		prepare: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "tessera_dra_prepare_duration_seconds", Buckets: telemetry.LatencyBuckets,
			Help: "Time the DRA plugin took to prepare one ResourceClaim (NodePrepareResources); result is ok or error.",
		}, []string{"result"}),
		unprepare: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "tessera_dra_unprepare_duration_seconds", Buckets: telemetry.LatencyBuckets,
			Help: "Time the DRA plugin took to unprepare one ResourceClaim (NodeUnprepareResources); result is ok or error.",
		}, []string{"result"}),
		badRegions: prometheus.NewCounter(prometheus.CounterOpts{Name: "tessera_container_region_errors_total",
			Help: "Reads of a share container's accounting region that failed its checks (damaged or crafted); that container's usage series are left out."}),
		ledgerRefused: prometheus.NewCounter(prometheus.CounterOpts{Name: "tessera_ledger_entries_refused_total",
			Help: "Ledger entries left out at start because they are impossible on this node's GPUs (a GPU not here, memory or shares over-committed); each is logged and the ledger copied aside."}),
	}
	reg.MustRegister(m.create, m.allocate, m.prepare, m.unprepare, m.badRegions, m.ledgerRefused)
	return m
}

// verifyLedger checks the ledger loaded at start against the first inventory (ledger.Verify) and
// counts what it left out.
func (m *nodeMetrics) verifyLedger(l *ledger.Ledger, inv *api.NodeInventory, log *slog.Logger) error {
	refused, err := l.Verify(inv, log)
	m.ledgerRefused.Add(float64(len(refused)))
	return err
}

// observeCreate is the NRI plugin's OnCreate hook (metrics part).
func (m *nodeMetrics) observeCreate(_ *nriapi.PodSandbox, _ *nriapi.Container, took time.Duration, refusal error) {
	result := "ok"
	if refusal != nil {
		result = "refused"
	}
	m.create.WithLabelValues(result).Observe(took.Seconds())
}

// observeAllocate is the device plugins' ObserveAllocate hook.
func (m *nodeMetrics) observeAllocate(resource string, took time.Duration, err error) {
	m.allocate.WithLabelValues(resource, telemetry.Result(err)).Observe(took.Seconds())
}

// hamiNames says which of HAMi's metric names the agent also serves: its current hami_* names
// (--hami-metrics) and its legacy ones (--hami-legacy-metrics). Each set doubles the node's series,
// so neither is served by default.
type hamiNames struct{ current, legacy bool }

// registerStateCollectors registers the collectors that present the node's state: Tessera's own
// metrics, and HAMi's names only as hami asks.
func registerStateCollectors(reg prometheus.Registerer, state *nodeState, hami hamiNames) {
	reg.MustRegister(&stateCollector{state})
	if hami.current || hami.legacy {
		reg.MustRegister(&hamiCollector{state, hami})
	}
}

// observeDRA is the DRA plugin's Observe hook: one observation per claim prepared or unprepared.
func (m *nodeMetrics) observeDRA(call string, took time.Duration, err error) {
	h := m.prepare
	if call == dra.CallUnprepare {
		h = m.unprepare
	}
	h.WithLabelValues(telemetry.Result(err)).Observe(took.Seconds())
}

// nodeState reads the inventory, the ledger and vcuda's accounting regions at every scrape, so a
// scrape always shows the state as it is. Two collectors present it: Tessera's own metrics and the
// HAMi-compatible ones.
type nodeState struct {
	node    string
	agent   *agent.Agent
	regions func() []containerUsage
}

// gpuRow is one GPU with what is promised on it.
type gpuRow struct {
	gpu     *api.GPU
	usage   ledger.Usage
	memory  float64 // bytes promised: share caps, or all of it when whole
	cores   float64 // percent promised: share caps, or 100 when whole
	holders int     // containers holding it whole or in shares
	mode    string
}

func (s *nodeState) gpus(entries []ledger.Entry) []gpuRow {
	inv := s.agent.Inventory()
	usage := s.agent.Ledger().Usage()
	rows := make([]gpuRow, 0, len(inv.GPUs))
	for i := range inv.GPUs {
		g := &inv.GPUs[i]
		u := usage[g.UUID]
		r := gpuRow{gpu: g, usage: u, memory: float64(u.MemoryBytes), cores: float64(u.Cores), mode: gpuModeOf(g, u), holders: holders(entries, g.UUID)}
		if u.Whole {
			r.memory, r.cores = float64(g.MemoryBytes), 100
		}
		rows = append(rows, r)
	}
	return rows
}

// stateCollector presents the node's state under Tessera's metric names.
type stateCollector struct{ *nodeState }

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{gpuMemory, gpuHealthy, gpuMode, gpuShares, gpuAllocMemory, gpuAllocCompute, ctrAllocMemory,
		ctrAllocCompute, ctrMemoryUsed, ctrMemoryLimit, ctrThrottled, ctrOOM, ledgerEntries, ctrInfo} {
		ch <- d
	}
}

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	entries := c.agent.Ledger().Entries()
	byUUID := map[string]*api.GPU{}
	migParent := map[string]*api.GPU{}
	migInstance := map[string]api.MIGInstance{}
	for _, r := range c.gpus(entries) {
		g := r.gpu
		byUUID[g.UUID] = g
		if g.MIG != nil {
			for _, in := range g.MIG.Instances {
				migParent[in.UUID], migInstance[in.UUID] = g, in
			}
		}
		l := c.gpuLabelValues(g)
		gauge(gpuMemory, float64(g.MemoryBytes), l...)
		gauge(gpuHealthy, b2f(g.Healthy), l...)
		gauge(gpuMode, 1, append(l, r.mode)...)
		gauge(gpuShares, float64(r.usage.Shares), l...)
		gauge(gpuAllocMemory, r.memory, l...)
		gauge(gpuAllocCompute, r.cores/100, l...)
	}
	for i := range entries {
		e := &entries[i]
		for _, d := range e.Devices {
			g := byUUID[d.UUID]
			if g == nil {
				continue
			}
			mode, mem, cores := "share", float64(d.MemoryBytes), float64(d.CoresPercent)
			if d.Whole {
				mode, mem, cores = "whole", float64(g.MemoryBytes), 100
			}
			l := append(c.containerLabelValues(e, g), mode, d.UUID)
			gauge(ctrAllocMemory, mem, l...)
			gauge(ctrAllocCompute, cores/100, l...)
			gauge(ctrInfo, 1, append(l, "", "")...)
		}
		for _, id := range e.MIG {
			if g := migParent[id]; g != nil {
				in := migInstance[id]
				l := append(c.containerLabelValues(e, g), "mig", id)
				gauge(ctrAllocMemory, float64(in.MemoryBytes), l...)
				gauge(ctrAllocCompute, 0, l...)
				gauge(ctrInfo, 1, append(l, strconv.Itoa(in.GPUInstanceID), in.Profile)...)
			}
		}
	}
	for _, u := range c.regions() {
		for _, rg := range u.gpus {
			g := byUUID[rg.UUID]
			if g == nil {
				continue
			}
			l := c.containerLabelValues(u.entry, g)
			gauge(ctrMemoryUsed, float64(rg.Used), l...)
			gauge(ctrMemoryLimit, float64(rg.MemCap), l...)
			counter(ctrThrottled, float64(rg.ThrottledNs)/1e9, l...)
			counter(ctrOOM, float64(rg.OOMEvents), l...)
		}
	}
	gauge(ledgerEntries, float64(len(entries)))
}

// hamiCollector offers the node's state under the metric names and labels of HAMi's scheduler and
// vGPU monitor, so dashboards written for HAMi keep working: its current hami_* names, its legacy
// ones (GPUDevice*, vGPU_device_memory_*), or both. HAMi's per-container allocation series
// (hami_vgpu_*_allocated_*) are left out: they name the container by its index in the pod, which
// the agent's ledger does not keep.
type hamiCollector struct {
	*nodeState
	names hamiNames
}

func (c *hamiCollector) Describe(ch chan<- *prometheus.Desc) {
	if c.names.current {
		for _, d := range []*prometheus.Desc{hamiGPUMemLimit, hamiGPUCoreLimit, hamiGPUMemAllocated, hamiGPUCoreAllocated, hamiGPUSharedCount,
			hamiNodeGPUOverview, hamiNodeGPUMemRatio, hamiVGPUMemUsed, hamiVGPUMemLimitB, hamiCtrDeviceMemory} {
			ch <- d
		}
	}
	if c.names.legacy {
		for _, d := range []*prometheus.Desc{hamiMemLimit, hamiCoreLimit, hamiMemAllocated, hamiCoreAllocated, hamiSharedNum, hamiVGPUMemUsage, hamiVGPUMemLimit} {
			ch <- d
		}
	}
}

// gpuSets are the per-GPU descriptors of the name sets asked for, each in one order: memory limit,
// core limit, memory allocated, cores allocated, containers sharing.
func (c *hamiCollector) gpuSets() [][5]*prometheus.Desc {
	var sets [][5]*prometheus.Desc
	if c.names.current {
		sets = append(sets, [5]*prometheus.Desc{hamiGPUMemLimit, hamiGPUCoreLimit, hamiGPUMemAllocated, hamiGPUCoreAllocated, hamiGPUSharedCount})
	}
	if c.names.legacy {
		sets = append(sets, [5]*prometheus.Desc{hamiMemLimit, hamiCoreLimit, hamiMemAllocated, hamiCoreAllocated, hamiSharedNum})
	}
	return sets
}

func (c *hamiCollector) Collect(ch chan<- prometheus.Metric) {
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	for _, r := range c.gpus(c.agent.Ledger().Entries()) {
		g := r.gpu
		// device_cores/devicecores is the GPU's compute (100), as HAMi fills it, not what is allocated.
		idx, typ, total := strconv.Itoa(g.Index), hamiDeviceType(g), "100"
		// The series both name sets have, under each set's names.
		for _, set := range c.gpuSets() {
			gauge(set[0], float64(g.MemoryBytes), c.node, g.UUID, idx, typ)
			gauge(set[1], 100, c.node, g.UUID, idx, typ)
			gauge(set[2], r.memory, c.node, g.UUID, idx, total, typ)
			gauge(set[3], r.cores, c.node, g.UUID, idx, typ)
			gauge(set[4], float64(r.holders), c.node, g.UUID, idx, typ)
		}
		if c.names.current {
			gauge(hamiNodeGPUOverview, r.memory, c.node, g.UUID, idx, total, strconv.FormatInt(g.MemoryBytes>>20, 10), typ)
			if g.MemoryBytes > 0 {
				gauge(hamiNodeGPUMemRatio, r.memory/float64(g.MemoryBytes), c.node, g.UUID, idx, typ)
			}
		}
	}
	for _, u := range c.regions() {
		for i, rg := range u.gpus {
			l := []string{u.entry.Namespace, u.entry.Pod, u.entry.Container, strconv.Itoa(i), rg.UUID}
			if c.names.current {
				gauge(hamiVGPUMemUsed, float64(rg.Used), l...)
				gauge(hamiVGPUMemLimitB, float64(rg.MemCap), l...)
				gauge(hamiCtrDeviceMemory, float64(rg.Used), l...)
			}
			if c.names.legacy {
				gauge(hamiVGPUMemUsage, float64(rg.Used), l...)
				gauge(hamiVGPUMemLimit, float64(rg.MemCap), l...)
			}
		}
	}
}

func (s *nodeState) gpuLabelValues(g *api.GPU) []string { return telemetry.GPULabelValues(g, s.node) }

func (s *nodeState) containerLabelValues(e *ledger.Entry, g *api.GPU) []string {
	return telemetry.ContainerLabelValues(e.Namespace, e.Pod, e.Container, g, s.node)
}

// hamiDeviceType is HAMi's devicetype label: "NVIDIA-" and NVML's device name.
func hamiDeviceType(g *api.GPU) string { return "NVIDIA-" + g.Model }

func gpuModeOf(g *api.GPU, u ledger.Usage) string {
	switch {
	case g.MIG != nil:
		return "mig"
	case len(g.Mdev) > 0:
		return "mdev"
	case u.Whole:
		return "whole"
	case u.Shares > 0:
		return "shared"
	}
	return "free"
}

// holders counts the containers holding the GPU whole or in shares.
func holders(entries []ledger.Entry, uuid string) int {
	n := 0
	for _, e := range entries {
		for _, d := range e.Devices {
			if d.UUID == uuid {
				n++
				break
			}
		}
	}
	return n
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// containerUsage is what vcuda measured in one share container's accounting region.
type containerUsage struct {
	entry *ledger.Entry
	gpus  []vcuda.RegionGPU
}

// readContainerRegions reads the accounting region of every share container in the ledger, and of
// every prepared DRA share claim: a claim's containers (of one pod or several) share the claim's
// one region and cap, so its usage is reported once, on the claim's entry (container
// "resourceclaim/<name>", pod the first it is reserved for), and its containers, which hold no
// devices of their own, have no usage series. Regions are read without trusting them (read is
// nri.Plugin.ReadRegion: a regular file, no symlink, bounded, never blocking); containers in which
// no CUDA process has run yet have none and are left out. A region
// that fails vcuda.ParseRegion's checks is left out too, counted and logged by bad: one container's
// bad region never costs the others their series.
func readContainerRegions(a *agent.Agent, read func(containerID string) ([]byte, error), bad *badRegions) []containerUsage {
	var out []containerUsage
	var refused []refusedRegion
	for _, e := range a.Ledger().Entries() {
		if len(e.Devices) == 0 || e.Devices[0].Whole {
			continue
		}
		data, err := read(e.ContainerID)
		if err != nil {
			continue // no CUDA process has run in the container yet, or it is not a region
		}
		r, err := vcuda.ParseRegion(data)
		if err != nil {
			refused = append(refused, refusedRegion{e, err})
			continue
		}
		out = append(out, containerUsage{entry: &e, gpus: r.GPUs})
	}
	bad.note(refused)
	return out
}

// refusedRegion is a share container whose region failed vcuda.ParseRegion's checks.
type refusedRegion struct {
	entry ledger.Entry
	err   error
}

// badRegions counts every refused region read and logs a container once while its region stays
// bad, so a container rewriting its own region cannot flood the agent's log at every scrape.
type badRegions struct {
	total  prometheus.Counter
	log    *slog.Logger
	mu     sync.Mutex
	logged map[string]bool // container IDs refused at the last read
}

func (b *badRegions) note(refused []refusedRegion) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := make(map[string]bool, len(refused))
	for _, r := range refused {
		b.total.Inc()
		now[r.entry.ContainerID] = true
		if !b.logged[r.entry.ContainerID] {
			b.log.Warn("vcuda region refused; the container's GPU usage is left out of the metrics", "namespace", r.entry.Namespace,
				"pod", r.entry.Pod, "container", r.entry.Container, "containerID", r.entry.ContainerID, "err", r.err)
		}
	}
	b.logged = now
}

// registerSecurityMetrics exports what the NRI plugin counted about containers outside isolation:
// privileged containers admitted with GPU nodes, admin-namespace containers, and running containers
// found holding GPU devices with no ledger entry at the last Synchronize; and the ledger holders
// left out of the holdings annotation (publishHoldings).
func registerSecurityMetrics(reg prometheus.Registerer, plugin *nri.Plugin, holdingsLeftOut *atomic.Int64) {
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "tessera_holdings_left_out",
			Help: "Ledger holders (containers or pods) left out of the Node's holdings annotation because they do not validate; the agent's log says why."},
			func() float64 { return float64(holdingsLeftOut.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "tessera_privileged_gpu_containers_total",
			Help: "Privileged containers admitted holding GPU device nodes (outside isolation)."},
			func() float64 { p, _, _ := plugin.SecurityStats(); return float64(p) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "tessera_admin_gpu_containers_total",
			Help: "Containers of admin namespaces admitted with GPUs nobody granted (monitoring)."},
			func() float64 { _, a, _ := plugin.SecurityStats(); return float64(a) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "tessera_unrealised_gpu_containers",
			Help: "Running containers holding GPU devices with no ledger entry, at the last Synchronize."},
			func() float64 { _, _, u := plugin.SecurityStats(); return float64(u) }))
}
