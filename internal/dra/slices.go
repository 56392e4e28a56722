// Package dra is tessera-node's second front door: a DRA kubelet plugin (driver gpu.tessera.dev,
// through k8s.io/dynamic-resource-allocation's kubeletplugin helper) beside the device plugins. It
// publishes the agent's inventory as ResourceSlices, and prepares claims into the same ledger, the
// same CDI specs and the same NRI realisation (vcuda limits) as device-plugin grants.
package dra

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// DriverName is the DRA driver's name: DeviceClasses select `device.driver == "gpu.tessera.dev"`.
const DriverName = api.DRADriverName

// Capacity names of a GPU device (consumable: each share claim takes part of them).
const (
	// CapacityMemory is the GPU's memory in bytes; a share's memory cap.
	CapacityMemory resourceapi.QualifiedName = "memory"
	// CapacityCompute is the GPU's compute in percent of its SMs; a share's compute cap (vcuda).
	CapacityCompute resourceapi.QualifiedName = "compute"
	// CapacityShares counts allocations: a GPU holds at most sharesPerGPU shares, as the
	// device-plugin path's share tokens.
	CapacityShares resourceapi.QualifiedName = "shares"
)

// Attribute names (in the driver's domain: CEL reads device.attributes["gpu.tessera.dev"].model).
const (
	AttrType              resourceapi.QualifiedName = "type" // "gpu" or "mig"
	AttrUUID              resourceapi.QualifiedName = "uuid"
	AttrIndex             resourceapi.QualifiedName = "index"
	AttrModel             resourceapi.QualifiedName = "model"
	AttrComputeCapability resourceapi.QualifiedName = "computeCapability"
	AttrNUMANode          resourceapi.QualifiedName = "numaNode"
	AttrNVLinkDomain      resourceapi.QualifiedName = "nvlinkDomain"
	AttrProfile           resourceapi.QualifiedName = "profile"
	AttrParentUUID        resourceapi.QualifiedName = "parentUUID"
	// AttrPlacement is a dynamic MIG device's first memory slice.
	AttrPlacement resourceapi.QualifiedName = "placement"
)

// Device types (AttrType).
const (
	TypeGPU = "gpu"
	TypeMIG = "mig"
)

// minShareMemory is the least memory a share of g may take: what vcuda charges one CUDA context on
// it (api.ContextOverheadBytes). A smaller cap could create no context at all; the allocator rounds
// a smaller request up to it (DRA's ValidRange.Min), and prepare refuses an allocation below it.
func minShareMemory(g *api.GPU) int64 {
	return api.ContextOverheadBytes(api.ComputeCapabilityMajor(g.ComputeCapability))
}

// GPUDeviceName is the device name of a GPU usable whole or shared.
func GPUDeviceName(index int) string { return "gpu-" + strconv.Itoa(index) }

// MIGDeviceName is the device name of a MIG instance (a DNS label; MIG UUIDs are upper case).
func MIGDeviceName(parent int, m *api.MIGInstance) string {
	return fmt.Sprintf("gpu-%d-mig-%d-%d", parent, m.GPUInstanceID, m.ComputeInstanceID)
}

// counterSetName is the counter set of a MIG-mode GPU, which its instances consume.
func counterSetName(index int) string { return "gpu-" + strconv.Itoa(index) + "-counters" }

// TaintUnhealthy is the key of the taint an unhealthy device carries in the slices: claims that do
// not tolerate it are not allocated the device (NoSchedule), or with NoExecute also lose it.
const TaintUnhealthy = DriverName + "/unhealthy"

// Resources is the node's pool (named after the node): every GPU usable whole or shared as one
// device that allows multiple allocations with consumable memory, compute and share count; every
// MIG instance as a device consuming its parent's counters (memory and SMs), in a separate slice of
// counter sets as the API requires. A GPU is whole, shared or MIG at one time as in the
// device-plugin path: a whole claim takes all its memory (the request policy's default), a share
// takes part; MIG-mode GPUs offer only their instances. mdev parents are not offered (VM runtimes
// use the device plugins). An unhealthy device (its GPU or, for a MIG instance, itself in
// unhealthy) stays in the slice with the TaintUnhealthy taint of effect, so the scheduler sees one
// device turn bad instead of devices that appear and vanish.
//
// GPUs in dynamic (dynamic MIG, partition.go) are partitionable: the GPU device and a device per
// MIG profile placement, all consuming the GPU's counter set (partitionDevices).
func Resources(inv *api.NodeInventory, unhealthy map[string]string, effect resourceapi.DeviceTaintEffect, dynamic map[string]Partitionable) resourceslice.DriverResources {
	domains := nvlinkDomains(inv)
	var devices []resourceapi.Device
	var counters []resourceapi.CounterSet
	for i := range inv.GPUs {
		g := &inv.GPUs[i]
		if p, ok := dynamic[g.UUID]; ok {
			devs, set := partitionDevices(g, p, inv.SharesPerGPU, domains[g.Index])
			for j := range devs {
				inst, exists := p.Instances[devs[j].Name]
				if _, bad := unhealthy[inst]; !g.Healthy || (exists && bad) {
					devs[j].Taints = []resourceapi.DeviceTaint{{Key: TaintUnhealthy, Effect: effect}}
				}
			}
			devices = append(devices, devs...)
			counters = append(counters, set)
			continue
		}
		switch {
		case g.Shareable():
			dev := gpuDevice(g, inv.SharesPerGPU, domains[g.Index])
			if !g.Healthy {
				dev.Taints = []resourceapi.DeviceTaint{{Key: TaintUnhealthy, Effect: effect}}
			}
			devices = append(devices, dev)
		case g.MIG != nil:
			set := counterSetName(g.Index)
			counters = append(counters, resourceapi.CounterSet{Name: set, Counters: map[string]resourceapi.Counter{
				"memory":          {Value: *resource.NewQuantity(g.MemoryBytes, resource.BinarySI)},
				"multiprocessors": {Value: *resource.NewQuantity(int64(g.SMCount), resource.DecimalSI)},
			}})
			for j := range g.MIG.Instances {
				m := &g.MIG.Instances[j]
				dev := migDevice(g, m, set, domains[g.Index])
				if _, bad := unhealthy[m.UUID]; bad || !g.Healthy {
					dev.Taints = []resourceapi.DeviceTaint{{Key: TaintUnhealthy, Effect: effect}}
				}
				devices = append(devices, dev)
			}
		}
	}
	// "Only one of Devices and SharedCounters can be set in a ResourceSlice", and a slice holds at
	// most 64 devices once any consumes counters or is tainted, and 8 counter sets.
	pool := resourceslice.Pool{Slices: []resourceslice.Slice{{Devices: devices}}}
	if len(devices) > resourceapi.ResourceSliceMaxDevicesWithAdvancedFeatures {
		pool.Slices = nil
		for part := range slices.Chunk(devices, resourceapi.ResourceSliceMaxDevicesWithAdvancedFeatures) {
			pool.Slices = append(pool.Slices, resourceslice.Slice{Devices: part})
		}
	}
	for part := range slices.Chunk(counters, resourceapi.ResourceSliceMaxCounterSets) {
		pool.Slices = append(pool.Slices, resourceslice.Slice{SharedCounters: part})
	}
	return resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{inv.Node: pool}}
}

// HealthReport is the health of every device Resources publishes, for the kubelet's health stream:
// Unhealthy with the reason (the GPU's, or the MIG instance's own) or Healthy, stamped now.
func HealthReport(inv *api.NodeInventory, unhealthy map[string]string, now time.Time, dynamic map[string]Partitionable) kubeletplugin.DeviceHealthReport {
	var out kubeletplugin.DeviceHealthReport
	add := func(name string, healthy bool, why string) {
		h := kubeletplugin.DeviceHealth{PoolName: inv.Node, DeviceName: name, Health: kubeletplugin.HealthStatusHealthy,
			LastUpdated: now, HealthCheckTimeout: healthTimeout}
		if !healthy {
			h.Health, h.Message = kubeletplugin.HealthStatusUnhealthy, why
			if h.Message == "" {
				h.Message = "unhealthy"
			}
		}
		out.Devices = append(out.Devices, h)
	}
	for i := range inv.GPUs {
		g := &inv.GPUs[i]
		if p, ok := dynamic[g.UUID]; ok {
			add(GPUDeviceName(g.Index), g.Healthy, unhealthy[g.UUID])
			for _, pl := range p.Placements {
				name := PartitionDeviceName(g.Index, pl)
				why, bad := unhealthy[p.Instances[name]]
				if !g.Healthy {
					why, bad = unhealthy[g.UUID], true
				}
				add(name, !bad, why)
			}
			continue
		}
		switch {
		case g.Shareable():
			add(GPUDeviceName(g.Index), g.Healthy, unhealthy[g.UUID])
		case g.MIG != nil:
			for j := range g.MIG.Instances {
				m := &g.MIG.Instances[j]
				why, bad := unhealthy[m.UUID]
				if !g.Healthy {
					why, bad = unhealthy[g.UUID], true
				}
				add(MIGDeviceName(g.Index, m), !bad, why)
			}
		}
	}
	return out
}

func commonAttributes(g *api.GPU, typ string, domain int) map[resourceapi.QualifiedName]resourceapi.DeviceAttribute {
	a := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
		AttrType:         {StringValue: ptr.To(typ)},
		AttrIndex:        {IntValue: ptr.To(int64(g.Index))},
		AttrModel:        {StringValue: ptr.To(g.Model)},
		AttrNUMANode:     {IntValue: ptr.To(int64(g.NUMANode))},
		AttrNVLinkDomain: {IntValue: ptr.To(int64(domain))},
	}
	if g.ComputeCapability != "" {
		// A version attribute compares numerically in CEL (semver: "8.0" becomes "8.0.0").
		a[AttrComputeCapability] = resourceapi.DeviceAttribute{VersionValue: ptr.To(g.ComputeCapability + ".0")}
	}
	return a
}

// gpuDevice: memory in bytes (default: all of it, so a claim that asks for no capacity gets the GPU
// whole), compute in percent (default 0: a share without cores reserves and caps no compute, as
// tessera.dev/vgpu-cores omitted), and one of the GPU's share slots per allocation.
func gpuDevice(g *api.GPU, sharesPerGPU int, domain int) resourceapi.Device {
	attrs := commonAttributes(g, TypeGPU, domain)
	attrs[AttrUUID] = resourceapi.DeviceAttribute{StringValue: ptr.To(g.UUID)}
	mem := resource.NewQuantity(g.MemoryBytes, resource.BinarySI)
	return resourceapi.Device{
		Name:                     GPUDeviceName(g.Index),
		Attributes:               attrs,
		AllowMultipleAllocations: ptr.To(true),
		Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
			CapacityMemory: {Value: *mem, RequestPolicy: &resourceapi.CapacityRequestPolicy{
				Default:    mem,
				ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: resource.NewQuantity(min(minShareMemory(g), g.MemoryBytes), resource.BinarySI), Max: mem},
			}},
			CapacityCompute: {Value: *resource.NewQuantity(api.MaxCoresPercent, resource.DecimalSI), RequestPolicy: &resourceapi.CapacityRequestPolicy{
				Default: resource.NewQuantity(0, resource.DecimalSI),
				ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: resource.NewQuantity(0, resource.DecimalSI),
					Max: resource.NewQuantity(api.MaxCoresPercent, resource.DecimalSI), Step: resource.NewQuantity(1, resource.DecimalSI)},
			}},
			CapacityShares: {Value: *resource.NewQuantity(int64(sharesPerGPU), resource.DecimalSI), RequestPolicy: &resourceapi.CapacityRequestPolicy{
				Default:     resource.NewQuantity(1, resource.DecimalSI),
				ValidValues: []resource.Quantity{*resource.NewQuantity(1, resource.DecimalSI)},
			}},
		},
	}
}

func migDevice(g *api.GPU, m *api.MIGInstance, set string, domain int) resourceapi.Device {
	attrs := commonAttributes(g, TypeMIG, domain)
	attrs[AttrUUID] = resourceapi.DeviceAttribute{StringValue: ptr.To(m.UUID)}
	attrs[AttrParentUUID] = resourceapi.DeviceAttribute{StringValue: ptr.To(g.UUID)}
	attrs[AttrProfile] = resourceapi.DeviceAttribute{StringValue: ptr.To(m.Profile)}
	mem := resource.NewQuantity(m.MemoryBytes, resource.BinarySI)
	sms := resource.NewQuantity(int64(m.SMCount), resource.DecimalSI)
	return resourceapi.Device{
		Name:       MIGDeviceName(g.Index, m),
		Attributes: attrs,
		Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
			CapacityMemory:    {Value: *mem},
			"multiprocessors": {Value: *sms},
		},
		ConsumesCounters: []resourceapi.DeviceCounterConsumption{{CounterSet: set, Counters: map[string]resourceapi.Counter{
			"memory": {Value: *mem}, "multiprocessors": {Value: *sms},
		}}},
	}
}

// nvlinkDomains gives every GPU the lowest index of the GPUs it reaches over NVLink (itself when
// it has no NVLink): pods select GPUs of one domain with a matchAttribute constraint.
func nvlinkDomains(inv *api.NodeInventory) map[int]int {
	parent := map[int]int{}
	var find func(int) int
	find = func(x int) int {
		if p, ok := parent[x]; ok && p != x {
			r := find(p)
			parent[x] = r
			return r
		}
		return x
	}
	for _, g := range inv.GPUs {
		parent[g.Index] = g.Index
	}
	for _, l := range inv.Links {
		if l.Kind != api.LinkNVLink {
			continue
		}
		a, b := find(l.A), find(l.B)
		parent[max(a, b)] = min(a, b)
	}
	out := map[int]int{}
	idx := make([]int, 0, len(parent))
	for i := range parent {
		idx = append(idx, i)
	}
	slices.Sort(idx)
	for _, i := range idx {
		out[i] = find(i)
	}
	return out
}

// Counter names of a partitionable GPU's counter set: one per memory slice (a MIG placement takes
// the slices it spans, so overlapping placements cannot both be allocated) and its compute slices.
const counterComputeSlices = "compute-slices"

func memorySliceCounter(i uint32) string { return "memory-slice-" + strconv.Itoa(int(i)) }

// partitionDevices is a dynamic MIG GPU as a partitionable device: the GPU device (whole or shares,
// consuming every counter, so it is allocatable only while no MIG instance is) and one device per
// MIG profile placement consuming the memory slices it spans and its compute slices. A MIG device
// has no UUID attribute: its instance, and so its UUID, exists only once a claim is prepared.
func partitionDevices(g *api.GPU, p Partitionable, sharesPerGPU int, domain int) ([]resourceapi.Device, resourceapi.CounterSet) {
	set := resourceapi.CounterSet{Name: counterSetName(g.Index), Counters: map[string]resourceapi.Counter{
		counterComputeSlices: {Value: *resource.NewQuantity(int64(p.ComputeSlices), resource.DecimalSI)}}}
	for i := uint32(0); i < p.MemorySlices; i++ {
		set.Counters[memorySliceCounter(i)] = resourceapi.Counter{Value: *resource.NewQuantity(1, resource.DecimalSI)}
	}
	whole := gpuDevice(g, sharesPerGPU, domain)
	whole.ConsumesCounters = []resourceapi.DeviceCounterConsumption{{CounterSet: set.Name, Counters: maps.Clone(set.Counters)}}
	out := []resourceapi.Device{whole}
	for _, pl := range p.Placements {
		attrs := commonAttributes(g, TypeMIG, domain)
		attrs[AttrParentUUID] = resourceapi.DeviceAttribute{StringValue: ptr.To(g.UUID)}
		attrs[AttrProfile] = resourceapi.DeviceAttribute{StringValue: ptr.To(pl.Profile)}
		attrs[AttrPlacement] = resourceapi.DeviceAttribute{IntValue: ptr.To(int64(pl.Start))}
		mem := resource.NewQuantity(pl.MemoryBytes, resource.BinarySI)
		used := map[string]resourceapi.Counter{counterComputeSlices: {Value: *resource.NewQuantity(int64(pl.ComputeSlices), resource.DecimalSI)}}
		for i := pl.Start; i < pl.Start+pl.Size; i++ {
			used[memorySliceCounter(i)] = resourceapi.Counter{Value: *resource.NewQuantity(1, resource.DecimalSI)}
		}
		out = append(out, resourceapi.Device{
			Name:       PartitionDeviceName(g.Index, pl),
			Attributes: attrs,
			Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
				CapacityMemory:    {Value: *mem},
				"multiprocessors": {Value: *resource.NewQuantity(int64(pl.SMs), resource.DecimalSI)},
			},
			ConsumesCounters: []resourceapi.DeviceCounterConsumption{{CounterSet: set.Name, Counters: used}},
		})
	}
	return out, set
}
