package gpu

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"

	"github.com/NVIDIA/go-nvlib/pkg/nvmdev"
	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Backend is a source of GPU inventory and health.
type Backend interface {
	// Name is "nvml" or "sim".
	Name() string
	// Discover reads the GPUs, their MIG instances, mdev types and topology.
	Discover(ctx context.Context) (*Node, error)
	// CreateMdev creates an mdev vGPU of a type on the parent GPU at parentBus, with this UUID.
	CreateMdev(parentBus, typeName, uuid string) error
	// RemoveMdev removes an mdev vGPU (a missing one is not an error).
	RemoveMdev(uuid string) error
	// WatchHealth calls report for every health change until ctx ends; NVML errors become
	// health changes, never the end of the watch.
	WatchHealth(ctx context.Context, opts HealthOptions, report func(HealthEvent)) error
	// Close releases the library.
	Close() error
}

// Options configure a backend.
type Options struct {
	// Backend: "auto", "nvml" or "sim".
	Backend string
	// NodeDescription is the simulated node: a YAML file, or a name in BuiltinDescriptions ("" is dgx-a100).
	NodeDescription string
	// DevRoot is the host directory that plays /dev; the sim backend creates its device nodes there.
	DevRoot string
	// StateDir is where the sim backend keeps its simulated sysfs and procfs.
	StateDir string
}

// Open returns the backend the options ask for. "auto" picks NVML when a driver is loadable and
// falls back to the simulated node otherwise, so a machine without GPUs still runs everything.
func Open(opts Options) (Backend, error) {
	switch opts.Backend {
	case "nvml":
		return OpenNVML(opts)
	case "sim":
		return OpenSim(opts)
	case "auto", "":
		b, err := OpenNVML(opts)
		if err == nil {
			return b, nil
		}
		slog.Info("no NVIDIA driver found, using the simulated GPU node", "reason", err)
		return OpenSim(opts)
	}
	return nil, fmt.Errorf("unknown GPU backend %q: use auto, nvml or sim", opts.Backend)
}

// nvmlBackend talks to the real driver.
type nvmlBackend struct {
	lib     nvml.Interface
	devRoot string
}

// OpenNVML loads libnvidia-ml and initialises it.
func OpenNVML(opts Options) (Backend, error) {
	lib := nvml.New()
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("initialise NVML: %v (is the NVIDIA driver installed and libnvidia-ml.so.1 on the library path?)", nvml.ErrorString(ret))
	}
	devRoot := opts.DevRoot
	if devRoot == "" {
		devRoot = "/dev"
	}
	return &nvmlBackend{lib: lib, devRoot: devRoot}, nil
}

func (b *nvmlBackend) Name() string { return "nvml" }

func (b *nvmlBackend) Discover(ctx context.Context) (*Node, error) {
	n, err := discover(b.lib, discoverOptions{migMinorsPath: "/proc/driver/nvidia-caps/mig-minors"})
	if err != nil {
		return nil, err
	}
	n.DevRoot = b.devRoot
	if err := addMdev(n, openSysfsMdev()); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	return n, nil
}

func (b *nvmlBackend) CreateMdev(parentBus, typeName, uuid string) error {
	return createMdev(openSysfsMdev(), parentBus, typeName, uuid)
}

func (b *nvmlBackend) RemoveMdev(uuid string) error {
	return removeMdev(openSysfsMdev(), uuid, func(d *nvmdev.Device) error { return d.Delete() })
}

func (b *nvmlBackend) WatchHealth(ctx context.Context, opts HealthOptions, report func(HealthEvent)) error {
	return watchHealth(ctx, b.lib, opts, report)
}

func (b *nvmlBackend) Close() error {
	if ret := b.lib.Shutdown(); ret != nvml.SUCCESS {
		return fmt.Errorf("shut down NVML: %v", nvml.ErrorString(ret))
	}
	return nil
}
