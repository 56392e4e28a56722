package gpu

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Device numbers of the simulated nodes. 195 is the NVIDIA driver's real major; the dynamic majors of
// nvidia-uvm and nvidia-caps are fixed to unused numbers here. Nothing ever opens them: a container
// only has to see them, with the numbers the CDI spec carries.
const (
	nvidiaMajor    = 195
	nvidiaCtlMinor = 255
	simUVMMajor    = 511
	simCapsMajor   = 510
	simVFIOMajor   = 509
	miscMajor      = 10
	vfioCtlMinor   = 196
)

// createDeviceNodes makes the simulated node's character devices under its dev root, replacing any
// file of the wrong kind or number, so CDI specs resolve them like real ones.
func createDeviceNodes(n *Node) error {
	type spec struct {
		name         string
		major, minor uint32
	}
	specs := []spec{{"nvidiactl", nvidiaMajor, nvidiaCtlMinor}, {"nvidia-uvm", simUVMMajor, 0}, {"nvidia-uvm-tools", simUVMMajor, 1}}
	for _, g := range n.GPUs {
		specs = append(specs, spec{fmt.Sprintf("nvidia%d", g.Minor), nvidiaMajor, uint32(g.Minor)})
		if g.MIG == nil {
			continue
		}
		for _, m := range g.MIG.Instances {
			specs = append(specs,
				spec{fmt.Sprintf("nvidia-caps/nvidia-cap%d", m.GICapMinor), simCapsMajor, uint32(m.GICapMinor)},
				spec{fmt.Sprintf("nvidia-caps/nvidia-cap%d", m.CICapMinor), simCapsMajor, uint32(m.CICapMinor)})
		}
	}
	if len(n.Mdevs) > 0 {
		specs = append(specs, spec{"vfio/vfio", miscMajor, vfioCtlMinor})
	}
	for _, m := range n.Mdevs {
		specs = append(specs, spec{fmt.Sprintf("vfio/%d", m.IOMMUGroup), simVFIOMajor, uint32(m.IOMMUGroup)})
	}
	for _, s := range specs {
		if err := ensureCharDevice(filepath.Join(n.DevRoot, s.name), s.major, s.minor); err != nil {
			return fmt.Errorf("create simulated device node: %w", err)
		}
	}
	return nil
}

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
		return fmt.Errorf("mknod %s (%d:%d): %w (the simulated node needs root or CAP_MKNOD)", path, major, minor, err)
	}
	return nil
}
