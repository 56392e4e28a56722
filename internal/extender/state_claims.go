package extender

import (
	"reflect"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// The State's DRA claims (claims.go says why): every claim the scheduler's allocator gave devices
// of Tessera's driver is occupied capacity on its node (status.allocation, which only the
// scheduler writes), and Filter's choice for a claim pod is held until its claim is seen allocated.

// claimEntry is an allocated claim's devices of Tessera's driver on one node.
type claimEntry struct {
	uid     types.UID
	node    string
	results []resourceapi.DeviceRequestAllocationResult
	// placement is results resolved against the node's GPUs while applied.
	placement placement.Placement
	applied   bool
}

// readClaims makes the State count allocated claims and learn claim pods' shapes from src; the
// node agent's holdings then leave claims out (they are counted from the API server here).
func (s *State) readClaims(src *ClaimSource) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.claimSrc = src
}

// tessResults are the claim's allocated devices of Tessera's driver, admin access left out (it
// takes nothing), and the node: Tessera's pool is named after its node.
func tessResults(c *resourceapi.ResourceClaim) (string, []resourceapi.DeviceRequestAllocationResult) {
	if c.Status.Allocation == nil {
		return "", nil
	}
	node := ""
	var out []resourceapi.DeviceRequestAllocationResult
	for _, r := range c.Status.Allocation.Devices.Results {
		if r.Driver != api.DRADriverName || r.AdminAccess != nil && *r.AdminAccess {
			continue
		}
		if node == "" {
			node = r.Pool
		}
		if r.Pool == node {
			out = append(out, r)
		}
	}
	return node, out
}

// UpsertClaim counts a claim's allocated devices on its node (or stops counting them once the claim
// is deallocated), and drops Filter's holds for the pods it is reserved for: their GPUs are now
// counted here.
func (s *State) UpsertClaim(c *resourceapi.ResourceClaim) {
	s.mu.Lock()
	defer s.mu.Unlock()
	node, results := tessResults(c)
	old := s.claims[c.UID]
	if old != nil && (old.node != node || !reflect.DeepEqual(old.results, results)) {
		s.removeClaimLocked(old)
		old = nil
	}
	if old == nil && len(results) > 0 {
		ce := &claimEntry{uid: c.UID, node: node, results: results}
		s.claims[c.UID] = ce
		on := s.claimsOn[node]
		if on == nil {
			on = map[types.UID]*claimEntry{}
			s.claimsOn[node] = on
		}
		on[c.UID] = ce
		s.applyClaimLocked(ce)
	}
	if len(results) == 0 {
		return
	}
	for _, r := range c.Status.ReservedFor {
		if r.Resource != "pods" || r.APIGroup != "" {
			continue
		}
		if p := s.pods[r.UID]; p != nil && p.reserved && p.claimHold {
			s.removeLocked(p)
		}
	}
}

// DeleteClaim stops counting a claim.
func (s *State) DeleteClaim(uid types.UID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ce := s.claims[uid]; ce != nil {
		s.removeClaimLocked(ce)
	}
}

func (s *State) removeClaimLocked(ce *claimEntry) {
	if e := s.nodes[ce.node]; e != nil && ce.applied {
		s.releaseOn(e, &ce.placement)
	}
	ce.applied = false
	if on := s.claimsOn[ce.node]; on != nil {
		delete(on, ce.uid)
		if len(on) == 0 {
			delete(s.claimsOn, ce.node)
		}
	}
	delete(s.claims, ce.uid)
}

// applyClaimLocked counts the claim on its node (when the node is known; UpsertNode applies it
// otherwise).
func (s *State) applyClaimLocked(ce *claimEntry) {
	e := s.nodes[ce.node]
	if e == nil || ce.applied {
		return
	}
	ce.placement = claimPlacement(e.state, ce.results)
	s.applyOn(e, &ce.placement)
	ce.applied = true
}

// claimPlacement resolves allocated devices (gpu-<index>) against a node's GPUs: a device the
// allocation consumed no capacity of, or all of its memory, is held whole; otherwise it holds a
// share of the memory and compute consumed. Devices the node's inventory lacks (MIG instances,
// GPUs gone) are left out.
func claimPlacement(n *placement.NodeState, results []resourceapi.DeviceRequestAllocationResult) placement.Placement {
	var p placement.Placement
	for _, r := range results {
		idx, ok := strings.CutPrefix(r.Device, "gpu-")
		if !ok {
			continue
		}
		i, err := strconv.Atoi(idx)
		if err != nil {
			continue
		}
		g := -1
		for k := range n.GPUs {
			if n.GPUs[k].Index == i {
				g = k
			}
		}
		if g < 0 {
			continue
		}
		mem, memOK := r.ConsumedCapacity["memory"]
		if r.ConsumedCapacity == nil || !memOK || n.GPUs[g].Memory > 0 && mem.Value() >= n.GPUs[g].Memory {
			p.Devices = append(p.Devices, placement.Device{GPU: g, Whole: true})
			continue
		}
		compute := r.ConsumedCapacity["compute"]
		p.Devices = append(p.Devices, placement.Device{GPU: g, Memory: mem.Value(), Milli: int(compute.Value()) * 10})
	}
	return p
}

// claimShapesLocked is the pod's claims' shapes for the typical-shape statistics (nil when the
// State does not read claims, or they do not parse).
func (s *State) claimShapesLocked(pod *corev1.Pod) []placement.ContainerShape {
	if s.claimSrc == nil || len(pod.Spec.ResourceClaims) == 0 {
		return nil
	}
	shapes, err := s.claimSrc.shapes(pod, false)
	if err != nil {
		return nil
	}
	return shapes
}

// holdClaimChoice holds Filter's choice for a pod whose GPUs are claims (a: the GPUs the policy
// chose there; the allocator may take others of the node, but as many and as much) until its claim
// is seen allocated or ttl passes, so the pods filtered meanwhile see it; base is the pod's request
// as the informer parsed it (holdable's check), req with the claims' shapes.
func (s *State) holdClaimChoice(pod *corev1.Pod, base, req *placement.Request, a *api.PodAssignment, ttl time.Duration) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if why := s.unholdableLocked(pod, base); why != "" {
		return why
	}
	s.reserveForLocked(pod.UID, req.Key, pod.Namespace, req, a, ttl)
	s.pods[pod.UID].claimHold = true
	return ""
}
