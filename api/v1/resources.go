package v1

import "strings"

// Resource names a pod asks for (see docs/architecture.md, "Resource model").
const (
	// ResourceGPU is N whole, exclusive GPUs; the same name as NVIDIA's plugin so existing pods keep working.
	ResourceGPU = "nvidia.com/gpu"
	// ResourceShare is N fractional shares, each on a different physical GPU.
	ResourceShare = "tessera.dev/vgpu"
	// ResourceShareMemory is the memory cap of each share, in bytes.
	ResourceShareMemory = "tessera.dev/vgpu-memory"
	// ResourceShareMemoryPercent is the memory cap of each share as a percent of its GPU's memory.
	ResourceShareMemoryPercent = "tessera.dev/vgpu-memory-percent"
	// ResourceShareCores is the compute cap of each share, in percent of its GPU's SMs.
	ResourceShareCores = "tessera.dev/vgpu-cores"

	// MIGResourcePrefix + profile (e.g. "1g.10gb") names a MIG instance (mixed strategy); see MIGResource for "+".
	MIGResourcePrefix = "nvidia.com/mig-"
	// MdevResourcePrefix + type name (e.g. "A100-4C") names an mdev vGPU for VM runtimes.
	MdevResourcePrefix = "tessera.dev/mdev-"

	// DRADriverName is the DRA driver tessera-node serves (ResourceSlices, DeviceClasses, claims):
	// the second front door to the same GPUs (docs/dra.md).
	DRADriverName = "gpu.tessera.dev"
	// DRAClassWholeGPU and DRAClassShareGPU are the chart's DeviceClasses of that driver for a GPU
	// whole and for a share (deploy/helm/tessera/templates/deviceclasses.yaml); the extender places
	// pods whose claims request them (docs/placement.md, "Placement under DRA").
	DRAClassWholeGPU = "whole.gpu.tessera.dev"
	DRAClassShareGPU = "share.gpu.tessera.dev"
)

// MaxCoresPercent is the compute of a whole GPU.
const MaxCoresPercent = 100

// MIGResource returns the resource name of a MIG profile, e.g. "1g.10gb" -> "nvidia.com/mig-1g.10gb".
// A "+" (attribute profiles such as "1g.10gb+me") is not allowed in a resource name; like NVIDIA's
// device plugin it becomes ".": "nvidia.com/mig-1g.10gb.me".
func MIGResource(profile string) string {
	return MIGResourcePrefix + strings.ReplaceAll(profile, "+", ".")
}

// MIGProfileOfResource is the inverse of MIGResource: "nvidia.com/mig-1g.10gb.me" -> "1g.10gb+me".
// It reports false for names that are not a MIG resource of a well-formed profile.
func MIGProfileOfResource(name string) (string, bool) {
	suffix, ok := strings.CutPrefix(name, MIGResourcePrefix)
	if !ok {
		return "", false
	}
	m := migResourceSuffixPattern.FindStringSubmatch(suffix)
	if m == nil {
		return "", false
	}
	// The first "." after the memory size "...gb" is the one MIGResource made from "+".
	profile := m[1]
	if m[2] != "" {
		profile += "+" + m[2]
	}
	return profile + m[3], true
}

// MdevResource returns the resource name of an mdev type, e.g. "A100-4C" -> "tessera.dev/mdev-A100-4C".
func MdevResource(typeName string) string { return MdevResourcePrefix + typeName }

// IsTesseraResource reports whether a resource name belongs to the GPU resource model.
func IsTesseraResource(name string) bool {
	switch name {
	case ResourceGPU, ResourceShare, ResourceShareMemory, ResourceShareMemoryPercent, ResourceShareCores:
		return true
	}
	return strings.HasPrefix(name, MIGResourcePrefix) || strings.HasPrefix(name, MdevResourcePrefix)
}
