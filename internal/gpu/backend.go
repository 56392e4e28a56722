package gpu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

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
	// NVML is the library the backend discovers through (nvcdi asks it the driver version).
	NVML() nvml.Interface
}

// Options configure a backend.
type Options struct {
	// Backend: "nvml" or "sim".
	Backend string
	// NodeDescription is the simulated node: a YAML file, or a name in BuiltinDescriptions ("" is dgx-a100).
	NodeDescription string
	// DriverRoot is the host root the driver is installed under ("/", "/run/nvidia/driver", ...);
	// the sim backend defaults it to its own simulated root.
	DriverRoot string
	// DevRoot is the host root whose dev/ holds the device nodes ("/" on real hardware); the sim
	// backend defaults it to its own simulated root and refuses "/".
	DevRoot string
	// SimDriverDir holds the simulated driver's files (libcuda.so.1, libnvidia-ml.so.1, nvidia-smi).
	SimDriverDir string
	// StateDir is where the sim backend keeps its simulated sysfs and procfs.
	StateDir string
}

// Open returns the backend the options ask for. There is no fallback from NVML to the simulated
// node: a GPU node whose driver cannot be loaded must fail loudly, not advertise simulated GPUs.
func Open(opts Options) (Backend, error) {
	switch opts.Backend {
	case "nvml", "":
		return OpenNVML(opts)
	case "sim":
		return OpenSim(opts)
	}
	return nil, fmt.Errorf("unknown GPU backend %q: use nvml (a real NVIDIA driver) or sim (the simulated node)", opts.Backend)
}

// nvmlBackend talks to the real driver.
type nvmlBackend struct {
	lib        nvml.Interface
	devRoot    string
	driverRoot string
}

// OpenNVML loads libnvidia-ml.so.1 from the driver root and initialises it.
func OpenNVML(opts Options) (Backend, error) {
	driverRoot, devRoot := opts.DriverRoot, opts.DevRoot
	if driverRoot == "" {
		driverRoot = "/"
	}
	if devRoot == "" {
		devRoot = "/"
	}
	path, err := findDriverLibrary(driverRoot, "libnvidia-ml.so.1")
	if err != nil {
		return nil, err
	}
	lib := nvml.New(nvml.WithLibraryPath(path))
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("initialise NVML from %s: %v (is the NVIDIA kernel module loaded and /dev/nvidiactl present under --dev-root %s? For a node without GPUs use --backend=sim or do not run tessera-node there)", path, nvml.ErrorString(ret), devRoot)
	}
	return &nvmlBackend{lib: lib, devRoot: devRoot, driverRoot: driverRoot}, nil
}

// driverLibDirs are where driver installs put their libraries, relative to the driver root: the
// distributions' multiarch and lib64 folders, and the flat lib64 of folders like /usr/local/nvidia.
var driverLibDirs = []string{"usr/lib/x86_64-linux-gnu", "usr/lib64", "lib/x86_64-linux-gnu", "lib64", "usr/lib", "lib",
	"usr/lib/aarch64-linux-gnu", "lib/aarch64-linux-gnu"}

// findDriverLibrary locates a driver library under the driver root, or says where it looked and
// which flag to set.
func findDriverLibrary(driverRoot, name string) (string, error) {
	var looked []string
	for _, d := range driverLibDirs {
		p := filepath.Join(driverRoot, d, name)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
			return p, nil
		}
		looked = append(looked, filepath.Join(driverRoot, d))
	}
	return "", fmt.Errorf("load NVML: %s not found under --driver-root %s (looked in %s): set --driver-root to where the NVIDIA driver is installed (/ for a driver on the host, /run/nvidia/driver with the GPU Operator's driver container, or a folder like /usr/local/nvidia), or --backend=sim for the simulated node",
		name, driverRoot, strings.Join(looked, ", "))
}

func (b *nvmlBackend) Name() string { return "nvml" }

func (b *nvmlBackend) NVML() nvml.Interface { return b.lib }

func (b *nvmlBackend) Discover(ctx context.Context) (*Node, error) {
	n, err := discover(b.lib, discoverOptions{migMinorsPath: "/proc/driver/nvidia-caps/mig-minors"})
	if err != nil {
		return nil, err
	}
	n.DevRoot, n.DriverRoot = b.devRoot, b.driverRoot
	n.ProcDevices = "/proc/devices"
	if err := EnsureDeviceNodes(n); err != nil {
		return nil, err
	}
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
