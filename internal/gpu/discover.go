package gpu

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvlib/pkg/nvlib/device"
	"github.com/NVIDIA/go-nvml/pkg/nvml"

	api "github.com/tessera-gpu/tessera/api/v1"
)

type discoverOptions struct {
	// migMinorsPath is the driver's table of nvidia-caps minors (/proc/driver/nvidia-caps/mig-minors).
	migMinorsPath string
}

// cudaVersion spells NVML's CUDA driver version (1000 x major + 10 x minor) as "major.minor".
func cudaVersion(v int) string { return strconv.Itoa(v/1000) + "." + strconv.Itoa(v%1000/10) }

// discover reads every GPU through NVML. It is the one discovery path: the real driver and the
// simulated node (go-nvml's mock server) both go through it.
func discover(lib nvml.Interface, opts discoverOptions) (*Node, error) {
	devlib := device.New(lib)
	n := &Node{}
	if v, ret := lib.SystemGetDriverVersion(); ret == nvml.SUCCESS {
		n.DriverVersion = v
	}
	if v, ret := lib.SystemGetCudaDriverVersion(); ret == nvml.SUCCESS && v > 0 {
		n.CUDAVersion = cudaVersion(v)
	}
	var handles []nvml.Device
	var minors migMinors
	err := devlib.VisitDevices(func(i int, d device.Device) error {
		g, err := describeGPU(d)
		if err != nil {
			return fmt.Errorf("GPU %d: %w", i, err)
		}
		if _, _, ret := d.GetMigMode(); ret == nvml.SUCCESS {
			if n.MIGCapable == nil {
				n.MIGCapable = map[string]bool{}
			}
			n.MIGCapable[g.UUID] = true
		}
		migEnabled, err := d.IsMigEnabled()
		if err != nil {
			return fmt.Errorf("GPU %d (%s): %w", i, g.UUID, err)
		}
		if migEnabled {
			if minors == nil {
				if minors, err = readMigMinors(opts.migMinorsPath); err != nil {
					return err
				}
			}
			if g.MIG, err = describeMIG(d, g, minors); err != nil {
				return fmt.Errorf("GPU %d (%s) MIG: %w", i, g.UUID, err)
			}
		}
		n.GPUs = append(n.GPUs, g)
		handles = append(handles, d)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("discover GPUs through NVML: %w", err)
	}
	n.Links = describeLinks(lib, handles)
	return n, nil
}

func nvmlErr(what string, ret nvml.Return) error {
	return fmt.Errorf("%s: %v", what, nvml.ErrorString(ret))
}

func describeGPU(d device.Device) (api.GPU, error) {
	g := api.GPU{Healthy: true, NUMANode: -1}
	var ret nvml.Return
	if g.UUID, ret = d.GetUUID(); ret != nvml.SUCCESS {
		return g, nvmlErr("get UUID", ret)
	}
	if g.Index, ret = d.GetIndex(); ret != nvml.SUCCESS {
		return g, nvmlErr("get index", ret)
	}
	if g.Model, ret = d.GetName(); ret != nvml.SUCCESS {
		return g, nvmlErr("get name", ret)
	}
	mem, ret := d.GetMemoryInfo()
	if ret != nvml.SUCCESS {
		return g, nvmlErr("get memory info", ret)
	}
	g.MemoryBytes = int64(mem.Total)
	// Not GetAttributes: NVML documents it for MIG device handles only (see smcount.go).
	sms, err := smCount(d, g.Model)
	if err != nil {
		return g, err
	}
	g.SMCount = sms
	if cc, err := d.GetCudaComputeCapabilityAsString(); err == nil {
		g.ComputeCapability = cc
	}
	if numa, ret := d.GetNumaNodeId(); ret == nvml.SUCCESS {
		g.NUMANode = numa
	}
	bus, err := d.GetPCIBusID()
	if err != nil {
		return g, fmt.Errorf("get PCI bus id: %w", err)
	}
	g.PCIBusID = normalizeBusID(bus)
	if g.Minor, ret = d.GetMinorNumber(); ret != nvml.SUCCESS {
		return g, nvmlErr("get minor number", ret)
	}
	return g, nil
}

// normalizeBusID turns NVML's "00000000:07:00.0" into the sysfs form "0000:07:00.0".
func normalizeBusID(id string) string {
	id = strings.ToLower(id)
	if dom, rest, ok := strings.Cut(id, ":"); ok && len(dom) == 8 {
		return dom[4:] + ":" + rest
	}
	return id
}

func describeMIG(d device.Device, parent api.GPU, minors migMinors) (*api.MIG, error) {
	mig := &api.MIG{Instances: []api.MIGInstance{}}
	err := d.VisitMigDevices(func(_ int, m device.MigDevice) error {
		inst := api.MIGInstance{}
		var ret nvml.Return
		if inst.UUID, ret = m.GetUUID(); ret != nvml.SUCCESS {
			return nvmlErr("get MIG UUID", ret)
		}
		profile, err := m.GetProfile()
		if err != nil {
			return fmt.Errorf("MIG %s: %w", inst.UUID, err)
		}
		inst.Profile = profile.String()
		attrs, ret := m.GetAttributes()
		if ret != nvml.SUCCESS {
			return nvmlErr("get MIG attributes", ret)
		}
		inst.MemoryBytes = int64(attrs.MemorySizeMB) << 20
		inst.SMCount = int(attrs.MultiprocessorCount)
		if inst.GPUInstanceID, ret = m.GetGpuInstanceId(); ret != nvml.SUCCESS {
			return nvmlErr("get GPU instance id", ret)
		}
		if inst.ComputeInstanceID, ret = m.GetComputeInstanceId(); ret != nvml.SUCCESS {
			return nvmlErr("get compute instance id", ret)
		}
		if inst.GICapMinor, inst.CICapMinor, err = minors.lookup(parent.Minor, inst.GPUInstanceID, inst.ComputeInstanceID); err != nil {
			return err
		}
		mig.Instances = append(mig.Instances, inst)
		return nil
	})
	return mig, err
}

// describeLinks classifies every GPU pair: NVLink when peer-to-peer over NVLink works, otherwise by
// the PCIe common ancestor.
func describeLinks(lib nvml.Interface, handles []nvml.Device) []api.Link {
	var links []api.Link
	for i := range handles {
		for j := i + 1; j < len(handles); j++ {
			a, b := handles[i], handles[j]
			ai, _ := a.GetIndex()
			bi, _ := b.GetIndex()
			link := api.Link{A: ai, B: bi, Kind: api.LinkSystem}
			if st, ret := lib.DeviceGetP2PStatus(a, b, nvml.P2P_CAPS_INDEX_NVLINK); ret == nvml.SUCCESS && st == nvml.P2P_STATUS_OK {
				link.Kind, link.NVLinks = api.LinkNVLink, activeNVLinks(a)
			} else if lvl, ret := lib.DeviceGetTopologyCommonAncestor(a, b); ret == nvml.SUCCESS {
				link.Kind = topologyKind(lvl)
			}
			links = append(links, link)
		}
	}
	return links
}

func topologyKind(lvl nvml.GpuTopologyLevel) api.LinkKind {
	switch {
	case lvl <= nvml.TOPOLOGY_MULTIPLE:
		return api.LinkPCIeSwitch
	case lvl == nvml.TOPOLOGY_HOSTBRIDGE:
		return api.LinkHostBridge
	case lvl == nvml.TOPOLOGY_NODE:
		return api.LinkNUMA
	}
	return api.LinkSystem
}

func activeNVLinks(d nvml.Device) int {
	n := 0
	for l := 0; l < nvml.NVLINK_MAX_LINKS; l++ {
		if st, ret := d.GetNvLinkState(l); ret == nvml.SUCCESS && st == nvml.FEATURE_ENABLED {
			n++
		}
	}
	return n
}
