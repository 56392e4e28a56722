package agent

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/deviceplugin"
	"github.com/tessera-gpu/tessera/internal/gpu"
)

var _ deviceplugin.Source = (*Agent)(nil)

// Token ID prefixes. Whole GPUs and shares are fungible tokens: the kubelet only counts them, the
// extender decides which GPU, and the NRI plugin realises that decision (docs/architecture.md).
const (
	wholeTokenPrefix = "gpu-"
	shareTokenPrefix = "vgpu-"
)

// mdevSlot is an mdev device that exists or can be created, by UUID.
type mdevSlot struct {
	parentBus, typeName string
	exists              bool
}

// Resources lists the resources this node serves now.
func (a *Agent) Resources() []string {
	inv := a.Inventory()
	set := map[string]bool{}
	for _, g := range inv.GPUs {
		if g.Shareable() {
			set[api.ResourceGPU], set[api.ResourceShare] = true, true
		}
		if g.MIG != nil {
			for _, m := range g.MIG.Instances {
				set[api.MIGResource(m.Profile)] = true
			}
		}
		for _, t := range g.Mdev {
			set[api.MdevResource(t.Name)] = true
		}
	}
	return sortedKeys(set)
}

// Changed fires when devices or health may have changed.
func (a *Agent) Changed() <-chan struct{} { return a.changed }

// Devices reports the devices of a resource and their health.
func (a *Agent) Devices(resource string) []*pluginapi.Device {
	inv := a.Inventory()
	usage := a.ledger.Usage()
	switch {
	case resource == api.ResourceGPU || resource == api.ResourceShare:
		// DRA claims hold GPUs the kubelet does not count against these tokens: a GPU a claim holds
		// whole is not offered, and a claim's share takes one of its GPU's share tokens.
		claims := a.ledger.ClaimUsage()
		gpus, free := 0, 0
		prefix, per := wholeTokenPrefix, 1
		if resource == api.ResourceShare {
			prefix, per = shareTokenPrefix, inv.SharesPerGPU
		}
		for _, g := range inv.GPUs {
			if !g.Shareable() {
				continue
			}
			gpus++
			u, cu := usage[g.UUID], claims[g.UUID]
			// A GPU holding shares is not offered whole; a GPU held whole offers no shares.
			switch {
			case !g.Healthy:
			case resource == api.ResourceGPU && u.Shares == 0 && !cu.Whole:
				free++
			case resource == api.ResourceShare && !u.Whole:
				free += per - min(per, cu.Shares)
			}
		}
		return a.tokens(resource, prefix, gpus*per, free)
	case strings.HasPrefix(resource, api.MIGResourcePrefix):
		// Likewise a MIG instance a DRA claim holds is not offered: the kubelet would hand it out again.
		claimed := a.ledger.ClaimHeld()
		var out []*pluginapi.Device
		for _, g := range inv.GPUs {
			if g.MIG == nil {
				continue
			}
			for _, m := range g.MIG.Instances {
				if api.MIGResource(m.Profile) == resource {
					out = append(out, device(m.UUID, g.Healthy && a.healthy(m.UUID) && !claimed[m.UUID], g.NUMANode))
				}
			}
		}
		return out
	case strings.HasPrefix(resource, api.MdevResourcePrefix):
		return a.mdevDevices(inv, strings.TrimPrefix(resource, api.MdevResourcePrefix))
	}
	return nil
}

func (a *Agent) healthy(uuid string) bool {
	a.mu.RLock()
	defer a.mu.RUnlock()
	_, bad := a.unhealthy[uuid]
	return !bad
}

func device(id string, healthy bool, numa int) *pluginapi.Device {
	d := &pluginapi.Device{ID: id, Health: pluginapi.Unhealthy}
	if healthy {
		d.Health = pluginapi.Healthy
	}
	if numa >= 0 {
		d.Topology = &pluginapi.TopologyInfo{Nodes: []*pluginapi.NUMANode{{ID: int64(numa)}}}
	}
	return d
}

// tokens returns total tokens of which healthyCount are healthy: those the kubelet has already
// handed out first (they stay in use), then the lowest-numbered spares.
func (a *Agent) tokens(resource, prefix string, total, healthyCount int) []*pluginapi.Device {
	inUse := map[string]bool{}
	if a.allocated != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		if grants, err := a.allocated(ctx); err == nil {
			for _, g := range grants {
				for _, id := range g[resource] {
					inUse[id] = true
				}
			}
		}
		cancel()
	}
	out := make([]*pluginapi.Device, total)
	left := healthyCount
	for i := range out {
		id := prefix + strconv.Itoa(i)
		out[i] = device(id, false, -1)
		if inUse[id] && left > 0 {
			out[i].Health = pluginapi.Healthy
			left--
		}
	}
	for _, d := range out {
		if left == 0 {
			break
		}
		if d.Health != pluginapi.Healthy && !inUse[d.ID] {
			d.Health = pluginapi.Healthy
			left--
		}
	}
	return out
}

// mdevDevices lists existing and creatable mdev devices of a type by the UUID they have or will get.
func (a *Agent) mdevDevices(inv *api.NodeInventory, typeName string) []*pluginapi.Device {
	slots := map[string]mdevSlot{}
	var out []*pluginapi.Device
	for _, g := range inv.GPUs {
		for _, t := range g.Mdev {
			if t.Name != typeName {
				continue
			}
			for _, id := range t.Instances {
				slots[id] = mdevSlot{g.PCIBusID, t.Name, true}
				out = append(out, device(id, g.Healthy, g.NUMANode))
			}
			for k, made := 0, 0; made < t.Available; k++ {
				id := slotUUID(g.PCIBusID, t.Name, k)
				if slices.Contains(t.Instances, id) {
					continue
				}
				slots[id] = mdevSlot{g.PCIBusID, t.Name, false}
				out = append(out, device(id, g.Healthy, g.NUMANode))
				made++
			}
		}
	}
	a.mu.Lock()
	if a.mdevSlots == nil {
		a.mdevSlots = map[string]mdevSlot{}
	}
	for id, s := range slots {
		a.mdevSlots[id] = s
	}
	a.mu.Unlock()
	return out
}

// slotUUID is the stable UUID the k-th creatable mdev of a type on a parent will get.
func slotUUID(parentBus, typeName string, k int) string {
	sum := sha256.Sum256([]byte(fmt.Sprintf("%s/%s/%d", parentBus, typeName, k)))
	h := hex.EncodeToString(sum[:16])
	return h[0:8] + "-" + h[8:12] + "-4" + h[13:16] + "-8" + h[17:20] + "-" + h[20:32]
}

// Allocate returns CDI names only. Tokens get the common device of their kind; MIG instances and
// mdev devices are hardware-bound and named 1:1; mdev devices are created here.
func (a *Agent) Allocate(resource string, ids []string) (*pluginapi.ContainerAllocateResponse, error) {
	gen := a.cfg.Generator
	switch {
	case resource == api.ResourceGPU:
		return cdiResponse(gen.Name(cdi.ClassGPU, cdi.CommonName)), nil
	case resource == api.ResourceShare:
		return cdiResponse(gen.Name(cdi.ClassShare, cdi.ShareName)), nil
	case strings.HasPrefix(resource, api.MIGResourcePrefix):
		var names []string
		for _, id := range ids {
			if _, m := a.Node().MIGByUUID(id); m == nil || api.MIGResource(m.Profile) != resource {
				return nil, fmt.Errorf("%s: no MIG instance %s on this node", resource, id)
			}
			names = append(names, gen.Name(cdi.ClassMIG, id))
		}
		return cdiResponse(names...), nil
	case strings.HasPrefix(resource, api.MdevResourcePrefix):
		return a.allocateMdev(resource, ids)
	}
	return nil, fmt.Errorf("resource %s is not served by this node", resource)
}

func (a *Agent) allocateMdev(resource string, ids []string) (*pluginapi.ContainerAllocateResponse, error) {
	var names []string
	created := false
	for _, id := range ids {
		a.mu.RLock()
		slot, ok := a.mdevSlots[id]
		a.mu.RUnlock()
		if !ok || api.MdevResource(slot.typeName) != resource {
			return nil, fmt.Errorf("%s: no mdev device or slot %s on this node", resource, id)
		}
		if !slot.exists && !slices.ContainsFunc(a.Node().Mdevs, func(m gpu.MdevDevice) bool { return m.UUID == id }) {
			if err := a.backend.CreateMdev(slot.parentBus, slot.typeName, id); err != nil {
				return nil, fmt.Errorf("%s: %w", resource, err)
			}
			created = true
		}
		names = append(names, a.cfg.Generator.Name(cdi.ClassMdev, id))
	}
	if created {
		// The new device's VFIO group is known only now: rewrite the specs before the runtime reads them.
		if err := a.Refresh(context.Background()); err != nil {
			return nil, err
		}
	}
	return cdiResponse(names...), nil
}

func cdiResponse(names ...string) *pluginapi.ContainerAllocateResponse {
	r := &pluginapi.ContainerAllocateResponse{}
	for _, n := range slices.Compact(slices.Sorted(slices.Values(names))) {
		r.CdiDevices = append(r.CdiDevices, &pluginapi.CDIDevice{Name: n})
	}
	return r
}

// Preferred keeps mustInclude and fills up with devices closest to them (same parent GPU / NUMA
// node for MIG and mdev; tokens are interchangeable).
func (a *Agent) Preferred(resource string, available, mustInclude []string, size int) ([]string, error) {
	out := append([]string(nil), mustInclude...)
	if len(out) >= size {
		return out[:size], nil
	}
	parent := a.parentIndex()
	anchor := -1
	if len(out) > 0 {
		anchor = parent[out[0]]
	}
	rest := slices.DeleteFunc(slices.Clone(available), func(id string) bool { return slices.Contains(out, id) })
	slices.SortStableFunc(rest, func(x, y string) int {
		return closeness(parent, anchor, x) - closeness(parent, anchor, y)
	})
	for _, id := range rest {
		if len(out) == size {
			break
		}
		if anchor < 0 {
			anchor = parent[id]
		}
		out = append(out, id)
	}
	return out, nil
}

// parentIndex maps MIG and mdev device IDs to their parent GPU's index.
func (a *Agent) parentIndex() map[string]int {
	idx := map[string]int{}
	n := a.Node()
	if n == nil {
		return idx
	}
	for _, g := range n.GPUs {
		if g.MIG != nil {
			for _, m := range g.MIG.Instances {
				idx[m.UUID] = g.Index
			}
		}
	}
	a.mu.RLock()
	for id, s := range a.mdevSlots {
		if g := n.GPUByBus(s.parentBus); g != nil {
			idx[id] = g.Index
		}
	}
	a.mu.RUnlock()
	return idx
}

func closeness(parent map[string]int, anchor int, id string) int {
	if anchor < 0 {
		return 0
	}
	if p, ok := parent[id]; ok && p == anchor {
		return 0
	}
	return 1
}
