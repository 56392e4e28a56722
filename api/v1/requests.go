package v1

import (
	"fmt"
	"sort"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// ContainerRequest is what one container asks of the GPU resource model, parsed and checked.
type ContainerRequest struct {
	Name string
	// WholeGPUs is the nvidia.com/gpu count.
	WholeGPUs int
	// Shares is the tessera.dev/vgpu count: shares on that many different GPUs.
	Shares int
	// ShareMemoryBytes is each share's memory cap, when given in bytes.
	ShareMemoryBytes int64
	// ShareMemoryPercent is each share's memory cap in percent of its GPU, when given that way.
	ShareMemoryPercent int
	// ShareCores is each share's compute cap in percent; 0 means not capped (nothing reserved).
	ShareCores int
	// MIG maps a MIG profile as NVML names it (e.g. "1g.10gb", "1g.10gb+me") to the instance count.
	MIG map[string]int
	// Mdev maps an mdev type (e.g. "A100-4C") to the instance count.
	Mdev map[string]int
}

// HasGPU reports whether the container asks for any GPU resource.
func (c *ContainerRequest) HasGPU() bool {
	return c.WholeGPUs > 0 || c.Shares > 0 || len(c.MIG) > 0 || len(c.Mdev) > 0
}

// ShareMemoryOn returns the memory cap of one share on a GPU with gpuMemory bytes.
func (c *ContainerRequest) ShareMemoryOn(gpuMemory int64) int64 {
	if c.ShareMemoryPercent > 0 {
		return gpuMemory * int64(c.ShareMemoryPercent) / 100
	}
	return c.ShareMemoryBytes
}

// PodRequest is the GPU request of a pod: one entry per regular container that asks for a GPU.
type PodRequest struct {
	Containers []ContainerRequest
}

// Empty reports whether the pod asks for no GPU at all.
func (p *PodRequest) Empty() bool { return len(p.Containers) == 0 }

// maxSharesPerContainer bounds tessera.dev/vgpu; no node has more GPUs than this.
const maxSharesPerContainer = maxGPUsPerNode

// MaxShareMemoryBytes bounds tessera.dev/vgpu-memory: 1 PiB, far above any GPU, and low enough that
// no sum of shares on a node comes near int64's range (a pod bound by nodeName never meets the
// extender's check against the node's GPUs, so the parser is the one bound every path meets).
const MaxShareMemoryBytes int64 = 1 << 50

// ParsePodRequest reads and validates the GPU requests of a pod's containers. It rejects what would
// otherwise be silently rounded or ignored: fractional quantities, caps out of range, share
// parameters without shares, whole GPUs mixed with shares in one container, and whole GPUs or
// shares requested by init containers.
func ParsePodRequest(pod *corev1.Pod) (*PodRequest, error) {
	var errs []string
	for _, c := range pod.Spec.InitContainers {
		for name := range containerQuantities(c) {
			switch {
			case name == ResourceShare || strings.HasPrefix(name, "tessera.dev/vgpu-"):
				errs = append(errs, fmt.Sprintf("init container %q: %s is not supported in init containers; request shares in a regular container", c.Name, name))
			case name == ResourceGPU:
				// The extender places whole GPUs for regular containers only (an assignment names no
				// init container), so the node could not tell which GPU an init container's grant is.
				errs = append(errs, fmt.Sprintf("init container %q: %s is not supported in init containers; request whole GPUs in a regular container, or a MIG instance (%s<profile>), which the kubelet passes on to the pod's later containers", c.Name, name, MIGResourcePrefix))
			}
		}
	}
	req := &PodRequest{}
	for _, c := range pod.Spec.Containers {
		cr, cerrs := parseContainer(c)
		errs = append(errs, cerrs...)
		if len(cerrs) == 0 && cr.HasGPU() {
			req.Containers = append(req.Containers, cr)
		}
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("pod %s/%s has invalid GPU requests: %s", pod.Namespace, pod.Name, strings.Join(errs, "; "))
	}
	return req, nil
}

// containerQuantities merges requests and limits (limits win: extended resources must have them equal).
func containerQuantities(c corev1.Container) map[string]resource.Quantity {
	out := map[string]resource.Quantity{}
	for n, q := range c.Resources.Requests {
		if IsTesseraResource(string(n)) {
			out[string(n)] = q
		}
	}
	for n, q := range c.Resources.Limits {
		if IsTesseraResource(string(n)) {
			out[string(n)] = q
		}
	}
	return out
}

func parseContainer(c corev1.Container) (ContainerRequest, []string) {
	cr := ContainerRequest{Name: c.Name}
	var errs []string
	bad := func(res, format string, args ...any) {
		errs = append(errs, fmt.Sprintf("container %q: %s: %s", c.Name, res, fmt.Sprintf(format, args...)))
	}
	for res, q := range c.Resources.Requests {
		if lim, ok := c.Resources.Limits[res]; ok && IsTesseraResource(string(res)) && lim.Cmp(q) != 0 {
			bad(string(res), "request %s differs from limit %s; set them equal (or only the limit)", q.String(), lim.String())
		}
	}
	qs := containerQuantities(c)
	names := make([]string, 0, len(qs))
	for n := range qs {
		names = append(names, n)
	}
	sort.Strings(names) // deterministic messages
	for _, name := range names {
		q := qs[name]
		v, ok := wholeNumber(q)
		if !ok {
			bad(name, "%s is not a whole number (or is out of range); GPU resources are counted in whole units (bytes, percent, devices)", q.String())
			continue
		}
		switch {
		case name == ResourceGPU:
			cr.WholeGPUs = int(clamp(v, maxGPUsPerNode+1))
			if v < 0 || v > maxGPUsPerNode {
				bad(name, "must be between 0 and %d, got %d", maxGPUsPerNode, v)
			}
		case name == ResourceShare:
			cr.Shares = int(clamp(v, maxSharesPerContainer+1))
			if v < 0 || v > maxSharesPerContainer {
				bad(name, "must be between 0 and %d shares, got %d", maxSharesPerContainer, v)
			}
		case name == ResourceShareMemory:
			cr.ShareMemoryBytes = v
			if v <= 0 {
				bad(name, "must be a positive number of bytes per share (e.g. 10Gi), got %s", q.String())
			} else if v > MaxShareMemoryBytes {
				bad(name, "must be at most %d bytes (1Pi) per share, got %s", MaxShareMemoryBytes, q.String())
			}
		case name == ResourceShareMemoryPercent:
			cr.ShareMemoryPercent = int(clamp(v, 101))
			if v < 1 || v > 100 {
				bad(name, "must be between 1 and 100 percent of the GPU's memory, got %d", v)
			}
		case name == ResourceShareCores:
			cr.ShareCores = int(clamp(v, 101))
			if v < 1 || v > MaxCoresPercent {
				bad(name, "must be between 1 and 100 percent of the GPU's SMs, got %d", v)
			}
		case strings.HasPrefix(name, MIGResourcePrefix):
			profile, ok := MIGProfileOfResource(name)
			if !ok {
				bad(name, "%q is not a MIG profile (expected e.g. nvidia.com/mig-1g.10gb or nvidia.com/mig-1g.10gb.me)", strings.TrimPrefix(name, MIGResourcePrefix))
			} else if v < 0 || v > maxGPUsPerNode*7 {
				bad(name, "must be between 0 and %d, got %d", maxGPUsPerNode*7, v)
			} else if v > 0 {
				if cr.MIG == nil {
					cr.MIG = map[string]int{}
				}
				cr.MIG[profile] = int(v)
			}
		case strings.HasPrefix(name, MdevResourcePrefix):
			typ := strings.TrimPrefix(name, MdevResourcePrefix)
			if !resourceSuffixPattern.MatchString(typ) {
				bad(name, "%q is not an mdev type name (expected e.g. tessera.dev/mdev-A100-4C)", typ)
			} else if v < 0 || v > maxGPUsPerNode*32 {
				bad(name, "must be between 0 and %d, got %d", maxGPUsPerNode*32, v)
			} else if v > 0 {
				if cr.Mdev == nil {
					cr.Mdev = map[string]int{}
				}
				cr.Mdev[typ] = int(v)
			}
		}
	}
	if len(errs) > 0 {
		return cr, errs
	}
	shareParams := cr.ShareMemoryBytes > 0 || cr.ShareMemoryPercent > 0 || cr.ShareCores > 0
	switch {
	case cr.Shares == 0 && shareParams:
		bad(ResourceShare, "%s/%s/%s are set but %s is not; ask for at least one share", ResourceShareMemory, ResourceShareMemoryPercent, ResourceShareCores, ResourceShare)
	case cr.Shares > 0 && cr.ShareMemoryBytes > 0 && cr.ShareMemoryPercent > 0:
		bad(ResourceShareMemory, "set either %s or %s, not both", ResourceShareMemory, ResourceShareMemoryPercent)
	case cr.Shares > 0 && cr.ShareMemoryBytes == 0 && cr.ShareMemoryPercent == 0:
		bad(ResourceShare, "each share needs a memory cap: set %s (bytes, e.g. 10Gi) or %s", ResourceShareMemory, ResourceShareMemoryPercent)
	}
	if cr.Shares > 0 && cr.WholeGPUs > 0 {
		bad(ResourceGPU, "a container asks for either whole GPUs (%s) or shares (%s), not both", ResourceGPU, ResourceShare)
	}
	return cr, errs
}

// wholeNumber returns q as an int64, or false if it has a fractional part (0.5, 100m) or does not fit.
func wholeNumber(q resource.Quantity) (int64, bool) {
	return q.AsInt64()
}

func clamp(v, hi int64) int64 {
	if v < 0 {
		return -1
	}
	return min(v, hi)
}

// FitsWithin reports whether more fits on top of used within capacity, every operand checked so no
// sum can wrap past int64: a negative amount never fits, nor anything on a total already past
// capacity. The ledger and placement compare shares' memory and compute with it.
func FitsWithin(used, more, capacity int64) bool {
	return used >= 0 && more >= 0 && used <= capacity && more <= capacity-used
}

// CheckFits reports why a request cannot fit a node with these GPUs regardless of what is in use:
// a share larger than every GPU's memory, more shares than the node has GPUs, and so on.
// It returns nil when the node could hold the request when empty.
func (c *ContainerRequest) CheckFits(inv *NodeInventory) error {
	usable := 0
	var maxMem int64
	for _, g := range inv.GPUs {
		if !g.Shareable() {
			continue
		}
		usable++
		maxMem = max(maxMem, g.MemoryBytes)
	}
	if n := c.WholeGPUs + c.Shares; n > usable {
		return fmt.Errorf("container %q asks for %d GPUs but node %s has %d usable whole or shared (not in MIG mode, not an mdev parent)", c.Name, n, inv.Node, usable)
	}
	if c.Shares > 0 && c.ShareMemoryBytes > maxMem {
		return fmt.Errorf("container %q asks for %d bytes per share but the largest GPU on node %s has %d", c.Name, c.ShareMemoryBytes, inv.Node, maxMem)
	}
	return nil
}
