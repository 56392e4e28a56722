package gpu

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/NVIDIA/go-nvlib/pkg/nvmdev"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// openSysfsMdev reads the host's /sys/class/mdev_bus and /sys/bus/mdev.
func openSysfsMdev() nvmdev.Interface {
	if _, err := os.Stat("/sys/class/mdev_bus"); err != nil {
		return nil
	}
	return nvmdev.New()
}

// addMdev fills each parent GPU's mdev types and the node's live mdev devices.
func addMdev(n *Node, lib nvmdev.Interface) error {
	if lib == nil {
		return nil
	}
	parents, err := lib.GetAllParentDevices()
	if err != nil {
		return fmt.Errorf("list mdev parents: %w", err)
	}
	for _, p := range parents {
		g := n.GPUByBus(p.Address)
		if g == nil {
			continue
		}
		types, err := mdevTypes(p)
		if err != nil {
			return err
		}
		g.Mdev = types
	}
	devs, err := lib.GetAllDevices()
	if err != nil {
		return fmt.Errorf("list mdev devices: %w", err)
	}
	for _, d := range devs {
		typ := strings.TrimPrefix(d.MDEVType, "NVIDIA ")
		n.Mdevs = append(n.Mdevs, MdevDevice{UUID: d.UUID, Type: typ, ParentBus: d.Parent.Address, IOMMUGroup: d.IommuGroup})
		if g := n.GPUByBus(d.Parent.Address); g != nil {
			for i := range g.Mdev {
				if g.Mdev[i].Name == typ {
					g.Mdev[i].Instances = append(g.Mdev[i].Instances, d.UUID)
				}
			}
		}
	}
	return nil
}

// mdevTypes lists a parent's supported types from sysfs (go-nvlib keeps its own map private).
func mdevTypes(p *nvmdev.ParentDevice) ([]api.MdevType, error) {
	names, err := filepath.Glob(filepath.Join(p.Path, "mdev_supported_types", "nvidia-*", "name"))
	if err != nil {
		return nil, err
	}
	var out []api.MdevType
	for _, f := range names {
		raw, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("read mdev type name: %w", err)
		}
		name := strings.TrimPrefix(strings.TrimSpace(string(raw)), "NVIDIA ")
		avail, err := p.GetAvailableMDEVInstances(name)
		if err != nil {
			return nil, err
		}
		out = append(out, api.MdevType{Name: name, ID: filepath.Base(filepath.Dir(f)), Available: max(avail, 0)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

// GPUByBus returns the GPU at a PCI address, or nil.
func (n *Node) GPUByBus(bus string) *api.GPU {
	for i := range n.GPUs {
		if strings.EqualFold(n.GPUs[i].PCIBusID, bus) {
			return &n.GPUs[i]
		}
	}
	return nil
}

// createMdev writes the UUID to the type's create file under the parent, as the kernel expects.
func createMdev(lib nvmdev.Interface, parentBus, typeName, uuid string) error {
	if lib == nil {
		return fmt.Errorf("create mdev %s: this node has no mdev parents", uuid)
	}
	parents, err := lib.GetAllParentDevices()
	if err != nil {
		return fmt.Errorf("create mdev %s: %w", uuid, err)
	}
	for _, p := range parents {
		if strings.EqualFold(p.Address, parentBus) {
			if err := p.CreateMDEVDevice(typeName, uuid); err != nil {
				return fmt.Errorf("create mdev %s of type %s on %s: %w", uuid, typeName, parentBus, err)
			}
			return nil
		}
	}
	return fmt.Errorf("create mdev %s: no mdev parent at %s", uuid, parentBus)
}

// removeMdev finds the mdev device and removes it with remove (the kernel's "remove" file on real sysfs).
func removeMdev(lib nvmdev.Interface, uuid string, remove func(*nvmdev.Device) error) error {
	if lib == nil {
		return nil
	}
	devs, err := lib.GetAllDevices()
	if err != nil {
		return fmt.Errorf("remove mdev %s: %w", uuid, err)
	}
	for _, d := range devs {
		if d.UUID == uuid {
			if err := remove(d); err != nil {
				return fmt.Errorf("remove mdev %s: %w", uuid, err)
			}
		}
	}
	return nil
}
