package gpu

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Device numbers. 195 is the NVIDIA driver's fixed major (nvidiactl is its minor 255); nvidia-uvm
// and nvidia-caps get dynamic majors, which the kernel lists in /proc/devices. VFIO groups of the
// simulated node use a fixed unused major.
const (
	nvidiaMajor    = 195
	nvidiaCtlMinor = 255
	simVFIOMajor   = 509
	miscMajor      = 10
	vfioCtlMinor   = 196
)

// charDevice is a device node to ensure under the dev root.
type charDevice struct {
	name         string // relative to dev/, e.g. "nvidia-uvm"
	major, minor uint32
}

// EnsureDeviceNodes makes sure the device nodes every GPU container needs exist under the node's
// dev root with the numbers the kernel gives them, creating missing ones the way nvidia-modprobe
// does (nvidiactl and nvidiaN on major 195; nvidia-uvm, nvidia-uvm-tools and nvidia-caps/* on the
// majors /proc/devices lists). A node whose kernel module is not loaded cannot get its nodes: that
// is an error naming the module, and the agent stays not ready until it is fixed.
func EnsureDeviceNodes(n *Node) error {
	majors, err := readProcDevices(n.ProcDevices)
	if err != nil {
		return err
	}
	need := []charDevice{{"nvidiactl", nvidiaMajor, nvidiaCtlMinor}}
	for _, g := range n.GPUs {
		need = append(need, charDevice{fmt.Sprintf("nvidia%d", g.Minor), nvidiaMajor, uint32(g.Minor)})
	}
	uvm, ok := majors["nvidia-uvm"]
	if !ok {
		return fmt.Errorf("the nvidia-uvm kernel module is not loaded (no nvidia-uvm in %s), so /dev/nvidia-uvm cannot be created and CUDA cannot run: load it on the node (`nvidia-modprobe -u -c=0` or `modprobe nvidia-uvm`)", n.ProcDevices)
	}
	need = append(need, charDevice{"nvidia-uvm", uvm, 0}, charDevice{"nvidia-uvm-tools", uvm, 1})
	var caps []charDevice
	for _, g := range n.GPUs {
		if g.MIG == nil {
			continue
		}
		for _, m := range g.MIG.Instances {
			caps = append(caps,
				charDevice{fmt.Sprintf("nvidia-caps/nvidia-cap%d", m.GICapMinor), 0, uint32(m.GICapMinor)},
				charDevice{fmt.Sprintf("nvidia-caps/nvidia-cap%d", m.CICapMinor), 0, uint32(m.CICapMinor)})
		}
	}
	if len(caps) > 0 {
		capsMajor, ok := majors["nvidia-caps"]
		if !ok {
			return fmt.Errorf("MIG instances exist but nvidia-caps is not in %s, so their access nodes cannot be created: load the nvidia module with MIG support (`nvidia-modprobe -f /proc/driver/nvidia/capabilities/...`)", n.ProcDevices)
		}
		for i := range caps {
			caps[i].major = capsMajor
		}
		need = append(need, caps...)
	}
	for _, d := range need {
		if err := ensureCharDevice(filepath.Join(n.DevRoot, "dev", d.name), d.major, d.minor); err != nil {
			return fmt.Errorf("device node /dev/%s: %w", d.name, err)
		}
	}
	return nil
}

// readProcDevices returns the character-device majors by driver name from a /proc/devices file.
func readProcDevices(path string) (map[string]uint32, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read the kernel's device majors: %w", err)
	}
	defer f.Close()
	majors := map[string]uint32{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, "Block devices") {
			break
		}
		fields := strings.Fields(line)
		if len(fields) != 2 {
			continue
		}
		if m, err := strconv.ParseUint(fields[0], 10, 32); err == nil {
			majors[fields[1]] = uint32(m)
		}
	}
	return majors, sc.Err()
}

// createVFIONodes makes the simulated node's VFIO nodes (the real ones come from the vfio driver).
func createVFIONodes(n *Node) error {
	if len(n.Mdevs) == 0 {
		return nil
	}
	need := []charDevice{{"vfio/vfio", miscMajor, vfioCtlMinor}}
	for _, m := range n.Mdevs {
		need = append(need, charDevice{fmt.Sprintf("vfio/%d", m.IOMMUGroup), simVFIOMajor, uint32(m.IOMMUGroup)})
	}
	for _, d := range need {
		if err := ensureCharDevice(filepath.Join(n.DevRoot, "dev", d.name), d.major, d.minor); err != nil {
			return fmt.Errorf("create simulated device node: %w", err)
		}
	}
	return nil
}

// ensureCharDevice leaves a character device with the right number alone and replaces anything else.
func ensureCharDevice(path string, major, minor uint32) error {
	want := unix.Mkdev(major, minor)
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err == nil {
		if st.Mode&unix.S_IFMT == unix.S_IFCHR && st.Rdev == want {
			return nil
		}
		if err := os.Remove(path); err != nil {
			return err
		}
	} else if !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("stat %s: %w", path, err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	if err := unix.Mknod(path, unix.S_IFCHR|0o666, int(want)); err != nil {
		return fmt.Errorf("mknod %s (%d:%d): %w (needs root or CAP_MKNOD)", path, major, minor, err)
	}
	return nil
}
