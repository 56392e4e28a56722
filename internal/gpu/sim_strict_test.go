package gpu

import (
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// strictNode has one GPU of each kind the table needs: MIG-capable with MIG off (0), MIG on with
// one instance (1), and a GPU without MIG (2, an L40S).
const strictNode = "apiVersion: tessera.dev/v1\nkind: SimulatedNode\ngpus:\n- model: A100-SXM4-40GB\n  count: 1\n" +
	"- model: A100-SXM4-40GB\n  count: 1\n  mig: [1g.5gb]\n- model: L40S-PCIE-48GB\n  count: 1\n"

// TestSimRefusesLikeNVML is the table of where the simulated NVML mirrors real NVML's refusals.
// Each row names the call, the kind of handle, what nvml.h (go-nvml v0.13.4-0, pkg/nvml/nvml.h)
// documents and the line that says so.
func TestSimRefusesLikeNVML(t *testing.T) {
	b, n := openTestSim(t, strictNode)
	migOff := b.srv.Devices[0].(*server.Device)
	migOn := b.srv.Devices[1].(*server.Device)
	noMIG := b.srv.Devices[2].(*server.Device)
	mig := b.migs[1][0]
	b.SetECC(n.GPUs[0].UUID, false)
	lostSim, lostNode := openTestSim(t, strictNode)
	lostSim.SetLost(lostNode.GPUs[0].UUID, true)
	lost := lostSim.srv.Devices[0]
	set, _ := b.srv.EventSetCreate()
	defer set.Free()

	ret := func(_ any, r nvml.Return) nvml.Return { return r }
	for _, c := range []struct {
		call, handle, doc string
		want              nvml.Return
		got               func() nvml.Return
	}{
		{"nvmlDeviceGetAttributes_v2", "full GPU, MIG off", "5095: This API currently only supports MIG device handles", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { return ret(migOff.GetAttributes()) }},
		{"nvmlDeviceGetAttributes_v2", "full GPU, MIG on", "5095: This API currently only supports MIG device handles", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { return ret(migOn.GetAttributes()) }},
		{"nvmlDeviceGetAttributes_v2", "MIG device", "5095: (supported on MIG device handles)", nvml.SUCCESS,
			func() nvml.Return { return ret(mig.GetAttributes()) }},
		{"nvmlDeviceGetMigMode", "GPU without MIG", "13800: NOT_SUPPORTED If device doesn't support MIG mode", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { _, _, r := noMIG.GetMigMode(); return r }},
		{"nvmlDeviceSetMigMode", "GPU without MIG", "13778: NOT_SUPPORTED If device doesn't support MIG mode", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { r, _ := noMIG.SetMigMode(nvml.DEVICE_MIG_ENABLE); return r }},
		{"nvmlDeviceGetMigMode", "full GPU, MIG off", "13800: (MIG-capable: SUCCESS, mode disabled)", nvml.SUCCESS,
			func() nvml.Return { _, _, r := migOff.GetMigMode(); return r }},
		{"nvmlDeviceGetGpuInstanceProfileInfo", "GPU without MIG", "13824: NOT_SUPPORTED If device doesn't support MIG", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { return ret(noMIG.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)) }},
		{"nvmlDeviceGetGpuInstanceProfileInfo", "full GPU, profile past the last", "13823: INVALID_ARGUMENT If device, profile or info are invalid", nvml.ERROR_INVALID_ARGUMENT,
			func() nvml.Return { return ret(migOff.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_COUNT)) }},
		{"nvmlDeviceGetGpuInstances", "full GPU, MIG off", "14034: NOT_SUPPORTED If device doesn't have MIG mode enabled", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return {
				info, _ := migOff.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
				return ret(migOff.GetGpuInstances(&info))
			}},
		{"nvmlDeviceGetGpuInstanceById", "full GPU, MIG off", "14055: NOT_SUPPORTED If device doesn't have MIG mode enabled", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { return ret(migOff.GetGpuInstanceById(0)) }},
		{"nvmlDeviceCreateGpuInstance", "full GPU, MIG off", "13961: NOT_SUPPORTED If device doesn't have MIG mode enabled", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return {
				info, _ := migOff.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
				return ret(migOff.CreateGpuInstance(&info))
			}},
		{"nvmlDeviceGetMaxMigDeviceCount", "full GPU, MIG off (count must be 0)", "14400: Returns zero if MIG is not supported or enabled", nvml.SUCCESS,
			func() nvml.Return { return zeroCount(migOff.GetMaxMigDeviceCount()) }},
		{"nvmlDeviceGetMaxMigDeviceCount", "GPU without MIG (count must be 0)", "14400: Returns zero if MIG is not supported or enabled", nvml.SUCCESS,
			func() nvml.Return { return zeroCount(noMIG.GetMaxMigDeviceCount()) }},
		{"nvmlDeviceGetMigDeviceHandleByIndex", "full GPU, MIG off", "14435: INVALID_ARGUMENT if index ... is invalid (max count is 0)", nvml.ERROR_INVALID_ARGUMENT,
			func() nvml.Return { return ret(migOff.GetMigDeviceHandleByIndex(0)) }},
		{"nvmlDeviceGetMigDeviceHandleByIndex", "GPU without MIG", "14436: NOT_SUPPORTED if this query is not supported by the device", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { return ret(noMIG.GetMigDeviceHandleByIndex(0)) }},
		{"nvmlDeviceGetMigDeviceHandleByIndex", "full GPU, MIG on, empty index", "14437: NOT_FOUND if no valid MIG device was found at index", nvml.ERROR_NOT_FOUND,
			func() nvml.Return { return ret(migOn.GetMigDeviceHandleByIndex(5)) }},
		{"nvmlDeviceGetMigDeviceHandleByIndex", "MIG device", "14435: INVALID_ARGUMENT if device ... is invalid (not a parent)", nvml.ERROR_INVALID_ARGUMENT,
			func() nvml.Return { return ret(mig.GetMigDeviceHandleByIndex(0)) }},
		{"nvmlDeviceIsMigDeviceHandle", "full GPU (must say false)", "14345: True when handle refers to a MIG device", nvml.SUCCESS,
			func() nvml.Return {
				is, r := migOn.IsMigDeviceHandle()
				if is {
					return nvml.ERROR_UNKNOWN
				}
				return r
			}},
		{"nvmlDeviceGetGpuInstanceId", "full GPU", "14364/14371: Target MIG device handle; NOT_SUPPORTED if not supported by the device", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { return ret(migOn.GetGpuInstanceId()) }},
		{"nvmlDeviceGetComputeInstanceId", "full GPU", "14385/14392: Target MIG device handle; NOT_SUPPORTED if not supported by the device", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { return ret(migOn.GetComputeInstanceId()) }},
		{"nvmlDeviceGetDeviceHandleFromMigDeviceHandle", "full GPU", "14455: INVALID_ARGUMENT if migDevice ... is invalid", nvml.ERROR_INVALID_ARGUMENT,
			func() nvml.Return { return ret(migOn.GetDeviceHandleFromMigDeviceHandle()) }},
		{"nvmlDeviceGetHandleByUUID", "unknown UUID", "5209: NOT_FOUND if uuid does not match a valid device", nvml.ERROR_NOT_FOUND,
			func() nvml.Return {
				return ret(b.srv.DeviceGetHandleByUUID("GPU-00000000-0000-4000-8000-000000000000"))
			}},
		{"nvmlDeviceGetHandleByUUID", "MIG UUID", "5199: The UUID of the target GPU or MIG instance", nvml.SUCCESS,
			func() nvml.Return { return ret(b.srv.DeviceGetHandleByUUID(n.GPUs[1].MIG.Instances[0].UUID)) }},
		{"nvmlDeviceRegisterEvents", "full GPU, ECC off, DBE asked", "10677: NOT_SUPPORTED if ... some of requested event types", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return {
				return migOff.RegisterEvents(nvml.EventTypeXidCriticalError|nvml.EventTypeDoubleBitEccError, set)
			}},
		{"nvmlDeviceRegisterEvents", "MIG device", "10730: does not currently support per-instance event reporting using MIG device handles", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { return mig.RegisterEvents(nvml.EventTypeXidCriticalError, set) }},
		{"nvmlDeviceGetRemappedRows", "full GPU, MIG on", "9086: NOT_SUPPORTED If MIG is enabled", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { _, _, _, _, r := migOn.GetRemappedRows(); return r }},
		{"nvmlDeviceGetMemoryInfo", "GPU fallen off the bus", "7314: GPU_IS_LOST if the target GPU has fallen off the bus", nvml.ERROR_GPU_IS_LOST,
			func() nvml.Return { return ret(lost.GetMemoryInfo()) }},
		{"nvmlDeviceRegisterEvents", "GPU fallen off the bus", "10678: GPU_IS_LOST if the target GPU has fallen off the bus", nvml.ERROR_GPU_IS_LOST,
			func() nvml.Return { return lost.RegisterEvents(nvml.EventTypeXidCriticalError, set) }},
		{"nvmlEventSetWait_v2", "no event registered", "10740: TIMEOUT if no event arrived in specified timeout", nvml.ERROR_TIMEOUT,
			func() nvml.Return { return ret(set.Wait(1)) }},
	} {
		if got := c.got(); got != c.want {
			t.Errorf("%s on %s: sim returns %v, real NVML %v (nvml.h:%s)", c.call, c.handle, nvml.ErrorString(got), nvml.ErrorString(c.want), c.doc)
		}
	}
}

// zeroCount turns a MIG device count into SUCCESS only when it is zero.
func zeroCount(n int, r nvml.Return) nvml.Return {
	if r == nvml.SUCCESS && n != 0 {
		return nvml.ERROR_UNKNOWN
	}
	return r
}
