package memguard

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/ledger"
	"github.com/tessera-gpu/tessera/internal/telemetry"
)

// The guard's series carry the agent's labels (telemetry.GPULabels, telemetry.ContainerLabels).
var (
	measuredDesc = prometheus.NewDesc("tessera_container_gpu_memory_measured_bytes",
		"GPU memory the container's processes hold as the driver reports it (NVML's per-process used memory on the host, contexts and modules included); the memory guard enforces caps on it.",
		telemetry.ContainerLabels, nil)
	underreportDesc = prometheus.NewDesc("tessera_container_region_underreport_bytes",
		"Measured GPU memory of a share (a container's, or a shared claim's on its claim entry) past what its vcuda accounting region counts, when over the tolerance: memory allocated past vcuda or a region written by the container.",
		telemetry.ContainerLabels, nil)
	overheadDesc = prometheus.NewDesc("tessera_gpu_context_overhead_bytes",
		"Device memory one CUDA context takes on the GPU's model as the agent measures it (NVML's per-process memory less the allocations vcuda counted, per context; the largest quiet sample of the last 10 minutes, bounded by the smallest process NVML lists on the model), published to vcuda, which charges the larger of it and its table. Absent until measured.",
		telemetry.GPULabels, nil)
	smUtilDesc = prometheus.NewDesc("tessera_container_gpu_sm_utilization_percent",
		"Share of time at least one kernel of the share's processes ran on the GPU, as NVML samples it per process on the host, averaged over the compute guard's window; the compute guard compares it with the share's compute cap (a shared claim's on its claim entry).",
		telemetry.ContainerLabels, nil)
	unattributedDesc = prometheus.NewDesc("tessera_gpu_memory_unattributed_bytes",
		"GPU memory on a shared GPU held by processes in no container Tessera placed (never killed by the memory guard).",
		telemetry.GPULabels, nil)
)

// metrics are the guard's series: the last sample's gauges and the counters.
type metrics struct {
	node       string
	kills      prometheus.Counter
	killErrors prometheus.Counter
	nvmlErrors *prometheus.CounterVec
	// utilErrors and computeViolations are the compute guard's.
	utilErrors        *prometheus.CounterVec
	computeViolations *prometheus.CounterVec
	// feedbackWrites and feedbackWriteErrors are the measured compute publisher's (feedback.go).
	feedbackWrites      prometheus.Counter
	feedbackWriteErrors prometheus.Counter

	mu   sync.Mutex
	last snapshot
}

// snapshot is what one sample measured.
type snapshot struct {
	gpus         map[string]*api.GPU // the inventory's GPUs by UUID
	measured     []containerValue
	underreport  []containerValue
	smUtil       []containerValue
	unattributed []gpuValue
	overhead     []gpuValue
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
			Help: "Processes over a cap (memory, or compute by the compute guard) the guard failed to kill (the agent's log says why)."}),
		nvmlErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tessera_memory_guard_nvml_errors_total",
			Help: "Samples in which NVML could not list a shared GPU's processes and their memory; caps on that GPU are not enforced on such a sample."}, []string{"UUID"}),
		utilErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tessera_compute_guard_nvml_errors_total",
			Help: "Samples in which NVML could not give a shared GPU's per-process utilisation (ERROR_NOT_SUPPORTED included); compute caps on that GPU are not checked on such a sample."}, []string{"UUID"}),
		computeViolations: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tessera_compute_cap_violations_total",
			Help: "Shares whose measured SM utilisation stayed over their compute cap plus tolerance for the grace, by the action taken: Kill (per container whose GPU processes were killed) or Event."}, []string{"action"}),
		feedbackWrites: prometheus.NewCounter(prometheus.CounterOpts{Name: "tessera_compute_feedback_writes_total",
			Help: "Measured compute files written into share containers' vcuda directories (the driver's per-process busy time vcuda's compute limiter corrects itself by); written when their lines change."}),
		feedbackWriteErrors: prometheus.NewCounter(prometheus.CounterOpts{Name: "tessera_compute_feedback_write_errors_total",
			Help: "Measured compute files the agent failed to write (the agent's log says why); the share's vcuda keeps the last file it read, or runs on its own samples."}),
	}
}

func (m *metrics) register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.kills, m.killErrors, m.nvmlErrors, m.utilErrors, m.computeViolations, m.feedbackWrites, m.feedbackWriteErrors, m} {
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
	ch <- smUtilDesc
	ch <- unattributedDesc
	ch <- overheadDesc
}

func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	m.mu.Lock()
	s := m.last
	m.mu.Unlock()
	for _, v := range s.measured {
		if g, ok := s.gpus[v.uuid]; ok {
			ch <- prometheus.MustNewConstMetric(measuredDesc, prometheus.GaugeValue, v.value, telemetry.ContainerLabelValues(v.entry.Namespace, v.entry.Pod, v.entry.Container, g, m.node)...)
		}
	}
	for _, v := range s.underreport {
		if g, ok := s.gpus[v.uuid]; ok {
			ch <- prometheus.MustNewConstMetric(underreportDesc, prometheus.GaugeValue, v.value, telemetry.ContainerLabelValues(v.entry.Namespace, v.entry.Pod, v.entry.Container, g, m.node)...)
		}
	}
	for _, v := range s.smUtil {
		if g, ok := s.gpus[v.uuid]; ok {
			ch <- prometheus.MustNewConstMetric(smUtilDesc, prometheus.GaugeValue, v.value, telemetry.ContainerLabelValues(v.entry.Namespace, v.entry.Pod, v.entry.Container, g, m.node)...)
		}
	}
	for _, v := range s.unattributed {
		if g, ok := s.gpus[v.uuid]; ok {
			ch <- prometheus.MustNewConstMetric(unattributedDesc, prometheus.GaugeValue, v.value, telemetry.GPULabelValues(g, m.node)...)
		}
	}
	for _, v := range s.overhead {
		if g, ok := s.gpus[v.uuid]; ok {
			ch <- prometheus.MustNewConstMetric(overheadDesc, prometheus.GaugeValue, v.value, telemetry.GPULabelValues(g, m.node)...)
		}
	}
}

// inventoryGPUs are the inventory's GPUs by UUID.
func (g *Guard) inventoryGPUs() map[string]*api.GPU {
	out := map[string]*api.GPU{}
	if g.cfg.Inventory == nil {
		return out
	}
	inv := g.cfg.Inventory()
	if inv == nil {
		return out
	}
	for i := range inv.GPUs {
		out[inv.GPUs[i].UUID] = &inv.GPUs[i]
	}
	return out
}
