package gpu

import (
	"errors"
	"fmt"

	"github.com/NVIDIA/go-nvlib/pkg/nvlib/device"
	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// MIGPlacement is one way to carve a MIG instance out of a GPU: a GPU instance profile at one of
// its possible placements, with the full compute instance of that profile.
type MIGPlacement struct {
	// Profile is the profile as go-nvlib prints it, e.g. "1g.10gb" or "1g.10gb+me".
	Profile string
	// ProfileID is the GPU instance profile's ID (nvmlGpuInstanceProfileInfo_t.id).
	ProfileID uint32
	// Start and Size are the memory slices the instance occupies.
	Start, Size uint32
	// ComputeSlices, MemoryBytes and SMs are what the instance gets.
	ComputeSlices uint32
	MemoryBytes   int64
	SMs           int
	// ciProfile is the compute instance profile spanning the whole GPU instance.
	ciProfile int
}

// MIGCreated is a MIG instance Partitioner made.
type MIGCreated struct {
	UUID        string
	GPUInstance int
	// ComputeInstance is the compute instance's ID inside the GPU instance.
	ComputeInstance int
}

// ErrMIGInUse: the GPU (or instance) runs processes, so NVML refuses to change its MIG mode or
// destroy the instance; Tessera never resets a GPU to force it.
var ErrMIGInUse = errors.New("the GPU is in use (NVML: IN_USE)")

// Partitioner creates and destroys MIG instances through NVML, the same calls on hardware and on
// the simulated node. It switches MIG mode on for the first instance and off after the last, so a
// GPU without instances can be used whole again; both refuse while processes run on the GPU.
type Partitioner struct {
	lib    nvml.Interface
	devlib device.Interface
}

// NewPartitioner returns a Partitioner over lib (Backend.NVML()).
func NewPartitioner(lib nvml.Interface) *Partitioner {
	return &Partitioner{lib: lib, devlib: device.New(lib)}
}

func (p *Partitioner) handle(uuid string) (nvml.Device, error) {
	d, ret := p.lib.DeviceGetHandleByUUID(uuid)
	if ret != nvml.SUCCESS {
		return nil, nvmlErr("find GPU "+uuid, ret)
	}
	return d, nil
}

// Placements lists every profile the GPU offers at every possible placement (NVML lists them
// whether MIG mode is on or not), and the GPU's memory slices.
func (p *Partitioner) Placements(uuid string) ([]MIGPlacement, uint32, error) {
	d, err := p.handle(uuid)
	if err != nil {
		return nil, 0, err
	}
	mem, ret := d.GetMemoryInfo()
	if ret != nvml.SUCCESS {
		return nil, 0, nvmlErr("get memory of "+uuid, ret)
	}
	ciBySlices := map[uint32]int{1: nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, 2: nvml.COMPUTE_INSTANCE_PROFILE_2_SLICE,
		3: nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE, 4: nvml.COMPUTE_INSTANCE_PROFILE_4_SLICE, 6: nvml.COMPUTE_INSTANCE_PROFILE_6_SLICE,
		7: nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE, 8: nvml.COMPUTE_INSTANCE_PROFILE_8_SLICE}
	var out []MIGPlacement
	var slices uint32
	for i := 0; i < nvml.GPU_INSTANCE_PROFILE_COUNT; i++ {
		info, ret := d.GetGpuInstanceProfileInfo(i)
		if ret == nvml.ERROR_NOT_SUPPORTED || ret == nvml.ERROR_INVALID_ARGUMENT {
			continue
		}
		if ret != nvml.SUCCESS {
			return nil, 0, nvmlErr(fmt.Sprintf("get GPU instance profile %d of %s", i, uuid), ret)
		}
		ci, ok := ciBySlices[info.SliceCount]
		if !ok {
			continue
		}
		prof, err := p.devlib.NewMigProfile(i, ci, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, info.MemorySizeMB, mem.Total)
		if err != nil {
			continue
		}
		places, ret := d.GetGpuInstancePossiblePlacements(&info)
		if ret != nvml.SUCCESS {
			return nil, 0, nvmlErr("get placements of "+prof.String()+" on "+uuid, ret)
		}
		for _, pl := range places {
			out = append(out, MIGPlacement{Profile: prof.String(), ProfileID: info.Id, Start: pl.Start, Size: pl.Size, ComputeSlices: info.SliceCount,
				MemoryBytes: int64(info.MemorySizeMB) << 20, SMs: int(info.MultiprocessorCount), ciProfile: ci})
			slices = max(slices, pl.Start+pl.Size)
		}
	}
	return out, slices, nil
}

// Create makes a MIG instance of pl on the GPU: MIG mode on if it is off, the GPU instance at the
// placement, its full compute instance. A step that fails undoes the steps before it, so a failed
// Create leaves the GPU as it found it.
func (p *Partitioner) Create(uuid string, pl MIGPlacement) (MIGCreated, error) {
	d, err := p.handle(uuid)
	if err != nil {
		return MIGCreated{}, err
	}
	enabled, err := p.enableMIG(d, uuid)
	if err != nil {
		return MIGCreated{}, err
	}
	undo := func(err error) (MIGCreated, error) {
		if enabled {
			if uerr := p.disableIfEmpty(d, uuid); uerr != nil {
				err = fmt.Errorf("%w (and switching MIG mode back off failed: %v)", err, uerr)
			}
		}
		return MIGCreated{}, err
	}
	info, ret := profileInfoByID(d, pl.ProfileID)
	if ret != nvml.SUCCESS {
		return undo(nvmlErr(fmt.Sprintf("GPU %s has no MIG profile %s (ID %d)", uuid, pl.Profile, pl.ProfileID), ret))
	}
	gi, ret := d.CreateGpuInstanceWithPlacement(&info, &nvml.GpuInstancePlacement{Start: pl.Start, Size: pl.Size})
	if ret != nvml.SUCCESS {
		return undo(nvmlErr(fmt.Sprintf("create MIG %s at memory slice %d of GPU %s", pl.Profile, pl.Start, uuid), ret))
	}
	undoGI := func(err error) (MIGCreated, error) {
		if r := gi.Destroy(); r != nvml.SUCCESS {
			err = fmt.Errorf("%w (and destroying its GPU instance failed: %v)", err, nvml.ErrorString(r))
		}
		return undo(err)
	}
	giInfo, ret := gi.GetInfo()
	if ret != nvml.SUCCESS {
		return undoGI(nvmlErr("get the new GPU instance's ID", ret))
	}
	ciInfo, ret := gi.GetComputeInstanceProfileInfo(pl.ciProfile, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
	if ret != nvml.SUCCESS {
		return undoGI(nvmlErr("get the compute instance profile of "+pl.Profile, ret))
	}
	ci, ret := gi.CreateComputeInstance(&ciInfo)
	if ret != nvml.SUCCESS {
		return undoGI(nvmlErr("create the compute instance of "+pl.Profile, ret))
	}
	cInfo, ret := ci.GetInfo()
	if ret != nvml.SUCCESS {
		ci.Destroy()
		return undoGI(nvmlErr("get the new compute instance's ID", ret))
	}
	out := MIGCreated{GPUInstance: int(giInfo.Id), ComputeInstance: int(cInfo.Id)}
	if out.UUID, err = p.migUUID(d, out.GPUInstance, out.ComputeInstance); err != nil {
		ci.Destroy()
		return undoGI(err)
	}
	return out, nil
}

// Destroy removes the MIG instance gi/ci from the GPU and, when it was the last, switches MIG mode
// off. An instance that is already gone is not an error (a retried unprepare).
func (p *Partitioner) Destroy(uuid string, gi, ci int) error {
	d, err := p.handle(uuid)
	if err != nil {
		return err
	}
	if mode, _, ret := d.GetMigMode(); ret != nvml.SUCCESS || mode != nvml.DEVICE_MIG_ENABLE {
		return nil
	}
	g, ret := d.GetGpuInstanceById(gi)
	if ret == nvml.ERROR_NOT_FOUND {
		return p.disableIfEmpty(d, uuid)
	}
	if ret != nvml.SUCCESS {
		return nvmlErr(fmt.Sprintf("find GPU instance %d of %s", gi, uuid), ret)
	}
	if c, ret := g.GetComputeInstanceById(ci); ret == nvml.SUCCESS {
		if r := c.Destroy(); r == nvml.ERROR_IN_USE {
			return fmt.Errorf("destroy MIG instance %d/%d of GPU %s: %w", gi, ci, uuid, ErrMIGInUse)
		} else if r != nvml.SUCCESS {
			return nvmlErr(fmt.Sprintf("destroy compute instance %d/%d of %s", gi, ci, uuid), r)
		}
	} else if ret != nvml.ERROR_NOT_FOUND {
		return nvmlErr(fmt.Sprintf("find compute instance %d/%d of %s", gi, ci, uuid), ret)
	}
	if r := g.Destroy(); r == nvml.ERROR_IN_USE {
		return fmt.Errorf("destroy GPU instance %d of GPU %s: %w", gi, uuid, ErrMIGInUse)
	} else if r != nvml.SUCCESS {
		return nvmlErr(fmt.Sprintf("destroy GPU instance %d of %s", gi, uuid), r)
	}
	return p.disableIfEmpty(d, uuid)
}

// Instance is a GPU instance that exists on a GPU, with its compute instances.
type Instance struct {
	GPUInstance      int
	ProfileID        uint32
	Start, Size      uint32
	ComputeInstances []int
	// UUIDs are the MIG devices' UUIDs by compute instance ID.
	UUIDs map[int]string
}

// Instances lists the GPU's GPU instances (none while MIG mode is off).
func (p *Partitioner) Instances(uuid string) ([]Instance, error) {
	d, err := p.handle(uuid)
	if err != nil {
		return nil, err
	}
	if mode, _, ret := d.GetMigMode(); ret != nvml.SUCCESS || mode != nvml.DEVICE_MIG_ENABLE {
		return nil, nil
	}
	var out []Instance
	for i := 0; i < nvml.GPU_INSTANCE_PROFILE_COUNT; i++ {
		info, ret := d.GetGpuInstanceProfileInfo(i)
		if ret != nvml.SUCCESS {
			continue
		}
		gis, ret := d.GetGpuInstances(&info)
		if ret != nvml.SUCCESS {
			return nil, nvmlErr("list GPU instances of "+uuid, ret)
		}
		for _, g := range gis {
			gInfo, ret := g.GetInfo()
			if ret != nvml.SUCCESS {
				return nil, nvmlErr("get GPU instance of "+uuid, ret)
			}
			in := Instance{GPUInstance: int(gInfo.Id), ProfileID: gInfo.ProfileId, Start: gInfo.Placement.Start, Size: gInfo.Placement.Size, UUIDs: map[int]string{}}
			for c := 0; c < nvml.COMPUTE_INSTANCE_PROFILE_COUNT; c++ {
				cInfo, ret := g.GetComputeInstanceProfileInfo(c, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
				if ret != nvml.SUCCESS {
					continue
				}
				cis, _ := g.GetComputeInstances(&cInfo)
				for _, ci := range cis {
					if ciInfo, ret := ci.GetInfo(); ret == nvml.SUCCESS {
						in.ComputeInstances = append(in.ComputeInstances, int(ciInfo.Id))
						if u, err := p.migUUID(d, in.GPUInstance, int(ciInfo.Id)); err == nil {
							in.UUIDs[int(ciInfo.Id)] = u
						}
					}
				}
			}
			out = append(out, in)
		}
	}
	return out, nil
}

// enableMIG switches MIG mode on (true when it did). NVML reports a GPU that is not idle in the
// activation status (IN_USE), and a mode that needs a reset to take effect as pending: both are
// refused and the mode set back, since resetting a GPU is the operator's call, never Tessera's.
func (p *Partitioner) enableMIG(d nvml.Device, uuid string) (bool, error) {
	cur, _, ret := d.GetMigMode()
	if ret != nvml.SUCCESS {
		return false, nvmlErr("GPU "+uuid+" has no MIG mode", ret)
	}
	if cur == nvml.DEVICE_MIG_ENABLE {
		return false, nil
	}
	activation, ret := d.SetMigMode(nvml.DEVICE_MIG_ENABLE)
	if ret != nvml.SUCCESS {
		return false, nvmlErr("switch MIG mode on for GPU "+uuid, ret)
	}
	if activation == nvml.ERROR_IN_USE {
		d.SetMigMode(nvml.DEVICE_MIG_DISABLE)
		return false, fmt.Errorf("switch MIG mode on for GPU %s: %w; a process not held by Tessera runs on it", uuid, ErrMIGInUse)
	}
	if now, _, _ := d.GetMigMode(); activation != nvml.SUCCESS || now != nvml.DEVICE_MIG_ENABLE {
		d.SetMigMode(nvml.DEVICE_MIG_DISABLE)
		return false, fmt.Errorf("switch MIG mode on for GPU %s: it did not take effect (%v) and would need a GPU reset, which Tessera never does: enable MIG mode on it yourself (nvidia-smi -mig 1) or leave it out of dynamic MIG",
			uuid, nvml.ErrorString(activation))
	}
	return true, nil
}

// disableIfEmpty switches MIG mode off when no GPU instance is left, so the GPU can be given whole
// or shared again; with instances left it does nothing.
func (p *Partitioner) disableIfEmpty(d nvml.Device, uuid string) error {
	for i := 0; i < nvml.GPU_INSTANCE_PROFILE_COUNT; i++ {
		info, ret := d.GetGpuInstanceProfileInfo(i)
		if ret != nvml.SUCCESS {
			continue
		}
		if gis, ret := d.GetGpuInstances(&info); ret == nvml.SUCCESS && len(gis) > 0 {
			return nil
		}
	}
	activation, ret := d.SetMigMode(nvml.DEVICE_MIG_DISABLE)
	if ret != nvml.SUCCESS {
		return nvmlErr("switch MIG mode off for GPU "+uuid, ret)
	}
	if activation != nvml.SUCCESS {
		return fmt.Errorf("switch MIG mode off for GPU %s: %v", uuid, nvml.ErrorString(activation))
	}
	return nil
}

func profileInfoByID(d nvml.Device, id uint32) (nvml.GpuInstanceProfileInfo, nvml.Return) {
	for i := 0; i < nvml.GPU_INSTANCE_PROFILE_COUNT; i++ {
		if info, ret := d.GetGpuInstanceProfileInfo(i); ret == nvml.SUCCESS && info.Id == id {
			return info, nvml.SUCCESS
		}
	}
	return nvml.GpuInstanceProfileInfo{}, nvml.ERROR_NOT_SUPPORTED
}

// migUUID finds the MIG device of GPU instance gi, compute instance ci.
func (p *Partitioner) migUUID(d nvml.Device, gi, ci int) (string, error) {
	n, ret := d.GetMaxMigDeviceCount()
	if ret != nvml.SUCCESS {
		return "", nvmlErr("count MIG devices", ret)
	}
	for i := 0; i < n; i++ {
		m, ret := d.GetMigDeviceHandleByIndex(i)
		if ret != nvml.SUCCESS {
			continue
		}
		g, r1 := m.GetGpuInstanceId()
		c, r2 := m.GetComputeInstanceId()
		if r1 == nvml.SUCCESS && r2 == nvml.SUCCESS && g == gi && c == ci {
			u, ret := m.GetUUID()
			if ret != nvml.SUCCESS {
				return "", nvmlErr("get MIG UUID", ret)
			}
			return u, nil
		}
	}
	return "", fmt.Errorf("the new MIG instance %d/%d is not among the GPU's MIG devices", gi, ci)
}
