package main

import (
	"flag"
	"fmt"

	"github.com/tessera-gpu/tessera/api"
	"github.com/tessera-gpu/tessera/gpu"
)

// nodeFlags are the flags shared by every subcommand that looks at the node's GPUs. Flags that are
// set override the config file; the config file overrides the defaults.
type nodeFlags struct {
	config          string
	backend         string
	nodeDescription string
	devRoot         string
	stateDir        string
	cdiDir          string
	vendor          string
	vcudaLibrary    string
	sharesPerGPU    int
}

func (f *nodeFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.config, "config", "", "versioned config file (apiVersion: "+api.Version+", kind: "+api.KindNodeConfig+"); flags override it")
	fs.StringVar(&f.backend, "backend", api.DefaultBackend, "GPU inventory: auto (NVML if a driver is present, else simulated), nvml or sim")
	fs.StringVar(&f.nodeDescription, "node-description", "", "simulated node description (YAML); empty: the built-in 8 x A100-SXM4-40GB")
	fs.StringVar(&f.devRoot, "dev-root", "", "host directory playing /dev: /dev for real GPUs; the simulated node creates its device nodes here (default <state-dir>/dev)")
	fs.StringVar(&f.stateDir, "state-dir", "/var/run/tessera/sim", "where the simulated node keeps its state (mig-minors, device nodes)")
	fs.StringVar(&f.cdiDir, "cdi-dir", api.DefaultCDIDir, "directory the CDI specs are written to")
	fs.StringVar(&f.vendor, "vendor", api.DefaultCDIVendor, "vendor of the CDI device names (<vendor>/gpu=<uuid>)")
	fs.StringVar(&f.vcudaLibrary, "vcuda-library", api.DefaultVCUDALibrary, "host path of libvcuda.so, mounted read-only into share containers")
	fs.IntVar(&f.sharesPerGPU, "shares-per-gpu", api.DefaultSharesPerGPU, "tessera.dev/vgpu tokens advertised per GPU")
}

// load merges the config file with the flags the user set.
func (f *nodeFlags) load(fs *flag.FlagSet) (*api.NodeConfig, error) {
	cfg, err := api.LoadNodeConfig(f.config)
	if err != nil {
		return nil, err
	}
	set := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	override := func(name string, dst *string, v string) {
		if set[name] || (*dst == "" && v != "") {
			*dst = v
		}
	}
	override("backend", &cfg.Backend, f.backend)
	override("node-description", &cfg.NodeDescription, f.nodeDescription)
	override("dev-root", &cfg.DevRoot, f.devRoot)
	override("cdi-dir", &cfg.CDIDir, f.cdiDir)
	override("vendor", &cfg.CDIVendor, f.vendor)
	override("vcuda-library", &cfg.VCUDALibrary, f.vcudaLibrary)
	if set["shares-per-gpu"] {
		cfg.SharesPerGPU = f.sharesPerGPU
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("flags: %w", err)
	}
	return cfg, nil
}

func (f *nodeFlags) gpuOptions(cfg *api.NodeConfig) gpu.Options {
	return gpu.Options{Backend: cfg.Backend, NodeDescription: cfg.NodeDescription, DevRoot: cfg.DevRoot, StateDir: f.stateDir}
}
