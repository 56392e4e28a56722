package main

import (
	"flag"
	"fmt"
	"strconv"
	"strings"
	"time"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/gpu"
)

// nodeFlags binds the flags of a subcommand to NodeConfig fields. Flags the user sets override the
// config file; the config file overrides the defaults.
type nodeFlags struct {
	config       string
	strings      map[string]*string // flag name -> value
	fields       map[string]func(*api.NodeConfig) *string
	sharesPerGPU int
	rediscover   time.Duration
	ignoredXIDs  string
	healthCheck  time.Duration
}

// stringFlag declares a flag that overrides one string field of the config.
func (f *nodeFlags) stringFlag(fs *flag.FlagSet, name, def, usage string, field func(*api.NodeConfig) *string) {
	if f.strings == nil {
		f.strings, f.fields = map[string]*string{}, map[string]func(*api.NodeConfig) *string{}
	}
	f.strings[name] = fs.String(name, def, usage)
	f.fields[name] = field
}

// register declares the flags every subcommand that looks at the node's GPUs has.
func (f *nodeFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.config, "config", "", "versioned config file (apiVersion: "+api.Version+", kind: "+api.KindNodeConfig+"); flags override it")
	f.stringFlag(fs, "backend", api.DefaultBackend, "GPU inventory: auto (NVML if a driver is present, else simulated), nvml or sim", func(c *api.NodeConfig) *string { return &c.Backend })
	f.stringFlag(fs, "node-description", "", "simulated node: a description file (YAML) or a built-in name, dgx-a100 (8 x A100-SXM4-40GB, the default) or dgx-h100 (8 x H100-SXM5-80GB)", func(c *api.NodeConfig) *string { return &c.NodeDescription })
	f.stringFlag(fs, "dev-root", "", "host directory playing /dev: /dev for real GPUs; the simulated node creates its device nodes here (default <state-dir>/dev)", func(c *api.NodeConfig) *string { return &c.DevRoot })
	f.stringFlag(fs, "state-dir", api.DefaultSimStateDir, "where the simulated node keeps its state (mig-minors, device nodes)", func(c *api.NodeConfig) *string { return &c.StateDir })
	f.stringFlag(fs, "cdi-dir", api.DefaultCDIDir, "directory the CDI specs are written to", func(c *api.NodeConfig) *string { return &c.CDIDir })
	f.stringFlag(fs, "vendor", api.DefaultCDIVendor, "vendor of the CDI device names (<vendor>/gpu=<uuid>)", func(c *api.NodeConfig) *string { return &c.CDIVendor })
	f.stringFlag(fs, "vcuda-library", api.DefaultVCUDALibrary, "host path of libvcuda.so, mounted read-only into share containers", func(c *api.NodeConfig) *string { return &c.VCUDALibrary })
	fs.IntVar(&f.sharesPerGPU, "shares-per-gpu", api.DefaultSharesPerGPU, "tessera.dev/vgpu tokens advertised per GPU")
}

// registerRun declares the flags of `tessera-node run`.
func (f *nodeFlags) registerRun(fs *flag.FlagSet, host string) {
	f.stringFlag(fs, "node-name", host, "Kubernetes node name (the inventory annotation goes on this Node)", func(c *api.NodeConfig) *string { return &c.NodeName })
	f.stringFlag(fs, "data-dir", api.DefaultDataDir, "persistent state: the ledger", func(c *api.NodeConfig) *string { return &c.DataDir })
	f.stringFlag(fs, "run-dir", api.DefaultRunDir, "per-container vcuda files (limits, preload list, accounting region); best on tmpfs", func(c *api.NodeConfig) *string { return &c.RunDir })
	f.stringFlag(fs, "device-plugin-dir", api.DefaultPluginDir, "the kubelet's device plugin directory (kubelet.sock lives here)", func(c *api.NodeConfig) *string { return &c.DevicePluginDir })
	f.stringFlag(fs, "pod-resources-socket", api.DefaultPodResources, "the kubelet's PodResources API socket", func(c *api.NodeConfig) *string { return &c.PodResourcesSocket })
	f.stringFlag(fs, "nri-socket", api.DefaultNRISocket, "containerd's NRI socket", func(c *api.NodeConfig) *string { return &c.NRISocket })
	f.stringFlag(fs, "nri-plugin-index", api.DefaultNRIIndex, "NRI plugin index (order among NRI plugins)", func(c *api.NodeConfig) *string { return &c.NRIPluginIndex })
	f.stringFlag(fs, "kata-runtime-handler", api.DefaultKataHandler, "runtime handlers starting with this run pods in VMs (VFIO devices, no /dev/nvidia*)", func(c *api.NodeConfig) *string { return &c.KataRuntimeHandler })
	f.stringFlag(fs, "kubeconfig", "", "kubeconfig for the API server (empty: in-cluster config); pods are read from it and the inventory is published to the Node", func(c *api.NodeConfig) *string { return &c.Kubeconfig })
	f.stringFlag(fs, "listen", api.DefaultNodeListen, "address for /metrics and /healthz", func(c *api.NodeConfig) *string { return &c.Listen })
	fs.DurationVar(&f.rediscover, "rediscover-interval", api.DefaultRediscover, "how often the GPUs are rediscovered (MIG or mdev changes made outside Tessera)")
	fs.StringVar(&f.ignoredXIDs, "ignored-xids", formatXIDs(api.DefaultIgnoredXIDs), "comma-separated XIDs that do not make a GPU unhealthy (application errors); \"none\" ignores none")
	fs.DurationVar(&f.healthCheck, "health-check-interval", api.DefaultHealthCheckInterval, "how often GPUs are probed; an unhealthy GPU recovers when a probe passes after a whole interval without errors")
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
func (f *nodeFlags) load(fs *flag.FlagSet) (*api.NodeConfig, error) {
	cfg := &api.NodeConfig{}
	if f.config != "" {
		var err error
		if cfg, err = api.LoadNodeConfig(f.config); err != nil {
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
	cfg.Defaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("flags: %w", err)
	}
	return cfg, nil
}

func gpuOptions(cfg *api.NodeConfig) gpu.Options {
	return gpu.Options{Backend: cfg.Backend, NodeDescription: cfg.NodeDescription, DevRoot: cfg.DevRoot, StateDir: cfg.StateDir}
}
