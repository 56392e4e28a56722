package ledger

import (
	"fmt"
	"sort"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// PlaceLocally chooses GPUs for a container that arrived without an assignment (its pod was
// scheduled without the extender): best fit on this node, the same rules Reserve enforces.
func (l *Ledger) PlaceLocally(req *api.ContainerRequest, inv *api.NodeInventory) ([]api.DeviceAssignment, error) {
	// A pod bound by nodeName never met the extender: what no GPU here could hold (a share larger
	// than the largest GPU) is refused with that reason, not as "no room now".
	if err := req.CheckFits(inv); err != nil {
		return nil, err
	}
	usage := l.Usage()
	type cand struct {
		gpu  *api.GPU
		free int64
	}
	var cands []cand
	n := req.WholeGPUs + req.Shares
	for i := range inv.GPUs {
		g := &inv.GPUs[i]
		u := usage[g.UUID]
		if !g.Shareable() || !g.Healthy || u.Whole {
			continue
		}
		if req.WholeGPUs > 0 {
			if u.Shares == 0 {
				cands = append(cands, cand{g, g.MemoryBytes})
			}
			continue
		}
		mem := req.ShareMemoryOn(g.MemoryBytes)
		if api.FitsWithin(u.MemoryBytes, mem, g.MemoryBytes) && api.FitsWithin(int64(u.Cores), int64(req.ShareCores), api.MaxCoresPercent) && u.Shares < inv.SharesPerGPU {
			cands = append(cands, cand{g, g.MemoryBytes - u.MemoryBytes - mem})
		}
	}
	if len(cands) < n {
		return nil, fmt.Errorf("container %q needs %d GPUs but only %d on node %s can take it now", req.Name, n, len(cands), inv.Node)
	}
	// Best fit: the GPUs left with the least free memory, so whole GPUs stay whole.
	sort.SliceStable(cands, func(i, j int) bool { return cands[i].free < cands[j].free })
	out := make([]api.DeviceAssignment, 0, n)
	for _, c := range cands[:n] {
		if req.WholeGPUs > 0 {
			out = append(out, api.DeviceAssignment{UUID: c.gpu.UUID, Whole: true})
		} else {
			out = append(out, api.DeviceAssignment{UUID: c.gpu.UUID, MemoryBytes: req.ShareMemoryOn(c.gpu.MemoryBytes), CoresPercent: req.ShareCores})
		}
	}
	return out, nil
}
