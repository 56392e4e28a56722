package gpu

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// This file makes the simulated NVML refuse what real NVML refuses (the table in sim_strict_test.go
// cites the nvml.h lines), and lets tests break the simulated GPUs the way hardware breaks.

// Faults is what the simulated node lets a test do to its GPUs, as the driver would report it.
type Faults interface {
	// InjectXID raises an XID on a GPU or, for a MIG UUID, on its parent attributed to the
	// instance's GI/CI. Like the driver it reaches only event sets registered for XIDs on that
	// GPU; ErrNotWatched says none was.
	InjectXID(uuid string, xid uint64) error
	// InjectEvent raises any event type (e.g. nvml.EventTypeDoubleBitEccError) on a GPU.
	InjectEvent(uuid string, eventType uint64) error
	// FailNextWait makes the next nvmlEventSetWait return ret (e.g. nvml.ERROR_GPU_IS_LOST).
	FailNextWait(ret nvml.Return)
	// SetLost makes the GPU fall off the bus: its queries answer ERROR_GPU_IS_LOST.
	SetLost(uuid string, lost bool) error
	// SetECC turns ECC on or off: without it the GPU supports no ECC events.
	SetECC(uuid string, enabled bool) error
	// SetRowRemapPending marks the GPU as needing a reset for pending row remappings.
	SetRowRemapPending(uuid string, pending bool) error
}

// ErrNotWatched: the injected event reached no event set, as no one had registered for it.
var ErrNotWatched = errors.New("no NVML event set is registered for this event on this GPU")

var _ Faults = (*simBackend)(nil)

// supportedEvents is what an Ampere/Hopper data-center GPU reports from
// nvmlDeviceGetSupportedEventTypes; the ECC events only while ECC is on.
const (
	simEventsBase = nvml.EventTypeXidCriticalError | nvml.EventTypePState | nvml.EventTypeClock |
		nvml.EventTypePowerSourceChange | nvml.EventMigConfigChange
	simEventsECC = nvml.EventTypeSingleBitEccError | nvml.EventTypeDoubleBitEccError
	// noInstance is NVML's "not attributable to a GPU/compute instance" in nvmlEventData_t.
	noInstance = 0xFFFFFFFF
)

// simGPUState is what faults change on one simulated GPU.
type simGPUState struct {
	lost, eccOff, remapPending bool
}

// simEvents is the simulated driver's event plumbing: the event sets and their registrations.
type simEvents struct {
	mu       sync.Mutex
	sets     map[*simEventSet]bool
	waitErrs chan nvml.Return
}

type simEventSet struct {
	mock.EventSet
	regs   map[nvml.Device]uint64
	events chan nvml.EventData
}

func (b *simBackend) state(d *server.Device) *simGPUState {
	b.faultMu.Lock()
	defer b.faultMu.Unlock()
	s := b.faults[d.Index]
	if s == nil {
		s = &simGPUState{}
		b.faults[d.Index] = s
	}
	return s
}

func (b *simBackend) lost(d *server.Device) bool {
	b.faultMu.Lock()
	defer b.faultMu.Unlock()
	return b.faults[d.Index] != nil && b.faults[d.Index].lost
}

// strictDevice makes a full GPU handle answer like real NVML where go-nvml's mock is kinder.
func (b *simBackend) strictDevice(d *server.Device, capable bool) {
	migEnabled := func() bool {
		mode, _, _ := d.GetMigMode()
		return capable && mode == nvml.DEVICE_MIG_ENABLE
	}
	// nvml.h: nvmlDeviceGetAttributes_v2 "currently only supports MIG device handles".
	d.GetAttributesFunc = func() (nvml.DeviceAttributes, nvml.Return) { return nvml.DeviceAttributes{}, nvml.ERROR_NOT_SUPPORTED }
	mockGetMigMode := d.GetMigModeFunc
	d.GetMigModeFunc = func() (int, int, nvml.Return) {
		if !capable { // "NVML_ERROR_NOT_SUPPORTED If device doesn't support MIG mode"
			return 0, 0, nvml.ERROR_NOT_SUPPORTED
		}
		return mockGetMigMode()
	}
	mockSetMigMode := d.SetMigModeFunc
	d.SetMigModeFunc = func(mode int) (nvml.Return, nvml.Return) {
		if !capable {
			return nvml.ERROR_NOT_SUPPORTED, nvml.ERROR_NOT_SUPPORTED
		}
		return mockSetMigMode(mode)
	}
	// "Returns zero if MIG is not supported or enabled."
	d.GetMaxMigDeviceCountFunc = func() (int, nvml.Return) {
		if !migEnabled() {
			return 0, nvml.SUCCESS
		}
		return 7, nvml.SUCCESS
	}
	d.GetMigDeviceHandleByIndexFunc = func(i int) (nvml.Device, nvml.Return) {
		switch {
		case !capable:
			return nil, nvml.ERROR_NOT_SUPPORTED
		case !migEnabled() || i < 0 || i >= 7: // the index is out of the (zero) max MIG device count
			return nil, nvml.ERROR_INVALID_ARGUMENT
		}
		migs := b.migHandles(d.Index)
		if i >= len(migs) {
			return nil, nvml.ERROR_NOT_FOUND // "if no valid MIG device was found at index"
		}
		return migs[i], nvml.SUCCESS
	}
	// nvmlDeviceGetGpuInstances / ById / nvmlDeviceCreateGpuInstance: "NVML_ERROR_NOT_SUPPORTED If
	// device doesn't have MIG mode enabled".
	mockGetGIs := d.GetGpuInstancesFunc
	d.GetGpuInstancesFunc = func(info *nvml.GpuInstanceProfileInfo) ([]nvml.GpuInstance, nvml.Return) {
		if !migEnabled() {
			return nil, nvml.ERROR_NOT_SUPPORTED
		}
		return mockGetGIs(info)
	}
	d.GetGpuInstanceByIdFunc = func(id int) (nvml.GpuInstance, nvml.Return) {
		if !migEnabled() {
			return nil, nvml.ERROR_NOT_SUPPORTED
		}
		d.RLock()
		defer d.RUnlock()
		for gi := range d.GpuInstances {
			if int(gi.Info.Id) == id {
				return gi, nvml.SUCCESS
			}
		}
		return nil, nvml.ERROR_NOT_FOUND
	}
	b.strictMIG(d, migEnabled)
	// MIG-handle-only queries on a full GPU handle.
	d.IsMigDeviceHandleFunc = func() (bool, nvml.Return) { return false, nvml.SUCCESS }
	d.GetGpuInstanceIdFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
	d.GetComputeInstanceIdFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
	d.GetDeviceHandleFromMigDeviceHandleFunc = func() (nvml.Device, nvml.Return) { return nil, nvml.ERROR_INVALID_ARGUMENT }

	// Health: what falls off the bus answers GPU_IS_LOST.
	mockMemory := d.GetMemoryInfoFunc
	d.GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) {
		if b.lost(d) {
			return nvml.Memory{}, nvml.ERROR_GPU_IS_LOST
		}
		return mockMemory()
	}
	d.GetSupportedEventTypesFunc = func() (uint64, nvml.Return) {
		if b.lost(d) {
			return 0, nvml.ERROR_GPU_IS_LOST
		}
		if b.state(d).eccOff {
			return simEventsBase, nvml.SUCCESS
		}
		return simEventsBase | simEventsECC, nvml.SUCCESS
	}
	d.RegisterEventsFunc = func(types uint64, set nvml.EventSet) nvml.Return {
		if b.lost(d) {
			return nvml.ERROR_GPU_IS_LOST
		}
		supported, _ := d.GetSupportedEventTypes()
		s, ok := set.(*simEventSet)
		switch {
		case !ok || types == 0:
			return nvml.ERROR_INVALID_ARGUMENT
		case types&^supported != 0:
			// "NVML_ERROR_NOT_SUPPORTED ... if the platform does not support ... some of requested
			// event types": then none of them is registered.
			return nvml.ERROR_NOT_SUPPORTED
		}
		b.events.mu.Lock()
		defer b.events.mu.Unlock()
		s.regs[d] |= types
		return nvml.SUCCESS
	}
	b.strictProcesses(d)
	// "NVML_ERROR_NOT_SUPPORTED If MIG is enabled or if the device doesn't support this feature".
	d.GetRemappedRowsFunc = func() (int, int, bool, bool, nvml.Return) {
		switch {
		case b.lost(d):
			return 0, 0, false, false, nvml.ERROR_GPU_IS_LOST
		case migEnabled():
			return 0, 0, false, false, nvml.ERROR_NOT_SUPPORTED
		}
		return 0, 0, b.state(d).remapPending, false, nvml.SUCCESS
	}
}

// strictMIGDevice completes a MIG device handle with what real NVML answers on one.
func (b *simBackend) strictMIGDevice(m *mock.Device, parent *server.Device, name string, memoryMB uint64) {
	m.GetNameFunc = func() (string, nvml.Return) { return name, nvml.SUCCESS }
	// Per-instance memory: "Per-instance information can be queried by using specific MIG device handles".
	m.GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) {
		if b.lost(parent) {
			return nvml.Memory{}, nvml.ERROR_GPU_IS_LOST
		}
		return nvml.Memory{Total: memoryMB << 20, Free: memoryMB << 20}, nvml.SUCCESS
	}
	// nvmlEventSetWait_v2: "This API does not currently support per-instance event reporting using
	// MIG device handles"; events are registered on the parent.
	m.RegisterEventsFunc = func(uint64, nvml.EventSet) nvml.Return { return nvml.ERROR_NOT_SUPPORTED }
	m.GetSupportedEventTypesFunc = func() (uint64, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
	// A MIG device is not a parent: no MIG devices under it, no MIG mode of its own.
	m.GetMigDeviceHandleByIndexFunc = func(int) (nvml.Device, nvml.Return) { return nil, nvml.ERROR_INVALID_ARGUMENT }
	m.GetMaxMigDeviceCountFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_INVALID_ARGUMENT }
	m.GetMigModeFunc = func() (int, int, nvml.Return) { return 0, 0, nvml.ERROR_NOT_SUPPORTED }
	m.GetRemappedRowsFunc = func() (int, int, bool, bool, nvml.Return) { return 0, 0, false, false, nvml.ERROR_NOT_SUPPORTED }
	strictMIGProcesses(m, func() bool { return b.lost(parent) })
}

// newEventSet is nvmlEventSetCreate: an empty set that receives what is registered on it from now on.
func (b *simBackend) newEventSet() (nvml.EventSet, nvml.Return) {
	s := &simEventSet{regs: map[nvml.Device]uint64{}, events: make(chan nvml.EventData, 64)}
	s.WaitFunc = func(timeout uint32) (nvml.EventData, nvml.Return) {
		select {
		case ret := <-b.events.waitErrs:
			return nvml.EventData{}, ret
		default:
		}
		select {
		case e := <-s.events:
			return e, nvml.SUCCESS
		case ret := <-b.events.waitErrs:
			return nvml.EventData{}, ret
		case <-time.After(time.Duration(timeout) * time.Millisecond):
			return nvml.EventData{}, nvml.ERROR_TIMEOUT
		}
	}
	s.FreeFunc = func() nvml.Return {
		b.events.mu.Lock()
		defer b.events.mu.Unlock()
		delete(b.events.sets, s)
		return nvml.SUCCESS
	}
	b.events.mu.Lock()
	b.events.sets[s] = true
	b.events.mu.Unlock()
	return s, nvml.SUCCESS
}

// deliver hands an event to every set registered for its type on its device.
func (b *simBackend) deliver(e nvml.EventData) error {
	b.events.mu.Lock()
	defer b.events.mu.Unlock()
	n := 0
	for s := range b.events.sets {
		if s.regs[e.Device]&e.EventType != 0 {
			select {
			case s.events <- e:
				n++
			default: // a full queue loses events, as the driver's does
			}
		}
	}
	if n == 0 {
		return ErrNotWatched
	}
	return nil
}

// device finds a simulated GPU by UUID, or the parent and GI/CI of a MIG UUID.
func (b *simBackend) device(uuid string) (*server.Device, uint32, uint32, error) {
	h, ret := b.srv.DeviceGetHandleByUUID(uuid)
	if ret != nvml.SUCCESS {
		return nil, 0, 0, fmt.Errorf("no simulated GPU or MIG device %s", uuid)
	}
	if d, ok := h.(*server.Device); ok {
		return d, noInstance, noInstance, nil
	}
	parent, _ := h.GetDeviceHandleFromMigDeviceHandle()
	gi, _ := h.GetGpuInstanceId()
	ci, _ := h.GetComputeInstanceId()
	return parent.(*server.Device), uint32(gi), uint32(ci), nil
}

func (b *simBackend) InjectXID(uuid string, xid uint64) error {
	d, gi, ci, err := b.device(uuid)
	if err != nil {
		return err
	}
	return b.deliver(nvml.EventData{Device: d, EventType: nvml.EventTypeXidCriticalError, EventData: xid, GpuInstanceId: gi, ComputeInstanceId: ci})
}

func (b *simBackend) InjectEvent(uuid string, eventType uint64) error {
	d, _, _, err := b.device(uuid)
	if err != nil {
		return err
	}
	return b.deliver(nvml.EventData{Device: d, EventType: eventType, GpuInstanceId: noInstance, ComputeInstanceId: noInstance})
}

func (b *simBackend) FailNextWait(ret nvml.Return) { b.events.waitErrs <- ret }

func (b *simBackend) SetLost(uuid string, lost bool) error {
	return b.setState(uuid, func(s *simGPUState) { s.lost = lost })
}

func (b *simBackend) SetECC(uuid string, enabled bool) error {
	return b.setState(uuid, func(s *simGPUState) { s.eccOff = !enabled })
}

func (b *simBackend) SetRowRemapPending(uuid string, pending bool) error {
	return b.setState(uuid, func(s *simGPUState) { s.remapPending = pending })
}

func (b *simBackend) setState(uuid string, change func(*simGPUState)) error {
	d, gi, _, err := b.device(uuid)
	if err != nil {
		return err
	}
	if gi != noInstance {
		return fmt.Errorf("%s is a MIG device: faults are set on its parent GPU", uuid)
	}
	s := b.state(d)
	b.faultMu.Lock()
	change(s)
	b.faultMu.Unlock()
	return nil
}
