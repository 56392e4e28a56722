package memguard

import (
	"strconv"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tessera-gpu/tessera/internal/ledger"
)

// Labels follow the agent's other series (cmd/tessera-node/metrics.go): per-GPU series carry
// dcgm-exporter's gpu, UUID, device, modelName and Hostname; per-container series namespace, pod,
// container, gpu, UUID and Hostname.
var (
	gpuLabels       = []string{"gpu", "UUID", "device", "modelName", "Hostname"}
	containerLabels = []string{"namespace", "pod", "container", "gpu", "UUID", "Hostname"}

	measuredDesc = prometheus.NewDesc("tessera_container_gpu_memory_measured_bytes",
		"GPU memory the container's processes hold as the driver reports it (NVML's per-process used memory on the host, contexts and modules included); the memory guard enforces caps on it.",
		containerLabels, nil)
	underreportDesc = prometheus.NewDesc("tessera_container_region_underreport_bytes",
		"Measured GPU memory of a share (a container's, or a shared claim's on its claim entry) past what its vcuda accounting region counts, when over the tolerance: memory allocated past vcuda or a region written by the container.",
		containerLabels, nil)
	unattributedDesc = prometheus.NewDesc("tessera_gpu_memory_unattributed_bytes",
		"GPU memory on a shared GPU held by processes in no container Tessera placed (never killed by the memory guard).",
		gpuLabels, nil)
)

// metrics are the guard's series: the last sample's gauges and the counters.
type metrics struct {
	node       string
	kills      prometheus.Counter
	killErrors prometheus.Counter
	nvmlErrors *prometheus.CounterVec

	mu   sync.Mutex
	last snapshot
}

// snapshot is what one sample measured.
type snapshot struct {
	gpus         map[string][]string // uuid -> gpu, UUID, device, modelName (inventory)
	measured     []containerValue
	underreport  []containerValue
	unattributed []gpuValue
}

type containerValue struct {
	entry *ledger.Entry
	uuid  string
	value float64
}

type gpuValue struct {
	uuid  string
	value float64
}

func newMetrics(node string) *metrics {
	return &metrics{
		node: node,
		kills: prometheus.NewCounter(prometheus.CounterOpts{Name: "tessera_memory_cap_kills_total",
			Help: "Containers whose GPU processes the memory guard killed because their measured GPU memory stayed over the share's cap plus tolerance for the grace period."}),
		killErrors: prometheus.NewCounter(prometheus.CounterOpts{Name: "tessera_memory_guard_kill_errors_total",
			Help: "Processes over a cap the memory guard failed to kill (the agent's log says why)."}),
		nvmlErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tessera_memory_guard_nvml_errors_total",
			Help: "Samples in which NVML could not list a shared GPU's processes and their memory; caps on that GPU are not enforced on such a sample."}, []string{"UUID"}),
	}
}

func (m *metrics) register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.kills, m.killErrors, m.nvmlErrors, m} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

func (m *metrics) set(s snapshot) {
	m.mu.Lock()
	m.last = s
	m.mu.Unlock()
}

func (m *metrics) Describe(ch chan<- *prometheus.Desc) {
	ch <- measuredDesc
	ch <- underreportDesc
	ch <- unattributedDesc
}

func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	m.mu.Lock()
	s := m.last
	m.mu.Unlock()
	for _, v := range s.measured {
		if gl, ok := s.gpus[v.uuid]; ok {
			ch <- prometheus.MustNewConstMetric(measuredDesc, prometheus.GaugeValue, v.value, v.entry.Namespace, v.entry.Pod, v.entry.Container, gl[0], v.uuid, m.node)
		}
	}
	for _, v := range s.underreport {
		if gl, ok := s.gpus[v.uuid]; ok {
			ch <- prometheus.MustNewConstMetric(underreportDesc, prometheus.GaugeValue, v.value, v.entry.Namespace, v.entry.Pod, v.entry.Container, gl[0], v.uuid, m.node)
		}
	}
	for _, v := range s.unattributed {
		if gl, ok := s.gpus[v.uuid]; ok {
			ch <- prometheus.MustNewConstMetric(unattributedDesc, prometheus.GaugeValue, v.value, append(gl, m.node)...)
		}
	}
}

// gpuLabels are the inventory's GPUs' label values but Hostname, by UUID.
func (g *Guard) gpuLabels() map[string][]string {
	out := map[string][]string{}
	if g.cfg.Inventory == nil {
		return out
	}
	inv := g.cfg.Inventory()
	if inv == nil {
		return out
	}
	for _, gp := range inv.GPUs {
		out[gp.UUID] = []string{strconv.Itoa(gp.Index), gp.UUID, "nvidia" + strconv.Itoa(gp.Minor), gp.Model}
	}
	return out
}
