package extender

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// The State's writers: the informers' events (nodes, pods) and the verbs' in-flight reservations.
// They alone change a node's placement state, through applyOn, releaseOn and addUseOn.

// UpsertNode records a node's labels and inventory; the node's GPU state is rebuilt when either changes.
func (s *State) UpsertNode(node *corev1.Node) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.nodes[node.Name]
	if e == nil {
		e = &nodeEntry{name: node.Name, holders: map[types.UID]bool{}}
		if k := len(s.freeSlots); k > 0 {
			e.slot, s.freeSlots = s.freeSlots[k-1], s.freeSlots[:k-1]
		} else {
			e.slot = int(s.slots.Add(1) - 1)
		}
		s.nodes[node.Name] = e
		s.nodeGen++
	}
	// The heartbeat counts as renewed when its value changes (a node first seen counts from now);
	// its time is the agent's clock and is only checked to be one.
	hb, ok := node.Annotations[api.AnnotationInventoryHeartbeat]
	if e.heartbeatSeen.IsZero() || hb != e.heartbeat {
		e.heartbeat, e.heartbeatSeen = hb, s.now()
	}
	e.heartbeatErr = ""
	if !ok {
		e.heartbeatErr = "node's GPU inventory carries no heartbeat (annotation " + api.AnnotationInventoryHeartbeat + "); is tessera-node running there, and new enough?"
	} else if _, err := time.Parse(time.RFC3339, hb); err != nil {
		e.heartbeatErr = fmt.Sprintf("node's GPU inventory heartbeat %q is not an RFC 3339 time", hb)
	}
	raw := node.Annotations[api.AnnotationInventory]
	cpu, mem := node.Status.Allocatable.Cpu().MilliValue(), node.Status.Allocatable.Memory().Value()>>20
	if e.state != nil && e.raw == raw && maps.Equal(e.labels, node.Labels) && e.state.CPUMilli == cpu && e.state.MemMiB == mem {
		s.applyHoldingsLocked(e, node.Annotations[api.AnnotationHoldings])
		return // status-only update: nothing else placement sees changed
	}
	var inv *api.NodeInventory
	invErr := ""
	if raw == "" {
		invErr = "node publishes no GPU inventory (annotation " + api.AnnotationInventory + "); is tessera-node running?"
	} else if d, err := api.DecodeInventory([]byte(raw)); err != nil {
		invErr = "node's GPU inventory is invalid: " + err.Error()
	} else if d.Node != node.Name {
		invErr = fmt.Sprintf("node's GPU inventory names node %q", d.Node)
	} else {
		inv = d
	}
	e.labels, e.inv, e.invErr, e.raw = maps.Clone(node.Labels), inv, invErr, raw
	if inv == nil {
		inv = &api.NodeInventory{Node: node.Name}
	}
	if e.state != nil {
		s.shapes.AddNodeFree(e.state, -1)
	}
	e.state = placement.NewNodeState(inv, e.labels)
	s.shapes.AddNodeFree(e.state, 1)
	// Allocatable CPU and memory make them hard constraints and feed tessera's stranded-GPU term, as
	// in the simulator (a node without them in its status leaves them to the kube-scheduler).
	e.state.CPUMilli, e.state.MemMiB = cpu, mem
	e.state.TrackUsage() // the evaluation memo keys outcomes by it
	key := e.state.TypeKey()
	if s.typeIDs[key] == 0 {
		s.typeIDs[key] = len(s.typeIDs) + 1
	}
	e.state.TypeID = s.typeIDs[key]
	// Re-apply every pod on this node, including those seen before the node (informers do not
	// order nodes before pods).
	for _, p := range s.podsOn[node.Name] {
		p.applied = false
		s.applyLocked(p)
	}
	for _, u := range s.usesOn[node.Name] {
		u.applied = false
		s.applyUseLocked(u)
	}
	for _, ce := range s.claimsOn[node.Name] {
		ce.applied = false
		s.applyClaimLocked(ce)
	}
	e.held, e.heldRaw = nil, ""
	s.applyHoldingsLocked(e, node.Annotations[api.AnnotationHoldings])
	s.changes.touch(e)
	if invErr != "" {
		s.log.Debug("node without usable inventory", "node", node.Name, "reason", invErr)
	}
}

// DeleteNode forgets a node; pods that name it stay recorded for when it comes back.
func (s *State) DeleteNode(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.nodes[name]; e != nil {
		for uid := range e.holders {
			if p := s.pods[uid]; p != nil {
				p.applied = false
			}
		}
		for _, u := range s.usesOn[name] {
			u.applied = false
		}
		for _, ce := range s.claimsOn[name] {
			ce.applied = false
		}
		if e.state != nil {
			s.shapes.AddNodeFree(e.state, -1)
		}
		delete(s.nodes, name)
		e.deleted = true
		s.freeSlots = append(s.freeSlots, e.slot)
		s.nodeGen++
	}
}

// podTerminated reports whether a pod no longer holds devices.
func podTerminated(pod *corev1.Pod) bool {
	return pod.DeletionTimestamp != nil && pod.Status.Phase != corev1.PodRunning ||
		pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed
}

// UpsertPod records a pod's committed assignment (or its absence) and its task shape. What an
// assignment holds is decided by counted (trust.go), the same rule bind applies to its fresh list.
func (s *State) UpsertPod(pod *corev1.Pod, opts ClassOptions) {
	s.mu.Lock()
	defer s.mu.Unlock()
	// The pod's request, parsed once per version (and kept for the verbs, pending unschedulable
	// pods' included: the scheduler tries them again).
	var req *placement.Request
	var reqErr error
	if podTerminated(pod) {
		delete(s.requests, pod.UID)
	} else {
		req, reqErr = s.requestLocked(pod, opts)
	}
	obs := req
	if reqErr == nil && req != nil {
		obs = withShapes(req, s.claimShapesLocked(pod)) // a claim pod's GPUs are part of its shape
	}
	s.observeLocked(pod, obs, reqErr)
	s.trackPendingLocked(pod, req, reqErr)
	switch {
	case podTerminated(pod):
		s.clearUseLocked(pod.UID, false)
	case pod.Spec.NodeName != "":
		cpu, mem := podCPUMem(pod)
		s.setUseLocked(&podUse{uid: pod.UID, node: pod.Spec.NodeName, cpu: cpu, mem: mem})
	}
	old := s.pods[pod.UID]
	a, req := counted(pod, func(*corev1.Pod) (*placement.Request, error) { return req, reqErr }, s.reservedLocked)
	if a == nil {
		// A reservation stays while its pod lives: the pod's update may predate our own write.
		if old != nil && !(old.reserved && !podTerminated(pod)) {
			s.removeLocked(old)
		}
		if _, annotated := pod.Annotations[api.AnnotationAssignment]; annotated && !podTerminated(pod) && (old == nil || !old.reserved) {
			s.log.Debug("assignment holds nothing (not bound there, not ours, or not the pod's request)", "pod", pod.Namespace+"/"+pod.Name, "node", pod.Spec.NodeName)
		}
		return
	}
	if pod.Spec.NodeName == "" {
		return // our own reservation, already applied
	}
	if old != nil {
		if !old.reserved && old.node == a.Node && sameAssignment(old.assignment, a) {
			return
		}
		s.removeLocked(old)
	}
	p := &podEntry{uid: pod.UID, key: pod.Namespace + "/" + pod.Name, namespace: pod.Namespace, node: a.Node, req: req, assignment: a}
	if pod.Spec.Priority != nil {
		p.priority = *pod.Spec.Priority
	}
	s.addLocked(p)
}

// reservedLocked reports whether a is this extender's in-flight reservation for the pod.
func (s *State) reservedLocked(uid types.UID, a *api.PodAssignment) bool {
	p := s.pods[uid]
	return p != nil && p.reserved && p.node == a.Node && sameAssignment(p.assignment, a)
}

// reserved is reservedLocked for callers outside the lock (bind's fresh list).
func (s *State) reserved(uid types.UID, a *api.PodAssignment) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.reservedLocked(uid, a)
}

// observeLocked counts a pod's task shape once while it is not terminated: pending pods count too,
// because the typical shapes are the arrival distribution (the FGD paper's), not what got placed.
// req and err are the pod's request as UpsertPod parsed it.
func (s *State) observeLocked(pod *corev1.Pod, req *placement.Request, err error) {
	if podTerminated(pod) || unschedulable(pod) {
		// A pending pod the scheduler found no node for is not an arrival the cluster can serve:
		// junk pods must not collapse the learned mix (the simulator forgets failed pods alike).
		s.forgetLocked(pod.UID)
		return
	}
	if _, ok := s.observed[pod.UID]; ok {
		return
	}
	if err != nil || !req.WantsGPU() {
		return
	}
	s.observed[pod.UID] = req
	s.shapes.Observe(req, 1)
	if pod.Spec.NodeName == "" {
		s.changes.arrive(req)
	}
}

// unschedulable reports whether a pending pod was found to fit no node.
func unschedulable(pod *corev1.Pod) bool {
	if pod.Spec.NodeName != "" {
		return false
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
			return true
		}
	}
	return false
}

func (s *State) forgetLocked(uid types.UID) {
	if req, ok := s.observed[uid]; ok {
		delete(s.observed, uid)
		s.shapes.Observe(req, -1)
	}
}

func (s *State) addLocked(p *podEntry) {
	s.pods[p.uid] = p // callers removed any entry of p.uid first (removeLocked)
	s.countUsageLocked(p, 1)
	on := s.podsOn[p.node]
	if on == nil {
		on = map[types.UID]*podEntry{}
		s.podsOn[p.node] = on
	}
	on[p.uid] = p
	if e := s.nodes[p.node]; e != nil {
		if pl, ok := e.held[p.uid]; ok { // now tracked as the extender's own: count it once
			s.releaseOn(e, &pl)
			delete(e.held, p.uid)
		}
	}
	s.applyLocked(p)
}

// applyOn, releaseOn and addUseOn are the only ways the State changes a node's placement state
// (besides replacing it): each records the change for the warmer (warm.go), which would otherwise
// keep outcomes evaluated before it, and the first two report the GPU compute they take or give back
// to the model pressure (placement/pressure.go).
func (s *State) applyOn(e *nodeEntry, p *placement.Placement) {
	s.shapes.AddNodeFree(e.state, -1)
	e.state.Apply(&placement.Request{}, p)
	s.shapes.AddNodeFree(e.state, 1)
	s.changes.touch(e)
}

func (s *State) releaseOn(e *nodeEntry, p *placement.Placement) {
	s.shapes.AddNodeFree(e.state, -1)
	e.state.Release(&placement.Request{}, p)
	s.shapes.AddNodeFree(e.state, 1)
	s.changes.touch(e)
}

func (s *State) addUseOn(e *nodeEntry, cpu, mem int64) {
	e.state.AddUse(cpu, mem)
	s.changes.touch(e)
}

// applyHoldingsLocked counts what the node agent's ledger holds for pods this state does not track
// (pods bound by another scheduler and placed locally, holds of restarting containers): occupied,
// so no bind collides with them. An invalid annotation counts nothing and is logged.
func (s *State) applyHoldingsLocked(e *nodeEntry, raw string) {
	if raw == e.heldRaw {
		return
	}
	for _, pl := range e.held {
		s.releaseOn(e, &pl)
	}
	e.held, e.heldRaw = map[types.UID]placement.Placement{}, raw
	if raw == "" {
		return
	}
	h, err := api.DecodeHoldings([]byte(raw))
	if err != nil || h.Node != e.name {
		s.log.Warn("ignoring node holdings", "node", e.name, "err", err)
		return
	}
	for _, ph := range h.Pods {
		uid := types.UID(ph.UID)
		if e.holders[uid] {
			continue // the extender's own pod: already counted
		}
		containers := ph.Containers
		if s.claimSrc != nil {
			// Prepared claims ("resourceclaim/<name>") are counted from their allocation instead.
			containers = slices.DeleteFunc(slices.Clone(containers), func(c api.ContainerAssignment) bool {
				return strings.HasPrefix(c.Name, claimContainerPrefix)
			})
		}
		pl := placementOf(e.state, &api.PodAssignment{APIVersion: api.Version, Node: h.Node, Containers: containers})
		s.applyOn(e, &pl)
		e.held[uid] = pl
	}
}

func sameAssignment(a, b *api.PodAssignment) bool {
	ea, _ := api.EncodeAssignment(a)
	eb, _ := api.EncodeAssignment(b)
	return string(ea) == string(eb)
}

// DeletePod releases whatever the pod held.
func (s *State) DeletePod(uid types.UID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.forgetLocked(uid)
	delete(s.requests, uid)
	delete(s.pending, uid)
	s.clearUseLocked(uid, false)
	if p := s.pods[uid]; p != nil {
		s.removeLocked(p)
	}
}

// setUseLocked records a pod's CPU and memory on a node, replacing what it held before; a bound
// pod's use replaces our reservation of it.
func (s *State) setUseLocked(u *podUse) {
	if old := s.uses[u.uid]; old != nil {
		if !old.reserved && !u.reserved && old.node == u.node && old.cpu == u.cpu && old.mem == u.mem {
			return
		}
		if !old.reserved && u.reserved {
			return // a bound pod's use is not replaced by a reservation
		}
		s.clearUseLocked(u.uid, false)
	}
	s.uses[u.uid] = u
	on := s.usesOn[u.node]
	if on == nil {
		on = map[types.UID]*podUse{}
		s.usesOn[u.node] = on
	}
	on[u.uid] = u
	s.applyUseLocked(u)
}

func (s *State) applyUseLocked(u *podUse) {
	if e := s.nodes[u.node]; e != nil && !u.applied {
		s.addUseOn(e, u.cpu, u.mem)
		u.applied = true
	}
}

// clearUseLocked forgets a pod's use (only a reservation when reservedOnly).
func (s *State) clearUseLocked(uid types.UID, reservedOnly bool) {
	u := s.uses[uid]
	if u == nil || reservedOnly && !u.reserved {
		return
	}
	if e := s.nodes[u.node]; e != nil && u.applied {
		s.addUseOn(e, -u.cpu, -u.mem)
	}
	if on := s.usesOn[u.node]; on != nil {
		delete(on, uid)
		if len(on) == 0 {
			delete(s.usesOn, u.node)
		}
	}
	delete(s.uses, uid)
}

// reserve holds an in-flight decision so that concurrent filter/prioritize/bind calls see it.
func (s *State) reserve(uid types.UID, key, namespace string, req *placement.Request, a *api.PodAssignment) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reserveForLocked(uid, key, namespace, req, a, s.ttl)
}

// reserveForLocked is reserve with its own lifetime (Filter's choice is held briefly: if no bind
// follows, the scheduler went elsewhere).
func (s *State) reserveForLocked(uid types.UID, key, namespace string, req *placement.Request, a *api.PodAssignment, ttl time.Duration) {
	if old := s.pods[uid]; old != nil {
		s.removeLocked(old)
	}
	p := &podEntry{uid: uid, key: key, namespace: namespace, node: a.Node, req: req, assignment: a, reserved: true, expires: s.now().Add(ttl)}
	s.addLocked(p)
	s.setUseLocked(&podUse{uid: uid, node: a.Node, cpu: req.CPUMilli, mem: req.MemMiB, reserved: true, expires: p.expires})
}

// reserveUseLocked holds an in-flight decision of a pod without GPUs (its CPU and memory on a node).
func (s *State) reserveUseLocked(uid types.UID, node string, req *placement.Request, ttl time.Duration) {
	if p := s.pods[uid]; p != nil && p.reserved {
		s.removeLocked(p)
	}
	s.setUseLocked(&podUse{uid: uid, node: node, cpu: req.CPUMilli, mem: req.MemMiB, reserved: true, expires: s.now().Add(ttl)})
}

// unreserve drops an in-flight decision that did not land; committed assignments stay.
func (s *State) unreserve(uid types.UID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p := s.pods[uid]; p != nil && p.reserved {
		s.removeLocked(p)
	}
	s.clearUseLocked(uid, true)
}

// ExpireReservations drops reservations older than the TTL (a bind whose outcome was never seen).
func (s *State) ExpireReservations() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	now := s.now()
	pods := map[types.UID]bool{} // a pod's GPU entry and its CPU/memory use expire together
	for _, p := range s.pods {
		if p.reserved && now.After(p.expires) {
			s.removeLocked(p)
			pods[p.uid] = true
			n++
		}
	}
	for uid, u := range s.uses {
		if u.reserved && now.After(u.expires) {
			s.clearUseLocked(uid, true)
			pods[uid] = true
			n++
		}
	}
	s.expired.Add(int64(len(pods)))
	return n
}

func (s *State) applyLocked(p *podEntry) {
	e := s.nodes[p.node]
	if e == nil {
		return // applied when the node shows up
	}
	e.holders[p.uid] = true
	if p.applied {
		return
	}
	p.placement = placementOf(e.state, p.assignment)
	for _, d := range p.placement.Devices {
		if g := &e.state.GPUs[d.GPU]; d.Whole && (g.Whole || g.Shares > 0) || !d.Whole && g.Whole {
			// Two holders of one GPU: a decision was made past another (the bug issue 14's live run
			// found); counted so that a benchmark or an operator sees it, applied so releases balance.
			s.conflicts.Add(1)
			s.log.Warn("state counts two holders of one GPU", "pod", p.key, "node", p.node, "gpu", g.UUID, "reserved", p.reserved)
		}
	}
	s.applyOn(e, &p.placement)
	p.applied = true
}

func (s *State) removeLocked(p *podEntry) {
	if e := s.nodes[p.node]; e != nil {
		delete(e.holders, p.uid)
		if p.applied {
			s.releaseOn(e, &p.placement)
		}
	}
	if on := s.podsOn[p.node]; on != nil {
		delete(on, p.uid)
		if len(on) == 0 {
			delete(s.podsOn, p.node)
		}
	}
	if cur := s.pods[p.uid]; cur != nil {
		s.countUsageLocked(cur, -1) // what leaves pods leaves the usage (nsUsage sums pods)
	}
	delete(s.pods, p.uid)
}

// placementOf resolves an assignment's devices against a node's GPUs (unknown UUIDs are skipped:
// the inventory changed under the pod, and the node agent refuses such devices anyway).
func placementOf(n *placement.NodeState, a *api.PodAssignment) placement.Placement {
	var p placement.Placement
	for ci, c := range a.Containers {
		for _, d := range c.Devices {
			i := n.GPUIndexByUUID(d.UUID)
			if i < 0 {
				continue
			}
			p.Devices = append(p.Devices, placement.Device{Container: ci, GPU: i, Whole: d.Whole, Memory: d.MemoryBytes, Milli: d.CoresPercent * 10})
		}
	}
	return p
}
