package gpu

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/NVIDIA/go-nvlib/pkg/nvmdev"

	"github.com/tessera-gpu/tessera/api"
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
		g := n.gpuByBus(p.Address)
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
		if g := n.gpuByBus(d.Parent.Address); g != nil {
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

func (n *Node) gpuByBus(bus string) *api.GPU {
	for i := range n.GPUs {
		if strings.EqualFold(n.GPUs[i].PCIBusID, bus) {
			return &n.GPUs[i]
		}
	}
	return nil
}
