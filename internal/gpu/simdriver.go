package gpu

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"

	"github.com/tessera-gpu/tessera/internal/fsatomic"
)

// The simulated node is a host root of its own, shaped like a real one, so the same code paths run
// on it as on a GPU node: dev/ holds the device nodes, proc/devices the kernel's majors, and the
// driver root the libraries, binaries, firmware and IPC socket NVIDIA's nvcdi looks for.
//
//	<root>/dev/nvidiactl, nvidia0..N, nvidia-uvm, nvidia-uvm-tools, nvidia-caps/*, vfio/*
//	<root>/proc/devices
//	<root>/usr/lib/x86_64-linux-gnu/libcuda.so.<version> (+ libcuda.so.1), libnvidia-ml.so.<version> (+ .so.1)
//	<root>/usr/bin/nvidia-smi
//	<root>/lib/firmware/nvidia/<version>/gsp_*.bin
//	<root>/run/nvidia-persistenced/socket
//	<root>/etc/tessera-sim/gpus   which GPU each /dev/nvidiaN is, for the simulated driver in containers
//
// The libraries and nvidia-smi are vcuda/test's fake driver (`make vcuda`: bin/vcuda/fake), read
// from Options.SimDriverDir; without it they are placeholders and CUDA does not run in containers.
const simLibDir = "usr/lib/x86_64-linux-gnu"

// simProcDevices lists the majors the simulated kernel gave its drivers (195 is NVIDIA's fixed one;
// the dynamic ones are unused numbers here).
const simProcDevices = `Character devices:
  1 mem
 10 misc
195 nvidia-frontend
195 nvidia
509 vfio
510 nvidia-caps
511 nvidia-uvm

Block devices:
  8 sd
`

const simPlaceholder = "tessera simulated driver placeholder: build the fake driver with `make vcuda` and pass --sim-driver-dir\n"

// writeSimDriverRoot lays out the simulated root's driver files for this driver version.
func writeSimDriverRoot(root, version, driverDir string) error {
	if version == "" || strings.ContainsAny(version, "/ ") {
		return fmt.Errorf("simulated driver version %q is not a version like 580.95.05", version)
	}
	files := []struct {
		rel, src string
		mode     os.FileMode
	}{
		{filepath.Join(simLibDir, "libcuda.so."+version), "libcuda.so.1", 0o755},
		{filepath.Join(simLibDir, "libnvidia-ml.so."+version), "libnvidia-ml.so.1", 0o755},
		{"usr/bin/nvidia-smi", "nvidia-smi", 0o755},
	}
	for _, f := range files {
		data := []byte(simPlaceholder)
		if driverDir != "" {
			var err error
			if data, err = os.ReadFile(filepath.Join(driverDir, f.src)); err != nil {
				return fmt.Errorf("simulated driver: %w (build it with `make vcuda`, or point --sim-driver-dir at bin/vcuda/fake)", err)
			}
		}
		if err := writeIfChanged(filepath.Join(root, f.rel), data, f.mode); err != nil {
			return err
		}
	}
	for link, target := range map[string]string{"libcuda.so.1": "libcuda.so." + version, "libnvidia-ml.so.1": "libnvidia-ml.so." + version} {
		if err := symlinkIfChanged(filepath.Join(root, simLibDir, link), target); err != nil {
			return err
		}
	}
	for _, fw := range []string{"gsp_ga10x.bin", "gsp_tu10x.bin"} {
		if err := writeIfChanged(filepath.Join(root, "lib/firmware/nvidia", version, fw), []byte("simulated GSP firmware\n"), 0o644); err != nil {
			return err
		}
	}
	if err := writeIfChanged(filepath.Join(root, "proc/devices"), []byte(simProcDevices), 0o644); err != nil {
		return err
	}
	return simSocket(filepath.Join(root, "run/nvidia-persistenced/socket"))
}

// writeSimGPUFile records which GPU each device minor is, in the format vcuda/test's fake driver
// reads: "<minor> <uuid> <memory bytes> <SMs> <compute capability> <name>", and for a GPU in MIG
// mode each instance, which CUDA in a container sees instead of the GPU (its memory and SMs), found
// by the capability minors the container's nodes carry: "mig <parent minor> <uuid> <GI cap minor>
// <CI cap minor> <memory bytes> <SMs> <profile>". An instance the fake could not honour (no memory
// or SMs, more than its GPU has, a profile or UUID that would not parse) is refused rather than
// written for the fake to skip.
func writeSimGPUFile(n *Node) error {
	var b bytes.Buffer
	b.WriteString("# minor uuid memoryBytes smCount computeCapability name (written by tessera-node's simulated node)\n")
	b.WriteString("# mig parentMinor uuid giCapMinor ciCapMinor memoryBytes smCount profile\n")
	for _, g := range n.GPUs {
		fmt.Fprintf(&b, "%d %s %d %d %s %s\n", g.Minor, g.UUID, g.MemoryBytes, g.SMCount, g.ComputeCapability, g.Model)
		if g.MIG == nil {
			continue
		}
		for _, m := range g.MIG.Instances {
			switch {
			case !strings.HasPrefix(m.UUID, "MIG-") || strings.ContainsAny(m.UUID, " \t\n#"):
				return fmt.Errorf("GPU %s: MIG instance UUID %q is not a MIG-... UUID", g.UUID, m.UUID)
			case m.Profile == "" || len(m.Profile) > 31 || strings.ContainsAny(m.Profile, " \t\n#"):
				return fmt.Errorf("GPU %s: MIG instance %s: profile %q is not a profile name like 1g.5gb", g.UUID, m.UUID, m.Profile)
			case m.MemoryBytes <= 0 || m.MemoryBytes > g.MemoryBytes:
				return fmt.Errorf("GPU %s: MIG instance %s has %d bytes of memory, want 1 to the GPU's %d", g.UUID, m.UUID, m.MemoryBytes, g.MemoryBytes)
			case m.SMCount <= 0 || m.SMCount > g.SMCount:
				return fmt.Errorf("GPU %s: MIG instance %s has %d SMs, want 1 to the GPU's %d", g.UUID, m.UUID, m.SMCount, g.SMCount)
			}
			fmt.Fprintf(&b, "mig %d %s %d %d %d %d %s\n", g.Minor, m.UUID, m.GICapMinor, m.CICapMinor, m.MemoryBytes, m.SMCount, m.Profile)
		}
	}
	return writeIfChanged(n.SimGPUFile, b.Bytes(), 0o644)
}

const maxUnixSocketPath = 107

// simSocket leaves a unix socket file where nvidia-persistenced's would be (nvcdi mounts it).
func simSocket(path string) error {
	if st, err := os.Lstat(path); err == nil && st.Mode()&os.ModeSocket != 0 {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	// sun_path holds 107 bytes and a NUL: bind's EINVAL would not say why.
	if len(path) > maxUnixSocketPath {
		return fmt.Errorf("simulated persistenced socket %s: %d bytes, more than a unix socket path can hold (%d); use a shorter --state-dir", path, len(path), maxUnixSocketPath)
	}
	_ = os.Remove(path)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return fmt.Errorf("simulated persistenced socket: %w", err)
	}
	l.SetUnlinkOnClose(false)
	return l.Close()
}

// writeIfChanged replaces a file atomically, and only when its content differs, so files already
// bind-mounted into running containers are not swapped under them for nothing.
func writeIfChanged(path string, data []byte, mode os.FileMode) error {
	if old, err := os.ReadFile(path); err == nil && bytes.Equal(old, data) {
		return nil
	}
	return fsatomic.WriteFile(path, data, mode)
}

func symlinkIfChanged(path, target string) error {
	if old, err := os.Readlink(path); err == nil && old == target {
		return nil
	}
	_ = os.Remove(path)
	return os.Symlink(target, path)
}
