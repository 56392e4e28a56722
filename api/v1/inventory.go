package v1

import (
	"cmp"
	"fmt"
	"regexp"
	"strings"

	"github.com/tessera-gpu/tessera/api/internal/strict"
)

// NodeInventory is what the node agent publishes about its GPUs (node annotation AnnotationInventory).
// The extender places shares from it, so it carries everything placement needs and nothing volatile.
type NodeInventory struct {
	APIVersion string `json:"apiVersion"`
	// Node is the Kubernetes node name.
	Node string `json:"node"`
	// DriverVersion is the NVIDIA driver version ("sim" on the simulated backend).
	DriverVersion string `json:"driverVersion,omitempty"`
	// CUDAVersion is the newest CUDA version the driver supports, "major.minor" as NVML's
	// nvmlSystemGetCudaDriverVersion reports it (13000 is "13.0"); empty when NVML does not say.
	CUDAVersion string `json:"cudaVersion,omitempty"`
	// SharesPerGPU is how many tessera.dev/vgpu tokens the agent advertises per GPU.
	SharesPerGPU int   `json:"sharesPerGPU"`
	GPUs         []GPU `json:"gpus"`
	// Links is the pairwise topology between GPUs (each unordered pair at most once).
	Links []Link `json:"links,omitempty"`
}

// GPU is one physical GPU.
type GPU struct {
	UUID        string `json:"uuid"`
	Index       int    `json:"index"`
	Model       string `json:"model"`
	MemoryBytes int64  `json:"memoryBytes"`
	SMCount     int    `json:"smCount"`
	// ComputeCapability is "major.minor", e.g. "8.0"; placement uses it to rank older GPUs.
	ComputeCapability string `json:"computeCapability,omitempty"`
	// NUMANode is the host NUMA node, -1 when unknown.
	NUMANode int    `json:"numaNode"`
	PCIBusID string `json:"pciBusID"`
	// Minor is the device node minor: /dev/nvidia<Minor>.
	Minor   int  `json:"minor"`
	Healthy bool `json:"healthy"`
	// MIG is set when MIG mode is enabled on this GPU; its instances are then the only way to use it.
	MIG *MIG `json:"mig,omitempty"`
	// Mdev lists the mdev vGPU types this GPU (as an mdev parent) can create.
	Mdev []MdevType `json:"mdev,omitempty"`
}

// Shareable reports whether the GPU can be given whole or in shares: MIG-mode GPUs are used only
// through their instances, and mdev parents only through mdev vGPUs.
func (g *GPU) Shareable() bool { return g.MIG == nil && len(g.Mdev) == 0 }

// MIG describes the MIG instances configured on a GPU.
type MIG struct {
	Instances []MIGInstance `json:"instances"`
}

// MIGInstance is one MIG device (a GPU instance with one compute instance spanning it).
type MIGInstance struct {
	UUID string `json:"uuid"`
	// Profile is the device-plugin profile name, e.g. "1g.5gb".
	Profile           string `json:"profile"`
	GPUInstanceID     int    `json:"gpuInstanceID"`
	ComputeInstanceID int    `json:"computeInstanceID"`
	MemoryBytes       int64  `json:"memoryBytes"`
	SMCount           int    `json:"smCount"`
	// CapMinors are the /dev/nvidia-caps/nvidia-cap<N> minors granting access to the GI and the CI.
	GICapMinor int `json:"giCapMinor"`
	CICapMinor int `json:"ciCapMinor"`
}

// MdevType is one mdev type a GPU supports, with its live instances.
type MdevType struct {
	// Name is the human type name, e.g. "A100-4C"; it forms the resource name.
	Name string `json:"name"`
	// ID is the sysfs type id, e.g. "nvidia-500".
	ID        string `json:"id"`
	Available int    `json:"available"`
	// Instances are the UUIDs of mdev devices of this type on this parent.
	Instances []string `json:"instances,omitempty"`
}

// LinkKind orders GPU pairs from closest to farthest.
type LinkKind string

const (
	LinkNVLink     LinkKind = "nvlink"      // direct NVLink(s)
	LinkPCIeSwitch LinkKind = "pcie-switch" // common PCIe switch (NVML SINGLE/MULTIPLE)
	LinkHostBridge LinkKind = "host-bridge" // common host bridge (NVML HOSTBRIDGE)
	LinkNUMA       LinkKind = "numa"        // same NUMA node, across host bridges (NVML NODE)
	LinkSystem     LinkKind = "system"      // across NUMA nodes (NVML SYSTEM)
)

// linkDistance ranks LinkKinds; smaller is closer.
var linkDistance = map[LinkKind]int{LinkNVLink: 1, LinkPCIeSwitch: 2, LinkHostBridge: 3, LinkNUMA: 4, LinkSystem: 5}

// Distance of a link kind, 1 (closest) to 5; unknown kinds are as far as the system bus.
func (k LinkKind) Distance() int {
	if d, ok := linkDistance[k]; ok {
		return d
	}
	return linkDistance[LinkSystem]
}

// Link is the connection between two GPUs, by index.
type Link struct {
	A    int      `json:"a"`
	B    int      `json:"b"`
	Kind LinkKind `json:"kind"`
	// NVLinks is the number of NVLink lanes between A and B (0 unless Kind is nvlink).
	NVLinks int `json:"nvlinks,omitempty"`
}

// Distance returns the topology distance between GPUs with indices a and b (0 for the same GPU).
func (inv *NodeInventory) Distance(a, b int) int {
	if a == b {
		return 0
	}
	for _, l := range inv.Links {
		if (l.A == a && l.B == b) || (l.A == b && l.B == a) {
			return l.Kind.Distance()
		}
	}
	return LinkSystem.Distance()
}

// GPUByUUID returns the GPU with this UUID, or nil.
func (inv *NodeInventory) GPUByUUID(uuid string) *GPU {
	for i := range inv.GPUs {
		if inv.GPUs[i].UUID == uuid {
			return &inv.GPUs[i]
		}
	}
	return nil
}

var (
	gpuUUIDPattern  = regexp.MustCompile(`^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$`)
	migUUIDPattern  = regexp.MustCompile(`^MIG-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$`)
	mdevUUIDPattern = regexp.MustCompile(`^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$`)
	pciBusIDPattern = regexp.MustCompile(`^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$`)
	// migProfilePattern matches go-nvlib's profile names: 1g.5gb, 2g.20gb, 1c.3g.20gb, and with
	// attributes 1g.10gb+me, 1g.20gb+me.all, 1g.24gb+gfx or without media extensions 1g.10gb-me.
	migProfilePattern = regexp.MustCompile(`^([1-9]c\.)?[1-9]g\.[1-9][0-9]*gb([+-](me|me\.all|gfx))?$`)
	// migResourceSuffixPattern is a MIG resource name after the prefix: the profile with "+" as ".".
	migResourceSuffixPattern = regexp.MustCompile(`^((?:[1-9]c\.)?[1-9]g\.[1-9][0-9]*gb)(?:\.(me|me\.all|gfx)|(-me))?$`)
	// resourceSuffixPattern is what may follow a resource prefix (Kubernetes qualified-name rules).
	resourceSuffixPattern = regexp.MustCompile(`^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$`)
)

// IsGPUUUID reports whether s is a GPU UUID as NVML prints it.
func IsGPUUUID(s string) bool { return gpuUUIDPattern.MatchString(s) }

// IsMIGProfile reports whether s is a valid MIG profile name such as "1g.10gb".
func IsMIGProfile(s string) bool { return migProfilePattern.MatchString(s) }

// maxGPUsPerNode bounds inventories; no node holds more GPUs than this.
const maxGPUsPerNode = 64

// EncodeInventory returns the canonical JSON of an inventory after validating it (apiVersion
// Version when empty); inv is not changed.
func EncodeInventory(inv *NodeInventory) ([]byte, error) {
	return strict.EncodeVersioned(inv, func(c *NodeInventory) { c.APIVersion = cmp.Or(c.APIVersion, Version) })
}

// DecodeInventory strictly decodes and validates an inventory annotation.
func DecodeInventory(data []byte) (*NodeInventory, error) {
	return strict.DecodeVersioned[NodeInventory](data, "node inventory")
}

// Validate checks ranges, formats and uniqueness; every error names its field.
func (inv *NodeInventory) Validate() error {
	fe := &strict.Errors{Doc: "node inventory"}
	if inv.APIVersion != Version {
		fe.Add("apiVersion", "must be %q, got %q", Version, inv.APIVersion)
	}
	if inv.Node == "" {
		fe.Add("node", "must not be empty")
	}
	if inv.SharesPerGPU < 1 || inv.SharesPerGPU > 1024 {
		fe.Add("sharesPerGPU", "must be between 1 and 1024, got %d", inv.SharesPerGPU)
	}
	if len(inv.GPUs) > maxGPUsPerNode {
		fe.Add("gpus", "at most %d GPUs per node, got %d", maxGPUsPerNode, len(inv.GPUs))
	}
	uuids := map[string]string{}
	indices := map[int]bool{}
	minors := map[int]bool{}
	claim := func(path, uuid string) {
		if prev, dup := uuids[uuid]; dup {
			fe.Add(path, "duplicated UUID %q (also at %s)", uuid, prev)
		}
		uuids[uuid] = path
	}
	for i, g := range inv.GPUs {
		p := fmt.Sprintf("gpus[%d]", i)
		if !IsGPUUUID(g.UUID) {
			fe.Add(p+".uuid", "must look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, got %q", g.UUID)
		}
		claim(p+".uuid", g.UUID)
		if g.Index < 0 || g.Index >= maxGPUsPerNode {
			fe.Add(p+".index", "must be between 0 and %d, got %d", maxGPUsPerNode-1, g.Index)
		} else if indices[g.Index] {
			fe.Add(p+".index", "duplicated index %d", g.Index)
		}
		indices[g.Index] = true
		if strings.TrimSpace(g.Model) == "" {
			fe.Add(p+".model", "must not be empty")
		}
		if g.MemoryBytes <= 0 {
			fe.Add(p+".memoryBytes", "must be > 0, got %d", g.MemoryBytes)
		}
		if g.SMCount <= 0 || g.SMCount > 1024 {
			fe.Add(p+".smCount", "must be between 1 and 1024, got %d", g.SMCount)
		}
		if g.NUMANode < -1 || g.NUMANode > 1024 {
			fe.Add(p+".numaNode", "must be -1 (unknown) or between 0 and 1024, got %d", g.NUMANode)
		}
		if !pciBusIDPattern.MatchString(g.PCIBusID) {
			fe.Add(p+".pciBusID", "must look like 0000:07:00.0, got %q", g.PCIBusID)
		}
		if g.Minor < 0 || g.Minor > 255 {
			fe.Add(p+".minor", "must be between 0 and 255, got %d", g.Minor)
		} else if minors[g.Minor] {
			fe.Add(p+".minor", "duplicated device minor %d", g.Minor)
		}
		minors[g.Minor] = true
		if g.MIG != nil {
			validateMIG(fe, p+".mig", g, claim)
		}
		validateMdev(fe, p+".mdev", g.Mdev, claim)
	}
	pairs := map[[2]int]bool{}
	for i, l := range inv.Links {
		p := fmt.Sprintf("links[%d]", i)
		if !indices[l.A] {
			fe.Add(p+".a", "no GPU with index %d", l.A)
		}
		if !indices[l.B] {
			fe.Add(p+".b", "no GPU with index %d", l.B)
		}
		if l.A == l.B {
			fe.Add(p, "links GPU %d to itself", l.A)
		}
		key := [2]int{min(l.A, l.B), max(l.A, l.B)}
		if pairs[key] {
			fe.Add(p, "duplicated link between GPUs %d and %d", key[0], key[1])
		}
		pairs[key] = true
		if _, ok := linkDistance[l.Kind]; !ok {
			fe.Add(p+".kind", "must be one of nvlink, pcie-switch, host-bridge, numa, system; got %q", l.Kind)
		}
		if l.NVLinks < 0 || l.NVLinks > 64 || (l.NVLinks > 0 && l.Kind != LinkNVLink) {
			fe.Add(p+".nvlinks", "must be 0..64 and only set on nvlink links, got %d", l.NVLinks)
		}
	}
	return fe.Err()
}

func validateMIG(fe *strict.Errors, p string, g GPU, claim func(path, uuid string)) {
	var mem int64
	sm := 0
	for j, m := range g.MIG.Instances {
		q := fmt.Sprintf("%s.instances[%d]", p, j)
		if !migUUIDPattern.MatchString(m.UUID) {
			fe.Add(q+".uuid", "must look like MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, got %q", m.UUID)
		}
		claim(q+".uuid", m.UUID)
		if !IsMIGProfile(m.Profile) {
			fe.Add(q+".profile", "must look like 1g.10gb, got %q", m.Profile)
		}
		if m.MemoryBytes <= 0 {
			fe.Add(q+".memoryBytes", "must be > 0, got %d", m.MemoryBytes)
		}
		if m.SMCount <= 0 {
			fe.Add(q+".smCount", "must be > 0, got %d", m.SMCount)
		}
		if m.GPUInstanceID < 0 || m.ComputeInstanceID < 0 || m.GICapMinor < 0 || m.CICapMinor < 0 {
			fe.Add(q, "instance ids and cap minors must be >= 0")
		}
		mem += m.MemoryBytes
		sm += m.SMCount
	}
	if mem > g.MemoryBytes {
		fe.Add(p+".instances", "MIG instances hold %d bytes, more than the GPU's %d", mem, g.MemoryBytes)
	}
	if sm > g.SMCount {
		fe.Add(p+".instances", "MIG instances hold %d SMs, more than the GPU's %d", sm, g.SMCount)
	}
}

func validateMdev(fe *strict.Errors, p string, types []MdevType, claim func(path, uuid string)) {
	names := map[string]bool{}
	for j, t := range types {
		q := fmt.Sprintf("%s[%d]", p, j)
		if !resourceSuffixPattern.MatchString(t.Name) {
			fe.Add(q+".name", "must be a resource-name suffix like A100-4C, got %q", t.Name)
		}
		if names[t.Name] {
			fe.Add(q+".name", "duplicated mdev type %q", t.Name)
		}
		names[t.Name] = true
		if t.ID == "" {
			fe.Add(q+".id", "must not be empty")
		}
		if t.Available < 0 {
			fe.Add(q+".available", "must be >= 0, got %d", t.Available)
		}
		for k, u := range t.Instances {
			if !mdevUUIDPattern.MatchString(u) {
				fe.Add(fmt.Sprintf("%s.instances[%d]", q, k), "must be a UUID, got %q", u)
			}
			claim(fmt.Sprintf("%s.instances[%d]", q, k), u)
		}
	}
}
