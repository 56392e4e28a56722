package main

import (
	"flag"
	"fmt"
	"strconv"
	"strings"
	"time"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/gpu"
	"github.com/tessera-gpu/tessera/internal/telemetry"
)

// nodeFlags binds the flags of a subcommand to NodeConfig fields. Flags the user sets override the
// config file; the config file overrides the defaults.
type nodeFlags struct {
	config       string
	strings      map[string]*string // flag name -> value
	fields       map[string]func(*configv1.NodeConfig) *string
	sharesPerGPU int
	rediscover   time.Duration
	// adminNamespaces are added to the config's.
	adminNamespaces stringList
	ignoredXIDs     string
	healthCheck     time.Duration
	dra             bool
	log             telemetry.LogOptions
}

// stringList is a repeatable string flag.
type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, ",") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }

// stringFlag declares a flag that overrides one string field of the config.
func (f *nodeFlags) stringFlag(fs *flag.FlagSet, name, def, usage string, field func(*configv1.NodeConfig) *string) {
	if f.strings == nil {
		f.strings, f.fields = map[string]*string{}, map[string]func(*configv1.NodeConfig) *string{}
	}
	f.strings[name] = fs.String(name, def, usage)
	f.fields[name] = field
}

// register declares the flags every subcommand that looks at the node's GPUs has.
func (f *nodeFlags) register(fs *flag.FlagSet) {
	f.log.AddFlags(fs)
	fs.StringVar(&f.config, "config", "", "versioned config file (apiVersion: "+api.Version+", kind: "+configv1.KindNodeConfig+"); flags override it")
	f.stringFlag(fs, "backend", configv1.DefaultBackend, "GPU inventory: nvml (the NVIDIA driver under --driver-root; fails when it cannot be loaded) or sim (the simulated node)", func(c *configv1.NodeConfig) *string { return &c.Backend })
	f.stringFlag(fs, "node-description", "", "simulated node: a description file (YAML) or a built-in name, dgx-a100 (8 x A100-SXM4-40GB, the default) or dgx-h100 (8 x H100-SXM5-80GB)", func(c *configv1.NodeConfig) *string { return &c.NodeDescription })
	f.stringFlag(fs, "driver-root", "", "host path of the NVIDIA driver's root: / for a driver on the host, /run/nvidia/driver with the GPU Operator, or a folder like /usr/local/nvidia (default /; the simulated node's own root with --backend=sim)", func(c *configv1.NodeConfig) *string { return &c.DriverRoot })
	f.stringFlag(fs, "container-driver-root", "", "where this process sees --driver-root, when it runs in a container with the host's driver root mounted elsewhere (default: --driver-root)", func(c *configv1.NodeConfig) *string { return &c.ContainerDriverRoot })
	f.stringFlag(fs, "dev-root", "", "host path of the root whose dev/ holds the NVIDIA device nodes (default /; the simulated node's own root with --backend=sim)", func(c *configv1.NodeConfig) *string { return &c.DevRoot })
	f.stringFlag(fs, "cdi-hook-path", "", "host path of nvidia-cdi-hook for the CDI specs' hooks (default: "+toolkitHookPath+" if installed, else tessera-node installs itself as <data-dir>/bin/nvidia-cdi-hook)", func(c *configv1.NodeConfig) *string { return &c.CDIHookPath })
	f.stringFlag(fs, "sim-driver-dir", "", "simulated node: folder with the simulated driver's libcuda.so.1, libnvidia-ml.so.1 and nvidia-smi (`make vcuda` builds them in bin/vcuda/fake); empty: placeholders, CUDA does not run", func(c *configv1.NodeConfig) *string { return &c.SimDriverDir })
	f.stringFlag(fs, "state-dir", configv1.DefaultSimStateDir, "where the simulated node keeps its state (its root: dev/, proc/, the driver; mig-minors)", func(c *configv1.NodeConfig) *string { return &c.StateDir })
	f.stringFlag(fs, "data-dir", configv1.DefaultDataDir, "persistent state: the ledger, and the CDI hook binary when the toolkit's is not installed", func(c *configv1.NodeConfig) *string { return &c.DataDir })
	f.stringFlag(fs, "cdi-dir", configv1.DefaultCDIDir, "directory the CDI specs are written to", func(c *configv1.NodeConfig) *string { return &c.CDIDir })
	f.stringFlag(fs, "vendor", configv1.DefaultCDIVendor, "vendor of the CDI device names (<vendor>/gpu=<uuid>)", func(c *configv1.NodeConfig) *string { return &c.CDIVendor })
	f.stringFlag(fs, "vcuda-library", configv1.DefaultVCUDALibrary, "host path of libvcuda.so, mounted read-only into share containers", func(c *configv1.NodeConfig) *string { return &c.VCUDALibrary })
	fs.IntVar(&f.sharesPerGPU, "shares-per-gpu", configv1.DefaultSharesPerGPU, "tessera.dev/vgpu tokens advertised per GPU")
}

// registerRun declares the flags of `tessera-node run`.
func (f *nodeFlags) registerRun(fs *flag.FlagSet, host string) {
	f.stringFlag(fs, "node-name", host, "Kubernetes node name (the inventory annotation goes on this Node)", func(c *configv1.NodeConfig) *string { return &c.NodeName })
	f.stringFlag(fs, "run-dir", configv1.DefaultRunDir, "per-container vcuda files (limits, preload list, accounting region); best on tmpfs", func(c *configv1.NodeConfig) *string { return &c.RunDir })
	f.stringFlag(fs, "device-plugin-dir", configv1.DefaultPluginDir, "the kubelet's device plugin directory (kubelet.sock lives here)", func(c *configv1.NodeConfig) *string { return &c.DevicePluginDir })
	f.stringFlag(fs, "pod-resources-socket", configv1.DefaultPodResources, "the kubelet's PodResources API socket", func(c *configv1.NodeConfig) *string { return &c.PodResourcesSocket })
	f.stringFlag(fs, "nri-socket", configv1.DefaultNRISocket, "containerd's NRI socket", func(c *configv1.NodeConfig) *string { return &c.NRISocket })
	f.stringFlag(fs, "nri-plugin-index", configv1.DefaultNRIIndex, "NRI plugin index (order among NRI plugins)", func(c *configv1.NodeConfig) *string { return &c.NRIPluginIndex })
	f.stringFlag(fs, "kata-runtime-handler", configv1.DefaultKataHandler, "runtime handlers starting with this run pods in VMs (VFIO devices, no /dev/nvidia*)", func(c *configv1.NodeConfig) *string { return &c.KataRuntimeHandler })
	f.stringFlag(fs, "kubeconfig", "", "kubeconfig for the API server (empty: in-cluster config); pods are read from it and the inventory is published to the Node", func(c *configv1.NodeConfig) *string { return &c.Kubeconfig })
	f.stringFlag(fs, "listen", configv1.DefaultNodeListen, "address for /metrics and /healthz", func(c *configv1.NodeConfig) *string { return &c.Listen })
	f.stringFlag(fs, "hook-binary", "", "host path of tessera-node for the realisation hook in the CDI specs (default: this binary)", func(c *configv1.NodeConfig) *string { return &c.HookBinary })
	fs.Var(&f.adminNamespaces, "admin-namespace", "namespace whose pods may see every GPU (monitoring, e.g. dcgm-exporter); repeatable")
	fs.DurationVar(&f.rediscover, "rediscover-interval", configv1.DefaultRediscover, "how often the GPUs are rediscovered (MIG or mdev changes made outside Tessera)")
	fs.StringVar(&f.ignoredXIDs, "ignored-xids", formatXIDs(configv1.DefaultIgnoredXIDs), "comma-separated XIDs that do not make a GPU unhealthy (application errors); \"none\" ignores none")
	fs.BoolVar(&f.dra, "dra", false, "also serve the GPUs through Dynamic Resource Allocation (driver "+api.DRADriverName+": ResourceSlices, claims prepared into the same ledger)")
	f.stringFlag(fs, "dra-registrar-dir", configv1.DefaultDRARegistrar, "the kubelet's plugin registry directory (<kubelet root-dir>/plugins_registry), where the DRA plugin registers", func(c *configv1.NodeConfig) *string { return &c.DRARegistrarDir })
	f.stringFlag(fs, "dra-plugin-dir", configv1.DefaultDRAPluginDir, "directory of the DRA plugin's socket (<kubelet root-dir>/plugins/"+api.DRADriverName+")", func(c *configv1.NodeConfig) *string { return &c.DRAPluginDir })
	fs.DurationVar(&f.healthCheck, "health-check-interval", configv1.DefaultHealthCheckInterval, "how often GPUs are probed; an unhealthy GPU recovers when a probe passes after a whole interval without errors")
}

// parseXIDs reads --ignored-xids: "13,31,43" or "none".
func parseXIDs(s string) ([]uint64, error) {
	out := []uint64{}
	if strings.TrimSpace(s) == "none" {
		return out, nil
	}
	for _, f := range strings.Split(s, ",") {
		x, err := strconv.ParseUint(strings.TrimSpace(f), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("--ignored-xids: %q is not an XID (want e.g. 13,31,43 or none)", f)
		}
		out = append(out, x)
	}
	return out, nil
}

func formatXIDs(xids []uint64) string {
	s := make([]string, len(xids))
	for i, x := range xids {
		s[i] = strconv.FormatUint(x, 10)
	}
	return strings.Join(s, ",")
}

// load merges the config file with the flags: a flag the user set wins, then the file, then the
// flag's default.
func (f *nodeFlags) load(fs *flag.FlagSet) (*configv1.NodeConfig, error) {
	cfg := &configv1.NodeConfig{}
	if f.config != "" {
		var err error
		if cfg, err = configv1.LoadNodeConfig(f.config); err != nil {
			return nil, err
		}
	}
	set := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	for name, v := range f.strings {
		if dst := f.fields[name](cfg); set[name] || *dst == "" {
			*dst = *v
		}
	}
	if set["shares-per-gpu"] || cfg.SharesPerGPU == 0 {
		cfg.SharesPerGPU = f.sharesPerGPU
	}
	if set["rediscover-interval"] || cfg.RediscoverInterval.Duration == 0 {
		cfg.RediscoverInterval.Duration = f.rediscover
	}
	cfg.AdminNamespaces = append(cfg.AdminNamespaces, f.adminNamespaces...)
	if set["ignored-xids"] {
		xids, err := parseXIDs(f.ignoredXIDs)
		if err != nil {
			return nil, err
		}
		cfg.IgnoredXIDs = xids
	}
	if set["health-check-interval"] || cfg.HealthCheckInterval.Duration == 0 {
		cfg.HealthCheckInterval.Duration = f.healthCheck
	}
	if set["dra"] {
		cfg.DRA = f.dra
	}
	cfg.Defaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("flags: %w", err)
	}
	return cfg, nil
}

func gpuOptions(cfg *configv1.NodeConfig) gpu.Options {
	driverRoot := cfg.ContainerDriverRoot
	if driverRoot == "" {
		driverRoot = cfg.DriverRoot
	}
	return gpu.Options{Backend: cfg.Backend, NodeDescription: cfg.NodeDescription, DriverRoot: driverRoot, DevRoot: cfg.DevRoot,
		StateDir: cfg.StateDir, SimDriverDir: cfg.SimDriverDir}
}

// cdiGenerator builds the CDI spec generator: the driver's files from nvcdi, named by host paths.
// realise adds the realisation check to every GPU spec: the agent's specs carry it; specs written
// by hand with `cdi generate` (no NRI plugin to realise anything) do not.
func cdiGenerator(cfg *configv1.NodeConfig, backend gpu.Backend, realise bool) (*cdi.Generator, error) {
	tesseraNode, nvidiaHook, err := hookBinaries(cfg)
	if err != nil {
		return nil, err
	}
	gen := &cdi.Generator{Vendor: cfg.CDIVendor, VCUDALibrary: cfg.VCUDALibrary,
		Driver: &cdi.Driver{HostRoot: cfg.DriverRoot, HookPath: nvidiaHook, NVML: backend.NVML()}}
	if realise {
		gen.HookBinary, gen.RunDir = tesseraNode, cfg.RunDir
	}
	return gen, nil
}
