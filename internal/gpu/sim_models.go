package gpu

import (
	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus"
)

// SimModels are the models a description may use: go-nvml's mock GPUs, corrected where the mock
// differs from the product (PCI device IDs, H100 MIG numbers), plus a GPU without MIG.
var SimModels = map[string]simModel{
	"A100-SXM4-40GB":  {gpus.A100_SXM4_40GB},
	"A100-SXM4-80GB":  {gpus.A100_SXM4_80GB},
	"A100-PCIE-40GB":  {gpus.A100_PCIE_40GB},
	"A100-PCIE-80GB":  {gpus.A100_PCIE_80GB},
	"A30-PCIE-24GB":   {gpus.A30_PCIE_24GB},
	"H100-SXM5-80GB":  {h100SXM5},
	"H200-SXM5-141GB": {withPCIDevice(gpus.H200_SXM5_141GB, 0x2335)},
	"B200-SXM5-180GB": {withPCIDevice(gpus.B200_SXM5_180GB, 0x2901)},
	"L40S-PCIE-48GB":  {l40s},
}

// simModel is a GPU model the simulated node can hold.
type simModel struct {
	config gpus.Config
}

// migCapable: a model without GPU instance profiles has no MIG mode at all (NVML answers
// NOT_SUPPORTED to every MIG call on it).
func (m simModel) migCapable() bool { return len(m.config.MIGProfiles.GpuInstanceProfiles) > 0 }

// nvlinksOf is the number of NVLinks of an SXM GPU: 12 NVLink3 on Ampere, 18 NVLink4/5 on Hopper
// and Blackwell.
func nvlinksOf(arch nvml.DeviceArchitecture) int {
	if arch == nvml.DEVICE_ARCH_HOPPER || arch == nvml.DEVICE_ARCH_BLACKWELL {
		return 18
	}
	return 12
}

func withPCIDevice(c gpus.Config, device uint32) gpus.Config {
	c.PciDeviceId = device<<16 | 0x10de
	return c
}

// l40s is an Ada GPU without MIG, so the simulated node also has GPUs on which NVML refuses MIG calls.
var l40s = gpus.Config{
	Name:         "NVIDIA L40S",
	Architecture: nvml.DEVICE_ARCH_ADA,
	Brand:        nvml.BRAND_NVIDIA,
	MemoryMB:     46068,
	CudaMajor:    8,
	CudaMinor:    9,
	PciDeviceId:  0x26b910de,
}

// h100MIG is one H100 80GB GPU instance profile as `nvidia-smi mig -lgip` prints it on an
// H100 80GB HBM3: profile ID, instances, memory (GiB there, MiB here), SMs, CE/DEC/JPEG/OFA.
type h100MIG struct {
	index                              int // NVML_GPU_INSTANCE_PROFILE_* passed to GetGpuInstanceProfileInfo
	id, slices, instances, sms         uint32
	memoryMB                           uint64
	copyEngines, decoders, jpegs, ofas uint32
}

// h100Profiles: go-nvml's H100 mock keeps A100-like placeholders (1g.20gb with 16 SMs, 7g.80gb
// with 112 SMs, 10240 MiB slices, enum indexes as profile IDs); these are the product's numbers.
var h100Profiles = []h100MIG{
	{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 19, 1, 7, 16, 9984, 1, 1, 1, 0},       // 1g.10gb, 9.75 GiB
	{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, 1, 1, 16, 9984, 1, 1, 1, 1},  // 1g.10gb+me
	{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, 1, 4, 26, 20096, 1, 1, 1, 0}, // 1g.20gb, 19.62 GiB
	{nvml.GPU_INSTANCE_PROFILE_2_SLICE, 14, 2, 3, 32, 20096, 2, 2, 2, 0},      // 2g.20gb
	{nvml.GPU_INSTANCE_PROFILE_3_SLICE, 9, 3, 2, 60, 40448, 3, 3, 3, 0},       // 3g.40gb, 39.50 GiB
	{nvml.GPU_INSTANCE_PROFILE_4_SLICE, 5, 4, 1, 64, 40448, 4, 4, 4, 0},       // 4g.40gb
	{nvml.GPU_INSTANCE_PROFILE_7_SLICE, 0, 7, 1, 132, 81152, 8, 7, 7, 1},      // 7g.80gb, 79.25 GiB
}

// h100SXM5 is go-nvml's H100 SXM5 80GB with h100Profiles. Each GPU instance offers its full
// compute instance and, when larger, 1-slice ones (16 SMs), keyed by the real profile ID since the
// mock looks compute profiles up by the GPU instance's profile ID.
var h100SXM5 = func() gpus.Config {
	c := gpus.H100_SXM5_80GB
	mp := gpus.MIGProfileConfig{
		GpuInstanceProfiles:       map[int]nvml.GpuInstanceProfileInfo{},
		ComputeInstanceProfiles:   map[int]map[int]nvml.ComputeInstanceProfileInfo{},
		GpuInstancePlacements:     map[int][]nvml.GpuInstancePlacement{},
		ComputeInstancePlacements: map[int]map[int][]nvml.ComputeInstancePlacement{},
	}
	ciBySlices := map[uint32]int{1: nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, 2: nvml.COMPUTE_INSTANCE_PROFILE_2_SLICE,
		3: nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE, 4: nvml.COMPUTE_INSTANCE_PROFILE_4_SLICE, 7: nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE}
	for _, p := range h100Profiles {
		mp.GpuInstanceProfiles[p.index] = nvml.GpuInstanceProfileInfo{Id: p.id, IsP2pSupported: 0, SliceCount: p.slices,
			InstanceCount: p.instances, MultiprocessorCount: p.sms, CopyEngineCount: p.copyEngines, DecoderCount: p.decoders,
			JpegCount: p.jpegs, OfaCount: p.ofas, MemorySizeMB: p.memoryMB}
		full := ciBySlices[p.slices]
		cis := map[int]nvml.ComputeInstanceProfileInfo{full: {Id: uint32(full), SliceCount: p.slices, InstanceCount: 1, MultiprocessorCount: p.sms}}
		if p.slices > 1 {
			cis[nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE] = nvml.ComputeInstanceProfileInfo{Id: nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE,
				SliceCount: 1, InstanceCount: p.slices, MultiprocessorCount: 16}
		}
		mp.ComputeInstanceProfiles[int(p.id)] = cis
		mp.ComputeInstancePlacements[int(p.id)] = map[int][]nvml.ComputeInstancePlacement{full: {{Start: 0, Size: p.slices}}}
	}
	// Placements in memory slices (8 on an H100), as `nvidia-smi mig -lgipp` lists them.
	mp.GpuInstancePlacements = map[int][]nvml.GpuInstancePlacement{
		19: placements(1, 0, 1, 2, 3, 4, 5, 6), 20: placements(1, 0, 1, 2, 3, 4, 5, 6), 15: placements(2, 0, 2, 4, 6),
		14: placements(2, 0, 2, 4), 9: placements(4, 0, 4), 5: placements(4, 0), 0: placements(8, 0),
	}
	c.MIGProfiles = mp
	return c
}()

func placements(size uint32, starts ...uint32) []nvml.GpuInstancePlacement {
	out := make([]nvml.GpuInstancePlacement, len(starts))
	for i, s := range starts {
		out[i] = nvml.GpuInstancePlacement{Start: s, Size: size}
	}
	return out
}
