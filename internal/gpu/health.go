package gpu

import (
	"context"
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// applicationXIDs are XIDs caused by the application, not the GPU (as NVIDIA's device plugin skips
// them): a bad kernel must not take the GPU away from everybody else.
var applicationXIDs = map[uint64]bool{13: true, 31: true, 43: true, 45: true, 68: true, 109: true}

// watchXID reports GPUs that raise critical XID errors as unhealthy, until ctx ends.
func watchXID(ctx context.Context, lib nvml.Interface, report func(HealthEvent)) error {
	set, ret := lib.EventSetCreate()
	if ret != nvml.SUCCESS {
		return nvmlErr("create NVML event set", ret)
	}
	defer set.Free()
	count, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nvmlErr("count devices", ret)
	}
	for i := 0; i < count; i++ {
		d, ret := lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nvmlErr(fmt.Sprintf("get device %d", i), ret)
		}
		if ret := d.RegisterEvents(nvml.EventTypeXidCriticalError|nvml.EventTypeSingleBitEccError|nvml.EventTypeDoubleBitEccError, set); ret != nvml.SUCCESS && ret != nvml.ERROR_NOT_SUPPORTED {
			return nvmlErr(fmt.Sprintf("register XID events on device %d", i), ret)
		}
	}
	for ctx.Err() == nil {
		e, ret := set.Wait(1000)
		if ret == nvml.ERROR_TIMEOUT {
			continue
		}
		if ret != nvml.SUCCESS {
			return nvmlErr("wait for NVML events", ret)
		}
		if ev, ok := healthEventFrom(e); ok {
			report(ev)
		}
	}
	return nil
}

// healthEventFrom turns an NVML event into a health change, or false when the event is harmless.
func healthEventFrom(e nvml.EventData) (HealthEvent, bool) {
	if e.EventType != nvml.EventTypeXidCriticalError || applicationXIDs[e.EventData] || e.Device == nil {
		return HealthEvent{}, false
	}
	uuid, ret := e.Device.GetUUID()
	if ret != nvml.SUCCESS {
		return HealthEvent{}, false
	}
	return HealthEvent{UUID: uuid, Healthy: false, Reason: fmt.Sprintf("XID %d", e.EventData)}, true
}
