// Package v1 holds the versioned config files of Tessera's binaries (apiVersion tessera.dev/v1,
// kinds NodeAgentConfig and ExtenderConfig), their defaults (host paths, ports, intervals) and their
// validation, apart from the wire contract in api/v1, as NVIDIA's k8s-device-plugin keeps its
// api/config/v1. Import it as configv1.
package v1

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/tessera-gpu/tessera/api/internal/strict"
	api "github.com/tessera-gpu/tessera/api/v1"
)

// Version is the apiVersion of the config files: the same string as the wire contract's, so config
// files written for earlier releases (when these types lived in api/v1) keep working.
const Version = api.Version

// Config kinds (the "kind" of a versioned config file).
const (
	KindNodeConfig     = "NodeAgentConfig"
	KindExtenderConfig = "ExtenderConfig"
)

// NodeConfig configures tessera-node. Flags override the file; zero values take the defaults below.
type NodeConfig struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	// NodeName is the Kubernetes node name (default: the host name).
	NodeName string `json:"nodeName,omitempty"`
	// Backend is the GPU inventory: "nvml" (the real driver; the default) or "sim" (the simulated
	// node). There is no automatic fallback: a GPU node whose driver cannot be loaded must fail loudly,
	// not advertise simulated GPUs.
	Backend string `json:"backend,omitempty"`
	// NodeDescription is the simulated node (sim backend): a YAML file or a built-in name, dgx-a100 (the default, 8 x A100) or dgx-h100 (8 x H100).
	NodeDescription string `json:"nodeDescription,omitempty"`
	// DriverRoot is the host path of the root the NVIDIA driver is installed under: "/" for a driver
	// on the host, "/run/nvidia/driver" for the GPU Operator's driver container, or a read-only
	// folder such as "/usr/local/nvidia". The sim backend defaults it to its simulated driver root.
	DriverRoot string `json:"driverRoot,omitempty"`
	// ContainerDriverRoot is where the agent sees DriverRoot when it runs in a container that
	// mounts the host's driver root elsewhere (the DaemonSet: /driver-root). Empty: DriverRoot.
	ContainerDriverRoot string `json:"containerDriverRoot,omitempty"`
	// DevRoot is the host path of the root whose dev/ holds the NVIDIA device nodes ("/" on real
	// hardware, also with the GPU Operator). The sim backend defaults it to its simulated root.
	DevRoot string `json:"devRoot,omitempty"`
	// CDIHookPath is the host path of the nvidia-cdi-hook binary the CDI specs' hooks run. Empty:
	// the toolkit's hook when it is installed at /usr/bin/nvidia-cdi-hook, otherwise tessera-node
	// installs itself as <dataDir>/bin/nvidia-cdi-hook (it embeds the toolkit's hook commands).
	CDIHookPath string `json:"cdiHookPath,omitempty"`
	// SimDriverDir holds the files the simulated driver root is made of (sim backend only):
	// libcuda.so.1, libnvidia-ml.so.1 and nvidia-smi, as built by `make vcuda` (bin/vcuda/fake).
	// Empty: placeholders, so specs are complete but CUDA does not run in containers.
	SimDriverDir string `json:"simDriverDir,omitempty"`
	// CDIDir is where CDI specs are written.
	CDIDir string `json:"cdiDir,omitempty"`
	// CDIVendor is the vendor part of every CDI device name, e.g. tessera.dev/gpu=<uuid>.
	CDIVendor string `json:"cdiVendor,omitempty"`
	// SharesPerGPU is how many tessera.dev/vgpu tokens each GPU offers.
	SharesPerGPU int `json:"sharesPerGPU,omitempty"`
	// VCUDALibrary is the host path of libvcuda.so that share containers get.
	VCUDALibrary string `json:"vcudaLibrary,omitempty"`
	// StateDir is where the simulated node keeps its state (mig-minors, device nodes).
	StateDir string `json:"stateDir,omitempty"`

	// The rest configures `tessera-node run`.

	// DataDir holds persistent state: the ledger.
	DataDir string `json:"dataDir,omitempty"`
	// RunDir holds per-container vcuda files; best on tmpfs.
	RunDir string `json:"runDir,omitempty"`
	// DevicePluginDir is the kubelet's device plugin directory (kubelet.sock lives there).
	DevicePluginDir string `json:"devicePluginDir,omitempty"`
	// PodResourcesSocket is the kubelet's PodResources API socket.
	PodResourcesSocket string `json:"podResourcesSocket,omitempty"`
	// NRISocket is containerd's NRI socket.
	NRISocket string `json:"nriSocket,omitempty"`
	// CRISocket is the container runtime's CRI socket, asked once at start whether CDI is on and
	// reads the CDI directory; when it does not exist the check is skipped.
	CRISocket string `json:"criSocket,omitempty"`
	// NRIPluginIndex orders Tessera among NRI plugins.
	NRIPluginIndex string `json:"nriPluginIndex,omitempty"`
	// KataRuntimeHandler: runtime handlers starting with it run pods in VMs.
	KataRuntimeHandler string `json:"kataRuntimeHandler,omitempty"`
	// Kubeconfig for the API server; empty means in-cluster credentials.
	Kubeconfig string `json:"kubeconfig,omitempty"`
	// Listen is the address of /metrics and /healthz.
	Listen string `json:"listen,omitempty"`
	// RediscoverInterval is how often GPUs are rediscovered.
	RediscoverInterval Duration `json:"rediscoverInterval,omitempty"`
	// HookBinary is the host path of the tessera-node binary that Tessera's CDI specs name as the
	// realisation hook (the runtime runs it on the host; empty: the running binary's own path).
	HookBinary string `json:"hookBinary,omitempty"`
	// AdminNamespaces are the namespaces an administrator marks for pods that see every GPU
	// (monitoring such as dcgm-exporter): their containers get no device checks and keep their
	// NVIDIA_VISIBLE_DEVICES. Only this config marks them; no pod annotation can.
	AdminNamespaces []string `json:"adminNamespaces,omitempty"`
	// IgnoredXIDs are XIDs that do not make a GPU unhealthy (application errors). Absent: NVIDIA's
	// device plugin's list, DefaultIgnoredXIDs; an empty list ignores none.
	IgnoredXIDs []uint64 `json:"ignoredXIDs,omitempty"`
	// HealthCheckInterval is how often every GPU is probed; an unhealthy GPU recovers when a probe
	// passes after a whole interval without bad news.
	HealthCheckInterval Duration `json:"healthCheckInterval,omitempty"`
	// DRA serves the GPUs through Dynamic Resource Allocation too (driver gpu.tessera.dev, Kubernetes
	// 1.34+; consumable capacity 1.36+): ResourceSlices and NodePrepareResources beside the device
	// plugins, into the same ledger (docs/dra.md).
	DRA bool `json:"dra,omitempty"`
	// HAMiMetrics also serves the node's state under HAMi's current metric names and labels
	// (hami_gpu_*, hami_vgpu_memory_*, as of HAMi v2.10), for dashboards written for HAMi. Off by
	// default: the series double the agent's, which only operators moving from HAMi want.
	HAMiMetrics bool `json:"hamiMetrics,omitempty"`
	// HAMiLegacyMetrics also serves HAMi's legacy names (GPUDevice*, vGPU_device_memory_*: what
	// HAMi serves only with its --legacy-metrics), for dashboards older than HAMi's hami_* names.
	HAMiLegacyMetrics bool `json:"hamiLegacyMetrics,omitempty"`
	// DRARegistrarDir is the kubelet's plugin registry, where the DRA plugin registers.
	DRARegistrarDir string `json:"draRegistrarDir,omitempty"`
	// DRAPluginDir holds the DRA plugin's socket (the kubelet must reach it at the same path).
	DRAPluginDir string `json:"draPluginDir,omitempty"`
	// DRAUnhealthyEffect is the effect of the taint an unhealthy GPU carries in the DRA slices:
	// NoSchedule (default: new claims avoid it; running pods keep it and see its health in their
	// status) or NoExecute (the API server's eviction controller also evicts the pods using it).
	DRAUnhealthyEffect string `json:"draUnhealthyEffect,omitempty"`
	// DRADynamicMIG publishes each MIG-capable GPU that holds no MIG instance Tessera did not create
	// as a partitionable device (whole, shares, or any MIG profile placement) and creates the MIG
	// instance a claim is allocated at prepare, destroying it at unprepare; it switches MIG mode on
	// and off, which NVML refuses while a process runs on the GPU (docs/dra.md, "Dynamic MIG").
	DRADynamicMIG bool `json:"draDynamicMIG,omitempty"`
	// DRARollingUpdateUID is the agent pod's UID (the chart passes $(POD_UID)): the DRA plugin then
	// registers under sockets named for its pod (kubeletplugin.RollingUpdate), so an old and a new
	// agent can both be registered with the kubelet during an update; empty: the fixed socket names.
	DRARollingUpdateUID string `json:"draRollingUpdateUID,omitempty"`
	// HostProc is the host's /proc, where the memory guard maps GPU processes (host pids, as NVML
	// reports them) to containers; the agent runs with the host's PID namespace.
	HostProc string `json:"hostProc,omitempty"`
	// MemoryGuard enforces share memory caps on what the driver measures (internal/memguard).
	MemoryGuard MemoryGuard `json:"memoryGuard"`
	// ComputeGuard checks share compute caps against what the driver measures (internal/memguard,
	// compute.go); it runs in the memory guard's samples.
	ComputeGuard ComputeGuard `json:"computeGuard"`
}

// ComputeGuard configures the agent's compute guard: in each of the memory guard's samples it reads
// NVML's per-process SM utilisation on the host, sums it per share and, where a share's average
// over Window stays above its compute cap plus TolerancePercent points for Grace, acts: Kill (the
// share's GPU processes, as for memory) or Event (a Warning Event and the metric only).
type ComputeGuard struct {
	// Enabled turns the check on (default true). It runs in the memory guard's samples: with the
	// memory guard off it is off too.
	Enabled *bool `json:"enabled,omitempty"`
	// Window is the span the utilisation is averaged over (default 10s): vcuda holds a share to its
	// cap on average, not in every instant, and NVML samples in periods of its own.
	Window Duration `json:"window,omitempty"`
	// Grace is how long the windowed average must stay over the cap plus tolerance before the
	// action (default 20s).
	Grace Duration `json:"grace,omitempty"`
	// TolerancePercent is in points of the GPU: a share capped at 30% is over at 30 + this
	// (default 15, above vcuda's own error on varied kernels; vcuda/README.md).
	TolerancePercent int64 `json:"tolerancePercent,omitempty"`
	// Action is Kill (default) or Event.
	Action string `json:"action,omitempty"`
	// FeedbackInterval is how often the measured compute file is published to share containers
	// (default 200ms, 50ms to 5s): NVML's per-process busy time of each of a container's processes,
	// which vcuda's compute limiter corrects itself by. Shorter follows a workload's phase changes
	// sooner at the cost of an NVML call per shared GPU each time.
	FeedbackInterval Duration `json:"feedbackInterval,omitempty"`
}

// On reports whether the compute guard is asked for (it runs only where the memory guard does).
func (c ComputeGuard) On() bool { return c.Enabled == nil || *c.Enabled }

// Compute guard actions.
const (
	ComputeGuardKill  = "Kill"
	ComputeGuardEvent = "Event"
)

// MemoryGuard configures the agent's memory guard: every Interval it reads each shared GPU's
// per-process memory from NVML on the host and kills the GPU processes of a share that stays over
// its cap plus tolerance for Grace, as the kernel's OOM killer does for RAM.
type MemoryGuard struct {
	// Enabled turns the guard on (default true). Off, caps rest on vcuda alone, which a container
	// can walk past.
	Enabled *bool `json:"enabled,omitempty"`
	// Interval is the time between samples (default 1s).
	Interval Duration `json:"interval,omitempty"`
	// Grace is how long usage must stay over cap plus tolerance, in consecutive samples, before the
	// share's processes are killed (default 3s; "0s" is not allowed: one sample is not evidence).
	Grace Duration `json:"grace,omitempty"`
	// ToleranceBytes and TolerancePercent: usage up to cap + max(ToleranceBytes, cap x
	// TolerancePercent / 100) is within the cap (defaults 64 MiB and 2%; 0 takes the default): NVML counts whole pages
	// and the driver grows a process's memory on its own (local memory, page tables).
	ToleranceBytes   int64 `json:"toleranceBytes,omitempty"`
	TolerancePercent int64 `json:"tolerancePercent,omitempty"`
}

// On reports whether the guard runs.
func (m MemoryGuard) On() bool { return m.Enabled == nil || *m.Enabled }

// DefaultIgnoredXIDs are the XIDs NVIDIA's device plugin ignores as application errors: 13 graphics
// engine exception, 31 GPU memory page fault, 43 GPU stopped processing, 45 preemptive cleanup,
// 68 video processor exception, 109 context switch timeout.
var DefaultIgnoredXIDs = []uint64{13, 31, 43, 45, 68, 109}

// Node agent defaults.
const (
	DefaultBackend            = "nvml"
	DefaultCDIDir             = "/etc/cdi"
	DefaultCDIVendor          = "tessera.dev"
	DefaultSharesPerGPU       = 10
	DefaultVCUDALibrary       = "/usr/local/lib/tessera/libvcuda.so"
	DefaultSimStateDir        = "/var/run/tessera/sim"
	DefaultDataDir            = "/var/lib/tessera"
	DefaultRunDir             = "/run/tessera"
	DefaultPluginDir          = "/var/lib/kubelet/device-plugins"
	DefaultPodResources       = "/var/lib/kubelet/pod-resources/kubelet.sock"
	DefaultNRISocket          = "/var/run/nri/nri.sock"
	DefaultCRISocket          = "/run/containerd/containerd.sock"
	DefaultNRIIndex           = "50"
	DefaultKataHandler        = "kata"
	DefaultNodeListen         = "127.0.0.1:9445" // not 9400: dcgm-exporter's port, often on the same node
	DefaultDRARegistrar       = "/var/lib/kubelet/plugins_registry"
	DefaultDRAPluginDir       = "/var/lib/kubelet/plugins/" + api.DRADriverName
	DefaultDRAUnhealthyEffect = "NoSchedule"
	DefaultRediscover         = time.Minute
	// DefaultHealthCheckInterval is how often GPUs are probed for health.
	DefaultHealthCheckInterval = 30 * time.Second
	DefaultHostProc            = "/proc"
	// Memory guard defaults: a sample a second; three seconds over the cap (three samples after
	// the first) before a kill, so a transient spike (an allocation freed at once, the driver's own
	// growth) is not killed; a tolerance of max(64 MiB, 2% of the cap), above NVML's page
	// granularity and the driver's own per-process growth, small beside any cap worth enforcing.
	DefaultMemoryGuardInterval  = time.Second
	DefaultMemoryGuardGrace     = 3 * time.Second
	DefaultMemoryGuardTolerance = 64 << 20
	DefaultMemoryGuardPercent   = 2
	// Compute guard defaults: averaged over 10 s, 20 s over the cap plus 15 points before the
	// share's processes are killed: a tenant that lifts its own cap is stopped within half a
	// minute, an honest share held to its cap by vcuda (within +-10% of the cap on varied
	// kernels, short bursts above while the limiter's credit drains) is never near it.
	DefaultComputeGuardWindow    = 10 * time.Second
	DefaultComputeGuardGrace     = 20 * time.Second
	DefaultComputeGuardTolerance = 15
	DefaultComputeGuardAction    = ComputeGuardKill
	// DefaultComputeFeedbackInterval: NVML samples per-process utilisation in periods of about
	// 1/6 s, so a shorter interval would mostly find nothing new.
	DefaultComputeFeedbackInterval = 200 * time.Millisecond
)

// maxXID bounds XIDs; NVML reports 999 for an unknown one.
const maxXID = 999

// cdiVendorPattern is the CDI vendor rule (a DNS-like name).
var cdiVendorPattern = regexp.MustCompile(`^[a-zA-Z0-9]([a-zA-Z0-9_.-]*[a-zA-Z0-9])?$`)

// Defaults fills zero fields with defaults.
func (c *NodeConfig) Defaults() {
	if c.APIVersion == "" {
		c.APIVersion = Version
	}
	if c.Kind == "" {
		c.Kind = KindNodeConfig
	}
	if c.Backend == "" {
		c.Backend = DefaultBackend
	}
	if c.CDIDir == "" {
		c.CDIDir = DefaultCDIDir
	}
	if c.CDIVendor == "" {
		c.CDIVendor = DefaultCDIVendor
	}
	if c.SharesPerGPU == 0 {
		c.SharesPerGPU = DefaultSharesPerGPU
	}
	for _, d := range []struct {
		field *string
		value string
	}{
		{&c.VCUDALibrary, DefaultVCUDALibrary}, {&c.StateDir, DefaultSimStateDir}, {&c.DataDir, DefaultDataDir},
		{&c.RunDir, DefaultRunDir}, {&c.DevicePluginDir, DefaultPluginDir}, {&c.PodResourcesSocket, DefaultPodResources},
		{&c.NRISocket, DefaultNRISocket}, {&c.CRISocket, DefaultCRISocket}, {&c.NRIPluginIndex, DefaultNRIIndex}, {&c.KataRuntimeHandler, DefaultKataHandler},
		{&c.Listen, DefaultNodeListen}, {&c.DRARegistrarDir, DefaultDRARegistrar}, {&c.DRAPluginDir, DefaultDRAPluginDir},
		{&c.DRAUnhealthyEffect, DefaultDRAUnhealthyEffect},
	} {
		if *d.field == "" {
			*d.field = d.value
		}
	}
	if c.RediscoverInterval.Duration == 0 {
		c.RediscoverInterval.Duration = DefaultRediscover
	}
	if c.IgnoredXIDs == nil {
		c.IgnoredXIDs = append([]uint64{}, DefaultIgnoredXIDs...)
	}
	if c.HealthCheckInterval.Duration == 0 {
		c.HealthCheckInterval.Duration = DefaultHealthCheckInterval
	}
	if c.HostProc == "" {
		c.HostProc = DefaultHostProc
	}
	m := &c.MemoryGuard
	if m.Enabled == nil {
		on := true
		m.Enabled = &on
	}
	if m.Interval.Duration == 0 {
		m.Interval.Duration = DefaultMemoryGuardInterval
	}
	if m.Grace.Duration == 0 {
		m.Grace.Duration = DefaultMemoryGuardGrace
	}
	if m.ToleranceBytes == 0 {
		m.ToleranceBytes = DefaultMemoryGuardTolerance
	}
	if m.TolerancePercent == 0 {
		m.TolerancePercent = DefaultMemoryGuardPercent
	}
	cg := &c.ComputeGuard
	if cg.Enabled == nil {
		on := true
		cg.Enabled = &on
	}
	if cg.Window.Duration == 0 {
		cg.Window.Duration = DefaultComputeGuardWindow
	}
	if cg.Grace.Duration == 0 {
		cg.Grace.Duration = DefaultComputeGuardGrace
	}
	if cg.TolerancePercent == 0 {
		cg.TolerancePercent = DefaultComputeGuardTolerance
	}
	if cg.Action == "" {
		cg.Action = DefaultComputeGuardAction
	}
	if cg.FeedbackInterval.Duration == 0 {
		cg.FeedbackInterval.Duration = DefaultComputeFeedbackInterval
	}
}

// Validate checks a defaulted NodeConfig.
func (c *NodeConfig) Validate() error {
	fe := &strict.Errors{Doc: "node agent config"}
	checkKind(fe, c.APIVersion, c.Kind, KindNodeConfig)
	switch c.Backend {
	case "nvml", "sim":
	default:
		fe.Add("backend", "must be nvml (a real NVIDIA driver) or sim (the simulated node), got %q", c.Backend)
	}
	for name, path := range map[string]string{"driverRoot": c.DriverRoot, "containerDriverRoot": c.ContainerDriverRoot, "devRoot": c.DevRoot, "cdiHookPath": c.CDIHookPath, "simDriverDir": c.SimDriverDir} {
		if path != "" && !filepath.IsAbs(path) {
			fe.Add(name, "must be an absolute path, got %q", path)
		}
	}
	if !cdiVendorPattern.MatchString(c.CDIVendor) {
		fe.Add("cdiVendor", "must be a vendor name like tessera.dev, got %q", c.CDIVendor)
	}
	if c.SharesPerGPU < 1 || c.SharesPerGPU > 1024 {
		fe.Add("sharesPerGPU", "must be between 1 and 1024, got %d", c.SharesPerGPU)
	}
	for name, path := range map[string]string{"vcudaLibrary": c.VCUDALibrary, "stateDir": c.StateDir, "dataDir": c.DataDir, "runDir": c.RunDir,
		"devicePluginDir": c.DevicePluginDir, "podResourcesSocket": c.PodResourcesSocket, "nriSocket": c.NRISocket, "criSocket": c.CRISocket, "cdiDir": c.CDIDir} {
		if !filepath.IsAbs(path) {
			fe.Add(name, "must be an absolute path, got %q", path)
		}
	}
	if c.HookBinary != "" && !filepath.IsAbs(c.HookBinary) {
		fe.Add("hookBinary", "must be an absolute path on the host, got %q", c.HookBinary)
	}
	for i, ns := range c.AdminNamespaces {
		if ns == "" {
			fe.Add(fmt.Sprintf("adminNamespaces[%d]", i), "must name a namespace")
		}
	}
	if _, _, err := net.SplitHostPort(c.Listen); err != nil {
		fe.Add("listen", "must be host:port, got %q", c.Listen)
	}
	if c.RediscoverInterval.Duration < time.Second {
		fe.Add("rediscoverInterval", "must be at least 1s, got %s", c.RediscoverInterval.Duration)
	}
	for i, x := range c.IgnoredXIDs {
		if x == 0 || x > maxXID {
			fe.Add(fmt.Sprintf("ignoredXIDs[%d]", i), "must be an XID between 1 and %d, got %d", maxXID, x)
		}
	}
	if c.HealthCheckInterval.Duration < time.Second {
		fe.Add("healthCheckInterval", "must be at least 1s, got %s", c.HealthCheckInterval.Duration)
	}
	if c.DRAUnhealthyEffect != "NoSchedule" && c.DRAUnhealthyEffect != "NoExecute" {
		fe.Add("draUnhealthyEffect", "must be NoSchedule or NoExecute (evict the pods using an unhealthy GPU), got %q", c.DRAUnhealthyEffect)
	}
	if c.DRADynamicMIG && !c.DRA {
		fe.Add("draDynamicMIG", "needs dra: true (dynamic MIG instances are created for DRA claims only)")
	}
	if !filepath.IsAbs(c.HostProc) {
		fe.Add("hostProc", "must be an absolute path, got %q", c.HostProc)
	}
	m := c.MemoryGuard
	if m.Interval.Duration < 100*time.Millisecond || m.Interval.Duration > time.Minute {
		fe.Add("memoryGuard.interval", "must be between 100ms and 1m, got %s", m.Interval.Duration)
	}
	if m.Grace.Duration < m.Interval.Duration || m.Grace.Duration > 10*time.Minute {
		fe.Add("memoryGuard.grace", "must be at least memoryGuard.interval (%s: one sample is not evidence) and at most 10m, got %s", m.Interval.Duration, m.Grace.Duration)
	}
	if m.ToleranceBytes < 0 || m.ToleranceBytes > 16<<30 {
		fe.Add("memoryGuard.toleranceBytes", "must be between 0 and 16 GiB (17179869184), got %d", m.ToleranceBytes)
	}
	if m.TolerancePercent < 0 || m.TolerancePercent > 50 {
		fe.Add("memoryGuard.tolerancePercent", "must be between 0 and 50, got %d", m.TolerancePercent)
	}
	cg := c.ComputeGuard
	if cg.Window.Duration < 2*m.Interval.Duration || cg.Window.Duration > 10*time.Minute {
		fe.Add("computeGuard.window", "must be at least twice memoryGuard.interval (%s) and at most 10m, got %s", m.Interval.Duration, cg.Window.Duration)
	}
	if cg.Grace.Duration < m.Interval.Duration || cg.Grace.Duration > 10*time.Minute {
		fe.Add("computeGuard.grace", "must be at least memoryGuard.interval (%s: one sample is not evidence) and at most 10m, got %s", m.Interval.Duration, cg.Grace.Duration)
	}
	if cg.TolerancePercent < 1 || cg.TolerancePercent > 100 {
		fe.Add("computeGuard.tolerancePercent", "must be between 1 and 100 (points of the GPU), got %d", cg.TolerancePercent)
	}
	if cg.Action != ComputeGuardKill && cg.Action != ComputeGuardEvent {
		fe.Add("computeGuard.action", "must be Kill (the share's GPU processes) or Event (a Warning Event and the metric only), got %q", cg.Action)
	}
	if cg.FeedbackInterval.Duration < 50*time.Millisecond || cg.FeedbackInterval.Duration > 5*time.Second {
		fe.Add("computeGuard.feedbackInterval", "must be between 50ms (an NVML call per shared GPU each time) and 5s (vcuda's limiter corrects itself by it), got %s", cg.FeedbackInterval.Duration)
	}
	return fe.Err()
}

func checkKind(fe *strict.Errors, apiVersion, kind, want string) {
	if apiVersion != Version {
		fe.Add("apiVersion", "must be %q, got %q", Version, apiVersion)
	}
	if kind != want {
		fe.Add("kind", "must be %q, got %q", want, kind)
	}
}

// LoadNodeConfig reads, defaults and validates a node agent config file ("" means all defaults).
func LoadNodeConfig(path string) (*NodeConfig, error) {
	return load[NodeConfig](path, "node agent config")
}

// config is a config file: it fills its zero fields with defaults and validates itself.
type config[T any] interface {
	strict.Document[T]
	Defaults()
}

// load strictly decodes a config file (YAML or JSON; "" means an empty one), then defaults and
// validates it: the one versioned decode of api/internal/strict, after YAML is turned into JSON.
func load[T any, P config[T]](path, doc string) (*T, error) {
	data := []byte("{}")
	if path != "" {
		raw, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", doc, err)
		}
		doc += " " + path
		if data, err = yaml.YAMLToJSONStrict(raw); err != nil {
			return nil, fmt.Errorf("invalid %s: %w", doc, err)
		}
	}
	return strict.DecodeVersioned[T, P](data, doc)
}
