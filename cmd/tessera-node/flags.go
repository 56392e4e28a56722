package main

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	cli "github.com/urfave/cli/v3"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/gpu"
	"github.com/tessera-gpu/tessera/internal/telemetry"
)

// envPrefix starts the environment variable of every flag of `tessera-node run` and `cdi
// generate`: --cdi-dir is also TESSERA_NODE_CDI_DIR (telemetry.EnvSources).
const envPrefix = "TESSERA_NODE_"

// nodeFlags declares the flags of a subcommand that looks at the node's GPUs. urfave/cli reads each
// from the command line or else from its environment variable; load lays the flags that were set
// (cmd.IsSet) over the config file, and every flag's default over what the file leaves empty:
// flags and environment > config file > defaults.
type nodeFlags struct {
	// keys maps a flag to the NodeConfig field it sets, by the field's JSON name.
	keys map[string]string
	log  telemetry.LogOptions
}

// field declares fl with its environment variable as a source; key names the NodeConfig field it
// sets ("" for a flag load does not merge into the config).
func field[T any, C any, VC cli.ValueCreator[T, C]](f *nodeFlags, key string, fl *cli.FlagBase[T, C, VC]) cli.Flag {
	fl.Sources = telemetry.EnvSources(envPrefix, fl.Name)
	if key != "" {
		if f.keys == nil {
			f.keys = map[string]string{}
		}
		f.keys[fl.Name] = key
	}
	return fl
}

// flags declares the flags every subcommand that looks at the node's GPUs has.
func (f *nodeFlags) flags() []cli.Flag {
	str := func(name, key, def, usage string) cli.Flag {
		return field(f, key, &cli.StringFlag{Name: name, Value: def, Usage: usage})
	}
	return append(f.log.CLIFlags(envPrefix),
		// --config comes first: it names the file load reads after every flag is parsed.
		field(f, "", &cli.StringFlag{Name: "config", Usage: "versioned config file (apiVersion: " + configv1.Version + ", kind: " + configv1.KindNodeConfig + "); flags override it"}),
		str("backend", "backend", configv1.DefaultBackend, "GPU inventory: nvml (the NVIDIA driver under --driver-root; fails when it cannot be loaded) or sim (the simulated node)"),
		str("node-description", "nodeDescription", "", "simulated node: a description file (YAML) or a built-in name, dgx-a100 (8 x A100-SXM4-40GB, the default) or dgx-h100 (8 x H100-SXM5-80GB)"),
		str("driver-root", "driverRoot", "", "host path of the NVIDIA driver's root: / for a driver on the host, /run/nvidia/driver with the GPU Operator, or a folder like /usr/local/nvidia (default /; the simulated node's own root with --backend=sim)"),
		str("container-driver-root", "containerDriverRoot", "", "where this process sees --driver-root, when it runs in a container with the host's driver root mounted elsewhere (default: --driver-root)"),
		str("dev-root", "devRoot", "", "host path of the root whose dev/ holds the NVIDIA device nodes (default /; the simulated node's own root with --backend=sim)"),
		str("cdi-hook-path", "cdiHookPath", "", "host path of nvidia-cdi-hook for the CDI specs' hooks (default: "+toolkitHookPath+" if installed, else tessera-node installs itself as <data-dir>/bin/nvidia-cdi-hook)"),
		str("sim-driver-dir", "simDriverDir", "", "simulated node: folder with the simulated driver's libcuda.so.1, libnvidia-ml.so.1 and nvidia-smi (`make vcuda` builds them in bin/vcuda/fake); empty: placeholders, CUDA does not run"),
		str("state-dir", "stateDir", configv1.DefaultSimStateDir, "where the simulated node keeps its state (its root: dev/, proc/, the driver; mig-minors)"),
		str("data-dir", "dataDir", configv1.DefaultDataDir, "persistent state: the ledger, and the CDI hook binary when the toolkit's is not installed"),
		str("cdi-dir", "cdiDir", configv1.DefaultCDIDir, "directory the CDI specs are written to"),
		str("vendor", "cdiVendor", configv1.DefaultCDIVendor, "vendor of the CDI device names (<vendor>/gpu=<uuid>)"),
		str("vcuda-library", "vcudaLibrary", configv1.DefaultVCUDALibrary, "host path of libvcuda.so, mounted read-only into share containers"),
		field(f, "sharesPerGPU", &cli.IntFlag{Name: "shares-per-gpu", Value: configv1.DefaultSharesPerGPU, Usage: "tessera.dev/vgpu tokens advertised per GPU"}),
	)
}

// runFlags declares the flags of `tessera-node run`.
func (f *nodeFlags) runFlags(host string) []cli.Flag {
	str := func(name, key, def, usage string) cli.Flag {
		return field(f, key, &cli.StringFlag{Name: name, Value: def, Usage: usage})
	}
	return []cli.Flag{
		str("node-name", "nodeName", host, "Kubernetes node name (the inventory annotation goes on this Node)"),
		str("run-dir", "runDir", configv1.DefaultRunDir, "per-container vcuda files (limits, preload list, accounting region); best on tmpfs"),
		str("device-plugin-dir", "devicePluginDir", configv1.DefaultPluginDir, "the kubelet's device plugin directory (kubelet.sock lives here)"),
		str("pod-resources-socket", "podResourcesSocket", configv1.DefaultPodResources, "the kubelet's PodResources API socket"),
		str("nri-socket", "nriSocket", configv1.DefaultNRISocket, "containerd's NRI socket"),
		str("cri-socket", "criSocket", configv1.DefaultCRISocket, "the container runtime's CRI socket, asked once at start whether CDI is on (skipped when it does not exist)"),
		str("nri-plugin-index", "nriPluginIndex", configv1.DefaultNRIIndex, "NRI plugin index (order among NRI plugins)"),
		str("kata-runtime-handler", "kataRuntimeHandler", configv1.DefaultKataHandler, "runtime handlers starting with this run pods in VMs (VFIO devices, no /dev/nvidia*)"),
		str("kubeconfig", "kubeconfig", "", "kubeconfig for the API server (empty: in-cluster config); pods are read from it and the inventory is published to the Node"),
		str("listen", "listen", configv1.DefaultNodeListen, "address for /metrics and /healthz"),
		str("hook-binary", "hookBinary", "", "host path of tessera-node for the realisation hook in the CDI specs (default: this binary)"),
		// Added to the config file's list, not merged by key; a comma is not a separator.
		field(f, "", &cli.StringSliceFlag{Name: "admin-namespace", Usage: "namespace whose pods may see every GPU (monitoring, e.g. dcgm-exporter); repeatable"}),
		field(f, "rediscoverInterval", &cli.DurationFlag{Name: "rediscover-interval", Value: configv1.DefaultRediscover, Usage: "how often the GPUs are rediscovered (MIG or mdev changes made outside Tessera)"}),
		// Replaces the file's list only when set: an empty list in the file means none.
		field(f, "", &cli.StringFlag{Name: "ignored-xids", Value: formatXIDs(configv1.DefaultIgnoredXIDs), Usage: "comma-separated XIDs that do not make a GPU unhealthy (application errors); \"none\" ignores none"}),
		field(f, "hamiMetrics", &cli.BoolFlag{Name: "hami-metrics", Usage: "also serve the node's state under HAMi's current metric names and labels (hami_gpu_*, hami_vgpu_memory_*) for dashboards written for HAMi; they double the agent's series"}),
		field(f, "hamiLegacyMetrics", &cli.BoolFlag{Name: "hami-legacy-metrics", Usage: "also serve HAMi's legacy metric names and labels (GPUDevice*, vGPU_device_memory_*), as HAMi does with --legacy-metrics"}),
		field(f, "dra", &cli.BoolFlag{Name: "dra", Usage: "also serve the GPUs through Dynamic Resource Allocation (driver " + api.DRADriverName + ": ResourceSlices, claims prepared into the same ledger)"}),
		str("dra-registrar-dir", "draRegistrarDir", configv1.DefaultDRARegistrar, "the kubelet's plugin registry directory (<kubelet root-dir>/plugins_registry), where the DRA plugin registers"),
		str("dra-plugin-dir", "draPluginDir", configv1.DefaultDRAPluginDir, "directory of the DRA plugin's socket (<kubelet root-dir>/plugins/"+api.DRADriverName+")"),
		str("dra-unhealthy-effect", "draUnhealthyEffect", configv1.DefaultDRAUnhealthyEffect, "effect of the taint on an unhealthy GPU's DRA devices: NoSchedule (new claims avoid it) or NoExecute (pods using it are also evicted)"),
		field(f, "draDynamicMIG", &cli.BoolFlag{Name: "dra-dynamic-mig", Usage: "with --dra, offer each MIG-capable GPU without foreign MIG instances as whole, shares or any MIG profile, creating the MIG instance a claim gets at prepare and destroying it at unprepare"}),
		str("dra-rolling-update-uid", "draRollingUpdateUID", "", "this agent's pod UID (the chart: $(POD_UID)): the DRA plugin registers under sockets named for it, so the old and the new agent of an update are registered side by side (kubelet 1.33+)"),
		field(f, "healthCheckInterval", &cli.DurationFlag{Name: "health-check-interval", Value: configv1.DefaultHealthCheckInterval, Usage: "how often GPUs are probed; an unhealthy GPU recovers when a probe passes after a whole interval without errors"}),
		str("host-proc", "hostProc", configv1.DefaultHostProc, "the host's /proc, where the memory guard maps GPU processes (NVML's host pids) to containers; the agent needs the host's PID namespace"),
		field(f, "memoryGuard.enabled", &cli.BoolFlag{Name: "memory-guard", Value: true, Usage: "kill the GPU processes of a share whose memory, as the driver measures it, stays over its cap (--memory-guard=false: vcuda alone enforces caps, which a container can walk past)"}),
		field(f, "memoryGuard.interval", &cli.DurationFlag{Name: "memory-guard-interval", Value: configv1.DefaultMemoryGuardInterval, Usage: "how often the memory guard reads each shared GPU's per-process memory from NVML"}),
		field(f, "memoryGuard.grace", &cli.DurationFlag{Name: "memory-guard-grace", Value: configv1.DefaultMemoryGuardGrace, Usage: "how long a share must stay over its cap plus tolerance, in consecutive samples, before its GPU processes are killed"}),
		field(f, "memoryGuard.toleranceBytes", &cli.Int64Flag{Name: "memory-guard-tolerance-bytes", Value: configv1.DefaultMemoryGuardTolerance, Usage: "usage up to cap + max(this, cap x --memory-guard-tolerance-percent / 100) is within the cap"}),
		field(f, "memoryGuard.tolerancePercent", &cli.Int64Flag{Name: "memory-guard-tolerance-percent", Value: configv1.DefaultMemoryGuardPercent, Usage: "the tolerance's share of the cap, in percent"}),
		field(f, "computeGuard.enabled", &cli.BoolFlag{Name: "compute-guard", Value: true, Usage: "act on a share whose SM utilisation, as the driver measures it per process, stays over its compute cap (--compute-guard=false: vcuda alone holds compute caps, which a container can lift); runs only with the memory guard"}),
		field(f, "computeGuard.window", &cli.DurationFlag{Name: "compute-guard-window", Value: configv1.DefaultComputeGuardWindow, Usage: "the span a share's measured SM utilisation is averaged over"}),
		field(f, "computeGuard.grace", &cli.DurationFlag{Name: "compute-guard-grace", Value: configv1.DefaultComputeGuardGrace, Usage: "how long the average must stay over the cap plus tolerance before the action"}),
		field(f, "computeGuard.tolerancePercent", &cli.Int64Flag{Name: "compute-guard-tolerance-percent", Value: configv1.DefaultComputeGuardTolerance, Usage: "points of the GPU above the compute cap that are still within it"}),
		field(f, "computeGuard.feedbackInterval", &cli.DurationFlag{Name: "compute-guard-feedback-interval", Value: configv1.DefaultComputeFeedbackInterval, Usage: "how often the driver's measured busy time of each share container's processes is published into the container for vcuda's compute limiter"}),
		str("compute-guard-action", "computeGuard.action", configv1.DefaultComputeGuardAction, "what the compute guard does to a share over its cap: Kill (its GPU processes) or Event (a Warning Event and the metric only)"),
	}
}

// command is a subcommand with these flags; action runs after they are parsed (not for --help).
func command(name, usage string, flags []cli.Flag, action cli.ActionFunc) *cli.Command {
	return &cli.Command{Name: name, Usage: usage, Flags: flags, Action: action, HideHelpCommand: true,
		// --admin-namespace=a,b is one namespace, as it was with the standard flag package.
		DisableSliceFlagSeparator: true}
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

// load merges the config file with the flags: a flag set on the command line or by its
// environment variable (cmd.IsSet) wins, then the file, then the flag's default. The merge goes
// through the fields' JSON names: the file's set fields are those its JSON encoding keeps.
func (f *nodeFlags) load(cmd *cli.Command) (*configv1.NodeConfig, error) {
	cfg := &configv1.NodeConfig{}
	inFile := map[string]any{}
	if path := cmd.String("config"); path != "" {
		var err error
		if cfg, err = configv1.LoadNodeConfig(path); err != nil {
			return nil, err
		}
		data, err := json.Marshal(cfg)
		if err != nil {
			return nil, err
		}
		if err := json.Unmarshal(data, &inFile); err != nil {
			return nil, err
		}
	}
	fromFlags := map[string]any{}
	for name, key := range f.keys {
		// A key "section.field" is a field of a section (memoryGuard.interval).
		file, flags := inFile, fromFlags
		if section, k, nested := strings.Cut(key, "."); nested {
			file, _ = inFile[section].(map[string]any)
			if flags, _ = fromFlags[section].(map[string]any); flags == nil {
				flags = map[string]any{}
				fromFlags[section] = flags
			}
			key = k
		}
		if _, set := file[key]; set && !cmd.IsSet(name) {
			continue
		}
		v := cmd.Value(name)
		if d, ok := v.(time.Duration); ok {
			v = configv1.Duration{Duration: d}
		}
		flags[key] = v
	}
	data, err := json.Marshal(fromFlags)
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(data, cfg); err != nil {
		return nil, fmt.Errorf("flags: %w", err)
	}
	cfg.AdminNamespaces = append(cfg.AdminNamespaces, cmd.StringSlice("admin-namespace")...)
	if cmd.IsSet("ignored-xids") {
		xids, err := parseXIDs(cmd.String("ignored-xids"))
		if err != nil {
			return nil, err
		}
		cfg.IgnoredXIDs = xids
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
