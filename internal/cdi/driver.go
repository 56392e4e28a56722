package cdi

import (
	"fmt"
	"log/slog"
	"path/filepath"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/nvidia-container-toolkit/pkg/nvcdi"
	"github.com/NVIDIA/nvidia-container-toolkit/pkg/nvcdi/transform/root"
	"golang.org/x/sys/unix"
	specs "tags.cncf.io/container-device-interface/specs-go"

	"github.com/tessera-gpu/tessera/internal/gpu"
)

// Driver is where the NVIDIA driver's files are and how the CDI specs reach them. The driver part
// of every GPU spec (libraries, binaries such as nvidia-smi, GSP firmware, IPC sockets, the control
// device nodes and the ldcache/symlink hooks) comes from NVIDIA's own nvcdi library, exactly as
// `nvidia-ctk cdi generate` would write it; Tessera adds its parts (vcuda) on top.
type Driver struct {
	// Root is where this process sees the driver root (in the DaemonSet: a hostPath mount); empty:
	// the discovered node's.
	Root string
	// HostRoot is the driver root's path on the host, which the specs must name ("" = Root).
	HostRoot string
	// DevRoot is where this process sees the root whose dev/ holds the device nodes (empty: the
	// discovered node's); HostDevRoot is its host path ("" = DevRoot).
	DevRoot, HostDevRoot string
	// HookPath is the host path of the nvidia-cdi-hook binary the specs' hooks run.
	HookPath string
	// NVML is the backend's library; nvcdi uses it only where it needs the driver.
	NVML nvml.Interface
	// Log receives nvcdi's lines (nil: discarded).
	Log *slog.Logger
}

// CommonEdits returns the edits every GPU container needs (not mdev VMs): nvcdi's common edits
// over the driver root, as this process sees it (toHostPaths turns them into host paths).
func (d *Driver) CommonEdits() (specs.ContainerEdits, error) {
	if d == nil {
		return specs.ContainerEdits{}, fmt.Errorf("no driver root configured: CDI specs without the driver's libraries cannot run CUDA")
	}
	if !filepath.IsAbs(d.HookPath) {
		return specs.ContainerEdits{}, fmt.Errorf("the nvidia-cdi-hook path must be absolute, got %q (set --cdi-hook-path)", d.HookPath)
	}
	lib, err := nvcdi.New(
		nvcdi.WithMode(nvcdi.ModeNvml),
		nvcdi.WithNvmlLib(d.NVML),
		nvcdi.WithDriverRoot(d.Root),
		nvcdi.WithDevRoot(d.DevRoot),
		nvcdi.WithNVIDIACDIHookPath(d.HookPath),
		nvcdi.WithLogger(nvcdiLogger{d.logger().With("component", "nvcdi")}),
		// One path on every node: the driver version comes from NVML, never from sandboxutils.
		nvcdi.WithFeatureFlag(nvcdi.FeatureDisableNvsandboxUtils),
	)
	if err != nil {
		return specs.ContainerEdits{}, fmt.Errorf("nvcdi: %w", err)
	}
	common, err := lib.GetCommonEdits()
	if err != nil {
		return specs.ContainerEdits{}, fmt.Errorf("the NVIDIA driver's files under driver root %s: %w (is --driver-root right?)", d.Root, err)
	}
	return *common.ContainerEdits, nil
}

// toHostPaths rewrites a spec generated where this process sees the driver and dev roots into host
// paths (the DaemonSet sees the host's driver root through a mount; containerd needs host paths).
func (d *Driver) toHostPaths(spec *specs.Spec) error {
	t := root.NewDriverTransformer(
		root.WithDriverRoot(d.Root), root.WithTargetDriverRoot(orDefault(d.HostRoot, d.Root)),
		root.WithDevRoot(d.DevRoot), root.WithTargetDevRoot(orDefault(d.HostDevRoot, d.DevRoot)))
	if err := t.Transform(spec); err != nil {
		return fmt.Errorf("CDI spec %s: driver root to host paths: %w", spec.Kind, err)
	}
	return nil
}

func orDefault(v, def string) string {
	if v == "" {
		return def
	}
	return v
}

// fillDeviceNumbers sets each node's type, major and minor from the device file that exists now,
// and fails on one that does not: a spec must not promise a device the host lacks.
func fillDeviceNumbers(edits *specs.ContainerEdits) error {
	for _, n := range edits.DeviceNodes {
		p := n.HostPath
		if p == "" {
			p = n.Path
		}
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil {
			return fmt.Errorf("device node %s: %w", p, err)
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFCHR:
			n.Type = "c"
		case unix.S_IFBLK:
			n.Type = "b"
		default:
			return fmt.Errorf("device node %s is not a device (mode %#o)", p, st.Mode)
		}
		n.Major, n.Minor = int64(unix.Major(st.Rdev)), int64(unix.Minor(st.Rdev))
	}
	return nil
}

// simEdits are the simulated node's extra edits: the file that tells the simulated driver inside
// a container which GPU each /dev/nvidiaN is, and the simulated driver's state directory, where it
// records each process's device memory for the host's NVML (read-write: a real driver keeps this in
// the kernel; see internal/testing/README.md). Real nodes have none.
func simEdits(n *gpu.Node) []*specs.Mount {
	if n.SimGPUFile == "" {
		return nil
	}
	m := []*specs.Mount{{HostPath: n.SimGPUFile, ContainerPath: gpu.SimGPUFileInContainer, Options: []string{"ro", "nosuid", "nodev", "bind"}}}
	if n.SimDriverState != "" {
		m = append(m, &specs.Mount{HostPath: n.SimDriverState, ContainerPath: gpu.SimDriverStateInContainer,
			Options: []string{"rw", "nosuid", "nodev", "noexec", "bind"}})
	}
	return m
}

func (d *Driver) logger() *slog.Logger {
	if d.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return d.Log
}

// nvcdiLogger gives nvcdi the process's slog logger (its logger interface is the toolkit's own).
// nvcdi's Info lines ("Using driver version ...") repeat on every refresh: debug detail here.
type nvcdiLogger struct{ log *slog.Logger }

func (l nvcdiLogger) Tracef(format string, args ...any)   { l.log.Debug(fmt.Sprintf(format, args...)) }
func (l nvcdiLogger) Debugf(format string, args ...any)   { l.log.Debug(fmt.Sprintf(format, args...)) }
func (l nvcdiLogger) Infof(format string, args ...any)    { l.log.Debug(fmt.Sprintf(format, args...)) }
func (l nvcdiLogger) Warningf(format string, args ...any) { l.log.Warn(fmt.Sprintf(format, args...)) }
func (l nvcdiLogger) Errorf(format string, args ...any)   { l.log.Error(fmt.Sprintf(format, args...)) }
