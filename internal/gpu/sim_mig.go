package gpu

import (
	"fmt"
	"strings"

	"github.com/NVIDIA/go-nvlib/pkg/nvlib/device"
	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// This file makes the simulated GPUs' MIG instances come and go as on real hardware: go-nvml's mock
// creates any GPU instance anywhere, destroys what is in use and never shows a created instance as
// a MIG device. The rows of the refusal table in sim_strict_test.go cite nvml.h for each refusal.

// maxGPUInstances is how many GPU instances the driver numbers per GPU (mig-minors lists gi0..gi14).
const maxGPUInstances = 15

// strictMIG wraps a MIG-capable GPU's MIG calls (strictDevice has already made them refuse while
// MIG mode is off).
func (b *simBackend) strictMIG(d *server.Device, migEnabled func() bool) {
	mockSetMigMode := d.SetMigModeFunc
	d.SetMigModeFunc = func(mode int) (nvml.Return, nvml.Return) {
		// nvml.h 13762: "if device unbind fails because the device isn't idle, NVML_ERROR_IN_USE
		// would be returned" as the activation status; the mode does not change.
		cur, _, ret := d.GetMigMode()
		if ret != nvml.SUCCESS { // no MIG on this GPU: the refusal of strictDevice
			return mockSetMigMode(mode)
		}
		if cur != mode && b.busy(d) {
			return nvml.ERROR_IN_USE, nvml.SUCCESS
		}
		if mode == nvml.DEVICE_MIG_DISABLE {
			d.RLock()
			n := len(d.GpuInstances)
			d.RUnlock()
			if n > 0 { // the driver tears no instances down behind their users' backs
				return nvml.ERROR_IN_USE, nvml.SUCCESS
			}
		}
		return mockSetMigMode(mode)
	}
	d.CreateGpuInstanceWithPlacementFunc = func(info *nvml.GpuInstanceProfileInfo, p *nvml.GpuInstancePlacement) (nvml.GpuInstance, nvml.Return) {
		switch {
		case !migEnabled(): // 13961/13988: NOT_SUPPORTED if MIG mode is not enabled
			return nil, nvml.ERROR_NOT_SUPPORTED
		case info == nil || p == nil || !b.offers(d, info.Id, *p): // 13986: INVALID_ARGUMENT (profile or placement invalid)
			return nil, nvml.ERROR_INVALID_ARGUMENT
		case b.overlaps(d, *p): // 13890: "Creation ... will fail if there is overlap with the already occupied memory slices"
			return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
		}
		return b.createGI(d, info, *p)
	}
	// Without a placement the driver picks a free one (the first, here).
	d.CreateGpuInstanceFunc = func(info *nvml.GpuInstanceProfileInfo) (nvml.GpuInstance, nvml.Return) {
		if !migEnabled() {
			return nil, nvml.ERROR_NOT_SUPPORTED
		}
		if info == nil {
			return nil, nvml.ERROR_INVALID_ARGUMENT
		}
		for _, p := range d.Config.MIGProfiles.GpuInstancePlacements[int(info.Id)] {
			if !b.overlaps(d, p) {
				return d.CreateGpuInstanceWithPlacement(info, &p)
			}
		}
		return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
	}
}

// busy: a process runs on the GPU (the simulated driver's accounting).
func (b *simBackend) busy(d *server.Device) bool {
	procs, ret := d.GetComputeRunningProcesses()
	return ret == nvml.SUCCESS && len(procs) > 0
}

// offers: the GPU has this GPU instance profile ID and the placement is one of its possible ones.
func (b *simBackend) offers(d *server.Device, profileID uint32, p nvml.GpuInstancePlacement) bool {
	known := false
	for _, info := range d.Config.MIGProfiles.GpuInstanceProfiles {
		known = known || info.Id == profileID
	}
	if !known {
		return false
	}
	for _, q := range d.Config.MIGProfiles.GpuInstancePlacements[int(profileID)] {
		if q == p {
			return true
		}
	}
	return false
}

// overlaps: p shares a memory slice with a GPU instance that exists.
func (b *simBackend) overlaps(d *server.Device, p nvml.GpuInstancePlacement) bool {
	d.RLock()
	defer d.RUnlock()
	for gi := range d.GpuInstances {
		q := gi.Info.Placement
		if p.Start < q.Start+q.Size && q.Start < p.Start+p.Size {
			return true
		}
	}
	return false
}

// createGI creates the GPU instance with the lowest free ID (the driver reuses IDs; go-nvml's mock
// counts up forever, past what mig-minors lists) and makes its calls strict.
func (b *simBackend) createGI(d *server.Device, info *nvml.GpuInstanceProfileInfo, p nvml.GpuInstancePlacement) (nvml.GpuInstance, nvml.Return) {
	d.Lock()
	used := map[uint32]bool{}
	for gi := range d.GpuInstances {
		used[gi.Info.Id] = true
	}
	id := uint32(0)
	for used[id] {
		id++
	}
	if id >= maxGPUInstances {
		d.Unlock()
		return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
	}
	gi := server.NewGpuInstanceFromInfo(nvml.GpuInstanceInfo{Device: d, Id: id, ProfileId: info.Id, Placement: p}, d.Config.MIGProfiles)
	d.GpuInstances[gi] = struct{}{}
	d.Unlock()
	giInfo := *info
	mockCreateCI := gi.CreateComputeInstanceFunc
	gi.CreateComputeInstanceFunc = func(ciInfo *nvml.ComputeInstanceProfileInfo) (nvml.ComputeInstance, nvml.Return) {
		cih, ret := mockCreateCI(ciInfo)
		if ret != nvml.SUCCESS {
			return nil, ret
		}
		ci := cih.(*server.ComputeInstance)
		m := b.addMIGHandle(d, gi, ci, giInfo, *ciInfo)
		mockDestroyCI := ci.DestroyFunc
		ci.DestroyFunc = func() nvml.Return {
			// 14264: IN_USE "if processes (e.g. CUDA application) are active on the compute instance".
			if procs, ret := m.GetComputeRunningProcesses(); ret == nvml.SUCCESS && len(procs) > 0 {
				return nvml.ERROR_IN_USE
			}
			b.removeMIGHandle(d.Index, m)
			return mockDestroyCI()
		}
		return ci, nvml.SUCCESS
	}
	gi.GetComputeInstanceByIdFunc = func(id int) (nvml.ComputeInstance, nvml.Return) {
		gi.RLock()
		defer gi.RUnlock()
		for c := range gi.ComputeInstances {
			if int(c.Info.Id) == id {
				return c, nvml.SUCCESS
			}
		}
		return nil, nvml.ERROR_NOT_FOUND
	}
	mockDestroyGI := gi.DestroyFunc
	gi.DestroyFunc = func() nvml.Return {
		gi.RLock()
		n := len(gi.ComputeInstances)
		gi.RUnlock()
		if n > 0 { // 14010: IN_USE if "compute instances are active on the GPU instance"
			return nvml.ERROR_IN_USE
		}
		return mockDestroyGI()
	}
	return gi, nvml.SUCCESS
}

// addMIGHandle makes a compute instance visible as a MIG device (GetMigDeviceHandleByIndex,
// DeviceGetHandleByUUID), with a UUID derived from the seed and how many instances this GPU has
// had, so that a recreated instance has a new UUID as on hardware.
func (b *simBackend) addMIGHandle(d *server.Device, gi *server.GpuInstance, ci *server.ComputeInstance, giInfo nvml.GpuInstanceProfileInfo, ciInfo nvml.ComputeInstanceProfileInfo) *mock.Device {
	b.migMu.Lock()
	n := b.migSerial[d.Index]
	b.migSerial[d.Index]++
	b.migMu.Unlock()
	uuid := "MIG-" + b.uuid("mig", d.Index, n)
	m := &mock.Device{
		IsMigDeviceHandleFunc: func() (bool, nvml.Return) { return true, nvml.SUCCESS },
		GetUUIDFunc:           func() (string, nvml.Return) { return uuid, nvml.SUCCESS },
		GetAttributesFunc: func() (nvml.DeviceAttributes, nvml.Return) {
			return nvml.DeviceAttributes{MultiprocessorCount: ciInfo.MultiprocessorCount, MemorySizeMB: giInfo.MemorySizeMB,
				GpuInstanceSliceCount: giInfo.SliceCount, ComputeInstanceSliceCount: ciInfo.SliceCount}, nvml.SUCCESS
		},
		GetGpuInstanceIdFunc:                   func() (int, nvml.Return) { return int(gi.Info.Id), nvml.SUCCESS },
		GetComputeInstanceIdFunc:               func() (int, nvml.Return) { return int(ci.Info.Id), nvml.SUCCESS },
		GetDeviceHandleFromMigDeviceHandleFunc: func() (nvml.Device, nvml.Return) { return d, nvml.SUCCESS },
	}
	b.strictMIGDevice(m, d, fmt.Sprintf("%s MIG %s", strings.TrimPrefix(d.Config.Name, "Mock "), b.profileName(d, giInfo, ciInfo)), giInfo.MemorySizeMB)
	b.migMu.Lock()
	b.migs[d.Index] = append(b.migs[d.Index], m)
	b.migMu.Unlock()
	return m
}

func (b *simBackend) removeMIGHandle(index int, m nvml.Device) {
	b.migMu.Lock()
	defer b.migMu.Unlock()
	migs := b.migs[index]
	for i := range migs {
		if migs[i] == m {
			b.migs[index] = append(migs[:i:i], migs[i+1:]...)
			return
		}
	}
}

// migHandles is a copy of a GPU's MIG device handles.
func (b *simBackend) migHandles(index int) []nvml.Device {
	b.migMu.Lock()
	defer b.migMu.Unlock()
	return append([]nvml.Device(nil), b.migs[index]...)
}

// profileName is the profile as go-nvlib prints it (e.g. "1g.10gb+me").
func (b *simBackend) profileName(d *server.Device, gi nvml.GpuInstanceProfileInfo, ci nvml.ComputeInstanceProfileInfo) string {
	for idx, info := range d.Config.MIGProfiles.GpuInstanceProfiles {
		if info.Id != gi.Id {
			continue
		}
		p, err := device.New(b.srv).NewMigProfile(idx, int(ci.Id), nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, gi.MemorySizeMB, d.MemoryInfo.Total)
		if err == nil {
			return p.String()
		}
	}
	return fmt.Sprintf("profile-%d", gi.Id)
}

// fitPlacements places the instances of a description's MIG list on a GPU, the way an operator's
// tool (mig-parted) would: a placement per profile with no two sharing a memory slice, found by
// search since the first free slot of each in turn can strand a later one.
func fitPlacements(d *server.Device, infos []nvml.GpuInstanceProfileInfo) ([]nvml.GpuInstancePlacement, bool) {
	out := make([]nvml.GpuInstancePlacement, len(infos))
	var used uint64
	var fit func(i int) bool
	fit = func(i int) bool {
		if i == len(infos) {
			return true
		}
		for _, p := range d.Config.MIGProfiles.GpuInstancePlacements[int(infos[i].Id)] {
			mask := (uint64(1)<<p.Size - 1) << p.Start
			if used&mask != 0 {
				continue
			}
			used |= mask
			out[i] = p
			if fit(i + 1) {
				return true
			}
			used &^= mask
		}
		return false
	}
	return out, fit(0)
}
