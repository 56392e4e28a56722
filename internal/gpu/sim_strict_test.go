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

// refusalHandles are the handles the table runs on; a nil one means this machine has none of that
// kind (a real node without MIG, say), and its rows do not apply.
type refusalHandles struct {
	migOff, migOn, noMIG, mig, eccOff, lost nvml.Device
	migUUID                                 string
	set                                     nvml.EventSet
}

func (h refusalHandles) has(kind string) bool {
	d := map[string]nvml.Device{"migOff": h.migOff, "migOn": h.migOn, "noMIG": h.noMIG, "mig": h.mig, "eccOff": h.eccOff, "lost": h.lost}[kind]
	return kind == "" || d != nil
}

type refusal struct {
	needs, call, handle, doc string
	want                     nvml.Return
	got                      func() nvml.Return
}

// refusalTable is where real NVML refuses, and so must the sim. Each row names the call, the kind
// of handle, what nvml.h (go-nvml v0.13.4-0, pkg/nvml/nvml.h) documents and the line that says so.
// The same rows run against a real driver in nvml_real_test.go.
func refusalTable(lib nvml.Interface, h refusalHandles) []refusal {
	ret := func(_ any, r nvml.Return) nvml.Return { return r }
	return []refusal{
		{"migOff", "nvmlDeviceGetAttributes_v2", "full GPU, MIG off", "5095: This API currently only supports MIG device handles", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { return ret(h.migOff.GetAttributes()) }},
		{"migOn", "nvmlDeviceGetAttributes_v2", "full GPU, MIG on", "5095: This API currently only supports MIG device handles", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { return ret(h.migOn.GetAttributes()) }},
		{"mig", "nvmlDeviceGetAttributes_v2", "MIG device", "5095: (supported on MIG device handles)", nvml.SUCCESS,
			func() nvml.Return { return ret(h.mig.GetAttributes()) }},
		{"noMIG", "nvmlDeviceGetMigMode", "GPU without MIG", "13800: NOT_SUPPORTED If device doesn't support MIG mode", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { _, _, r := h.noMIG.GetMigMode(); return r }},
		{"noMIG", "nvmlDeviceSetMigMode", "GPU without MIG", "13778: NOT_SUPPORTED If device doesn't support MIG mode", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { r, _ := h.noMIG.SetMigMode(nvml.DEVICE_MIG_ENABLE); return r }},
		{"migOff", "nvmlDeviceGetMigMode", "full GPU, MIG off", "13800: (MIG-capable: SUCCESS, mode disabled)", nvml.SUCCESS,
			func() nvml.Return { _, _, r := h.migOff.GetMigMode(); return r }},
		{"noMIG", "nvmlDeviceGetGpuInstanceProfileInfo", "GPU without MIG", "13824: NOT_SUPPORTED If device doesn't support MIG", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { return ret(h.noMIG.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)) }},
		{"migOff", "nvmlDeviceGetGpuInstanceProfileInfo", "full GPU, profile past the last", "13823: INVALID_ARGUMENT If device, profile or info are invalid", nvml.ERROR_INVALID_ARGUMENT,
			func() nvml.Return { return ret(h.migOff.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_COUNT)) }},
		{"migOff", "nvmlDeviceGetGpuInstances", "full GPU, MIG off", "14034: NOT_SUPPORTED If device doesn't have MIG mode enabled", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return {
				info, _ := h.migOff.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
				return ret(h.migOff.GetGpuInstances(&info))
			}},
		{"migOff", "nvmlDeviceGetGpuInstanceById", "full GPU, MIG off", "14055: NOT_SUPPORTED If device doesn't have MIG mode enabled", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { return ret(h.migOff.GetGpuInstanceById(0)) }},
		{"migOff", "nvmlDeviceCreateGpuInstance", "full GPU, MIG off", "13961: NOT_SUPPORTED If device doesn't have MIG mode enabled", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return {
				info, _ := h.migOff.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
				return ret(h.migOff.CreateGpuInstance(&info))
			}},
		{"migOff", "nvmlDeviceGetMaxMigDeviceCount", "full GPU, MIG off (count must be 0)", "14400: Returns zero if MIG is not supported or enabled", nvml.SUCCESS,
			func() nvml.Return { return zeroCount(h.migOff.GetMaxMigDeviceCount()) }},
		{"noMIG", "nvmlDeviceGetMaxMigDeviceCount", "GPU without MIG (count must be 0)", "14400: Returns zero if MIG is not supported or enabled", nvml.SUCCESS,
			func() nvml.Return { return zeroCount(h.noMIG.GetMaxMigDeviceCount()) }},
		{"migOff", "nvmlDeviceGetMigDeviceHandleByIndex", "full GPU, MIG off", "14435: INVALID_ARGUMENT if index ... is invalid (max count is 0)", nvml.ERROR_INVALID_ARGUMENT,
			func() nvml.Return { return ret(h.migOff.GetMigDeviceHandleByIndex(0)) }},
		{"noMIG", "nvmlDeviceGetMigDeviceHandleByIndex", "GPU without MIG", "14436: NOT_SUPPORTED if this query is not supported by the device", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { return ret(h.noMIG.GetMigDeviceHandleByIndex(0)) }},
		{"migOn", "nvmlDeviceGetMigDeviceHandleByIndex", "full GPU, MIG on, empty index", "14437: NOT_FOUND if no valid MIG device was found at index", nvml.ERROR_NOT_FOUND,
			func() nvml.Return { return ret(h.migOn.GetMigDeviceHandleByIndex(5)) }},
		{"mig", "nvmlDeviceGetMigDeviceHandleByIndex", "MIG device", "14435: INVALID_ARGUMENT if device ... is invalid (not a parent)", nvml.ERROR_INVALID_ARGUMENT,
			func() nvml.Return { return ret(h.mig.GetMigDeviceHandleByIndex(0)) }},
		{"migOn", "nvmlDeviceIsMigDeviceHandle", "full GPU (must say false)", "14345: True when handle refers to a MIG device", nvml.SUCCESS,
			func() nvml.Return {
				is, r := h.migOn.IsMigDeviceHandle()
				if is {
					return nvml.ERROR_UNKNOWN
				}
				return r
			}},
		{"migOn", "nvmlDeviceGetGpuInstanceId", "full GPU", "14364/14371: Target MIG device handle; NOT_SUPPORTED if not supported by the device", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { return ret(h.migOn.GetGpuInstanceId()) }},
		{"migOn", "nvmlDeviceGetComputeInstanceId", "full GPU", "14385/14392: Target MIG device handle; NOT_SUPPORTED if not supported by the device", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { return ret(h.migOn.GetComputeInstanceId()) }},
		{"migOn", "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", "full GPU", "14455: INVALID_ARGUMENT if migDevice ... is invalid", nvml.ERROR_INVALID_ARGUMENT,
			func() nvml.Return { return ret(h.migOn.GetDeviceHandleFromMigDeviceHandle()) }},
		{"", "nvmlDeviceGetHandleByUUID", "unknown UUID", "5209: NOT_FOUND if uuid does not match a valid device", nvml.ERROR_NOT_FOUND,
			func() nvml.Return {
				return ret(lib.DeviceGetHandleByUUID("GPU-00000000-0000-4000-8000-000000000000"))
			}},
		{"mig", "nvmlDeviceGetHandleByUUID", "MIG UUID", "5199: The UUID of the target GPU or MIG instance", nvml.SUCCESS,
			func() nvml.Return { return ret(lib.DeviceGetHandleByUUID(h.migUUID)) }},
		{"eccOff", "nvmlDeviceRegisterEvents", "full GPU, ECC off, DBE asked", "10677: NOT_SUPPORTED if ... some of requested event types", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return {
				return h.eccOff.RegisterEvents(nvml.EventTypeXidCriticalError|nvml.EventTypeDoubleBitEccError, h.set)
			}},
		{"mig", "nvmlDeviceRegisterEvents", "MIG device", "10730: does not currently support per-instance event reporting using MIG device handles", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { return h.mig.RegisterEvents(nvml.EventTypeXidCriticalError, h.set) }},
		{"migOn", "nvmlDeviceGetRemappedRows", "full GPU, MIG on", "9086: NOT_SUPPORTED If MIG is enabled", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return { _, _, _, _, r := h.migOn.GetRemappedRows(); return r }},
		{"migOff", "nvmlDeviceGetGpuInstancePossiblePlacements_v2", "full GPU, MIG off", "13896: placements ... regardless of whether MIG is enabled or not", nvml.SUCCESS,
			func() nvml.Return {
				info, _ := h.migOff.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
				places, r := h.migOff.GetGpuInstancePossiblePlacements(&info)
				if r == nvml.SUCCESS && len(places) == 0 {
					return nvml.ERROR_UNKNOWN
				}
				return r
			}},
		{"migOff", "nvmlDeviceCreateGpuInstanceWithPlacement", "full GPU, MIG off", "13988: NOT_SUPPORTED If device doesn't have MIG mode enabled", nvml.ERROR_NOT_SUPPORTED,
			func() nvml.Return {
				info, _ := h.migOff.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
				return ret(h.migOff.CreateGpuInstanceWithPlacement(&info, &nvml.GpuInstancePlacement{Start: 0, Size: 1}))
			}},
		{"migOn", "nvmlDeviceCreateGpuInstanceWithPlacement", "full GPU, placement over an existing instance", "13897/13990: creation will fail if there is overlap; INSUFFICIENT_RESOURCES", nvml.ERROR_INSUFFICIENT_RESOURCES,
			func() nvml.Return {
				gi := firstGPUInstance(h.migOn)
				if gi == nil {
					return nvml.ERROR_UNKNOWN
				}
				info, _ := gi.GetInfo()
				prof, r := profileByID(h.migOn, info.ProfileId)
				if r != nvml.SUCCESS {
					return r
				}
				return ret(h.migOn.CreateGpuInstanceWithPlacement(&prof, &info.Placement))
			}},
		{"migOn", "nvmlDeviceCreateGpuInstanceWithPlacement", "full GPU, placement the profile does not have", "13986: INVALID_ARGUMENT If ... placement ... are invalid", nvml.ERROR_INVALID_ARGUMENT,
			func() nvml.Return {
				info, _ := h.migOn.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
				return ret(h.migOn.CreateGpuInstanceWithPlacement(&info, &nvml.GpuInstancePlacement{Start: 99, Size: 1}))
			}},
		{"migOn", "nvmlDeviceCreateGpuInstanceWithPlacement", "full GPU, profile ID the GPU lacks", "13986: INVALID_ARGUMENT If ... profileId ... are invalid", nvml.ERROR_INVALID_ARGUMENT,
			func() nvml.Return {
				info := nvml.GpuInstanceProfileInfo{Id: 99, SliceCount: 1}
				return ret(h.migOn.CreateGpuInstanceWithPlacement(&info, &nvml.GpuInstancePlacement{Start: 0, Size: 1}))
			}},
		{"migOn", "nvmlGpuInstanceDestroy", "GPU instance with a compute instance", "14010: IN_USE if ... compute instances are active on the GPU instance", nvml.ERROR_IN_USE,
			func() nvml.Return {
				gi := firstGPUInstance(h.migOn)
				if gi == nil {
					return nvml.ERROR_UNKNOWN
				}
				return gi.Destroy()
			}},
		{"lost", "nvmlDeviceGetMemoryInfo", "GPU fallen off the bus", "7314: GPU_IS_LOST if the target GPU has fallen off the bus", nvml.ERROR_GPU_IS_LOST,
			func() nvml.Return { return ret(h.lost.GetMemoryInfo()) }},
		{"lost", "nvmlDeviceRegisterEvents", "GPU fallen off the bus", "10678: GPU_IS_LOST if the target GPU has fallen off the bus", nvml.ERROR_GPU_IS_LOST,
			func() nvml.Return { return h.lost.RegisterEvents(nvml.EventTypeXidCriticalError, h.set) }},
		{"", "nvmlEventSetWait_v2", "no event registered", "10740: TIMEOUT if no event arrived in specified timeout", nvml.ERROR_TIMEOUT,
			func() nvml.Return { return ret(h.set.Wait(1)) }},
	}
}

// TestSimRefusesLikeNVML runs the refusal table on the simulated node.
func TestSimRefusesLikeNVML(t *testing.T) {
	b, n := openTestSim(t, strictNode)
	lostSim, lostNode := openTestSim(t, strictNode)
	lostSim.SetLost(lostNode.GPUs[0].UUID, true)
	b.SetECC(n.GPUs[0].UUID, false)
	set, _ := b.srv.EventSetCreate()
	defer set.Free()
	h := refusalHandles{migOff: b.srv.Devices[0].(*server.Device), migOn: b.srv.Devices[1].(*server.Device),
		noMIG: b.srv.Devices[2].(*server.Device), mig: b.migs[1][0], eccOff: b.srv.Devices[0], lost: lostSim.srv.Devices[0],
		migUUID: n.GPUs[1].MIG.Instances[0].UUID, set: set}
	for _, c := range refusalTable(b.srv, h) {
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

// firstGPUInstance is a GPU instance that exists on d (nil: none).
func firstGPUInstance(d nvml.Device) nvml.GpuInstance {
	for i := 0; i < nvml.GPU_INSTANCE_PROFILE_COUNT; i++ {
		info, r := d.GetGpuInstanceProfileInfo(i)
		if r != nvml.SUCCESS {
			continue
		}
		if gis, r := d.GetGpuInstances(&info); r == nvml.SUCCESS && len(gis) > 0 {
			return gis[0]
		}
	}
	return nil
}

func profileByID(d nvml.Device, id uint32) (nvml.GpuInstanceProfileInfo, nvml.Return) {
	for i := 0; i < nvml.GPU_INSTANCE_PROFILE_COUNT; i++ {
		if info, r := d.GetGpuInstanceProfileInfo(i); r == nvml.SUCCESS && info.Id == id {
			return info, r
		}
	}
	return nvml.GpuInstanceProfileInfo{}, nvml.ERROR_NOT_FOUND
}
