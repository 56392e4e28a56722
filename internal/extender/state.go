package extender

import (
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// State is the extender's view of the cluster: every node's GPU inventory and what is committed
// on it. It is rebuilt from the API server (node inventory annotations, pod assignment annotations)
// through informers and holds nothing else but in-flight reservations, which live until the bind
// lands (the pod's annotation shows up) or fails (Unreserve) or their TTL passes.
type State struct {
	mu     sync.RWMutex
	nodes  map[string]*nodeEntry
	pods   map[types.UID]*podEntry
	shapes *placement.ShapeStats
	// typeIDs interns node hardware types (placement.NodeState.TypeKey) for the fragmentation cache.
	typeIDs map[string]int
	// podsOn indexes pod entries by node name, so a node (re)appearing re-applies only its own pods.
	podsOn map[string]map[types.UID]*podEntry
	// observed are the non-terminated pods counted in shapes (arrived: pending or assigned).
	observed map[types.UID]*placement.Request
	// requests are the non-terminated GPU pods' requests, parsed once per pod version
	// (state_requests.go); parse is RequestFromPod (a test counts its calls).
	requests map[types.UID]parsedRequest
	parse    func(*corev1.Pod, ClassOptions) (*placement.Request, error)
	// uses are the CPU and memory requests of pods bound to a node (every pod, not only GPU pods) and
	// of our reservations, charged to the node's state so that CPU shapes placement as in the
	// simulator; usesOn indexes them by node.
	uses   map[types.UID]*podUse
	usesOn map[string]map[types.UID]*podUse
	// nodeGen counts node entries created or deleted; resolved caches name lists resolved to
	// entries under a nodeGen (the scheduler sends the same lists again and again).
	nodeGen  uint64
	resolved resolveCache
	// slots is one more than the highest node slot handed out; freeSlots are those of deleted nodes.
	slots     atomic.Int64
	freeSlots []int
	ttl       time.Duration
	now       func() time.Time
	// InventoryMaxAge, when positive, makes nodes whose inventory heartbeat is missing or older
	// unusable (set before the informers start).
	InventoryMaxAge time.Duration
	// conflicts counts pod entries applied on a GPU another entry already holds (should stay 0).
	conflicts atomic.Int64
	log       *slog.Logger
	// changes lists the nodes whose placement state changed, for the change subscription
	// (state_changes.go: the evaluation warmer).
	changes changeLog
}

type nodeEntry struct {
	name   string
	labels map[string]string
	inv    *api.NodeInventory
	// invErr explains why the node has no usable inventory (missing or invalid annotation).
	invErr string
	// raw is the inventory annotation the state was built from.
	raw   string
	state *placement.NodeState
	// holders are the pods (committed or reserved) whose devices are applied to state.
	holders map[types.UID]bool
	// heldRaw is the node agent's holdings annotation; held are its pods this state does not track
	// (local placements, holds of restarting containers), applied to state as occupied.
	heldRaw string
	held    map[types.UID]placement.Placement
	// heartbeat is when the node agent last confirmed the inventory (zero: none or unreadable,
	// heartbeatErr says which).
	heartbeat    time.Time
	heartbeatErr string
	// slot is the entry's index in per-node tables (the evaluation memo); freed slots are reused.
	slot int
	// changed: the entry is in the change log (guarded by changeLog.mu).
	changed bool
}

// unusable says why placement must not use the node now ("" when it may): no entry, no valid
// inventory, or (with InventoryMaxAge) an inventory its agent has not confirmed recently.
func (s *State) unusable(e *nodeEntry, now time.Time) string {
	switch {
	case e == nil:
		return "node is not known to the extender yet"
	case e.inv == nil:
		return e.invErr
	case s.InventoryMaxAge <= 0:
		return ""
	case e.heartbeatErr != "":
		return e.heartbeatErr
	case now.Sub(e.heartbeat) > s.InventoryMaxAge:
		return fmt.Sprintf("node's GPU inventory is stale: last confirmed %s ago (at most %s); is tessera-node running there?",
			now.Sub(e.heartbeat).Round(time.Second), s.InventoryMaxAge)
	}
	return ""
}

type podEntry struct {
	uid       types.UID
	key       string
	namespace string
	node      string
	req       *placement.Request
	// assignment is what the pod holds; placement is it resolved against the node's GPUs.
	assignment *api.PodAssignment
	placement  placement.Placement
	applied    bool
	// priority is the pod's (spec.priority, resolved by admission): preemption may name it as a
	// victim only for a preemptor of higher priority.
	priority int32
	// reserved marks an in-flight decision (bind not landed yet); expires bounds it.
	reserved bool
	expires  time.Time
}

// podUse is one pod's CPU and memory on a node; reserved ones are ours, in flight, until expires.
type podUse struct {
	uid      types.UID
	node     string
	cpu, mem int64
	applied  bool
	reserved bool
	expires  time.Time
}

// NewState returns an empty state; ttl bounds in-flight reservations.
func NewState(ttl time.Duration, log *slog.Logger) *State {
	if log == nil {
		log = slog.Default()
	}
	return &State{nodes: map[string]*nodeEntry{}, pods: map[types.UID]*podEntry{}, shapes: placement.NewShapeStats(),
		typeIDs: map[string]int{}, podsOn: map[string]map[types.UID]*podEntry{}, observed: map[types.UID]*placement.Request{},
		uses: map[types.UID]*podUse{}, usesOn: map[string]map[types.UID]*podUse{},
		requests: map[types.UID]parsedRequest{}, parse: RequestFromPod, ttl: ttl, now: time.Now, log: log}
}

// Shapes returns the task-shape statistics of the pods seen so far (FGD's typical shapes).
func (s *State) Shapes() *placement.ShapeStats { return s.shapes }

// nodeSlots is the number of node slots handed out (per-node tables need this many).
func (s *State) nodeSlots() int { return int(s.slots.Load()) }

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
	e.heartbeat, e.heartbeatErr = time.Time{}, ""
	if hb, ok := node.Annotations[api.AnnotationInventoryHeartbeat]; !ok {
		e.heartbeatErr = "node's GPU inventory carries no heartbeat (annotation " + api.AnnotationInventoryHeartbeat + "); is tessera-node running there, and new enough?"
	} else if t, err := time.Parse(time.RFC3339, hb); err != nil {
		e.heartbeatErr = fmt.Sprintf("node's GPU inventory heartbeat %q is not an RFC 3339 time", hb)
	} else {
		e.heartbeat = t
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
		if e.state != nil {
			s.shapes.AddNodeFree(e.state, -1)
		}
		delete(s.nodes, name)
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
	if podTerminated(pod) {
		delete(s.requests, pod.UID)
	} else {
		_, _ = s.requestLocked(pod, opts) // for the verbs, pending unschedulable pods' included
	}
	s.observeLocked(pod, opts)
	switch {
	case podTerminated(pod):
		s.clearUseLocked(pod.UID, false)
	case pod.Spec.NodeName != "":
		cpu, mem := podCPUMem(pod)
		s.setUseLocked(&podUse{uid: pod.UID, node: pod.Spec.NodeName, cpu: cpu, mem: mem})
	}
	old := s.pods[pod.UID]
	a, req := counted(pod, func(p *corev1.Pod) (*placement.Request, error) { return s.requestLocked(p, opts) }, s.reservedLocked)
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

// Reserved is reservedLocked for callers outside the lock (bind's fresh list).
func (s *State) Reserved(uid types.UID, a *api.PodAssignment) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.reservedLocked(uid, a)
}

// observeLocked counts a pod's task shape once while it is not terminated: pending pods count too,
// because the typical shapes are the arrival distribution (the FGD paper's), not what got placed.
func (s *State) observeLocked(pod *corev1.Pod, opts ClassOptions) {
	if podTerminated(pod) || unschedulable(pod) {
		// A pending pod the scheduler found no node for is not an arrival the cluster can serve:
		// junk pods must not collapse the learned mix (the simulator forgets failed pods alike).
		s.forgetLocked(pod.UID)
		return
	}
	if _, ok := s.observed[pod.UID]; ok {
		return
	}
	req, err := s.requestLocked(pod, opts)
	if err != nil || !req.WantsGPU() {
		return
	}
	s.observed[pod.UID] = req
	s.shapes.Observe(req, 1)
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
	s.pods[p.uid] = p
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
		pl := placementOf(e.state, &api.PodAssignment{APIVersion: api.Version, Node: h.Node, Containers: ph.Containers})
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

// Reserve holds an in-flight decision so that concurrent filter/prioritize/bind calls see it.
func (s *State) Reserve(uid types.UID, key, namespace string, req *placement.Request, a *api.PodAssignment) {
	s.ReserveFor(uid, key, namespace, req, a, s.ttl)
}

// ReserveFor is Reserve with its own lifetime (Filter's choice is held briefly: if no bind follows,
// the scheduler went elsewhere).
func (s *State) ReserveFor(uid types.UID, key, namespace string, req *placement.Request, a *api.PodAssignment, ttl time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if old := s.pods[uid]; old != nil {
		s.removeLocked(old)
	}
	p := &podEntry{uid: uid, key: key, namespace: namespace, node: a.Node, req: req, assignment: a, reserved: true, expires: s.now().Add(ttl)}
	s.addLocked(p)
	s.setUseLocked(&podUse{uid: uid, node: a.Node, cpu: req.CPUMilli, mem: req.MemMiB, reserved: true, expires: p.expires})
}

// ReserveUse holds an in-flight decision of a pod without GPUs (its CPU and memory on a node).
func (s *State) ReserveUse(uid types.UID, node string, req *placement.Request, ttl time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p := s.pods[uid]; p != nil && p.reserved {
		s.removeLocked(p)
	}
	s.setUseLocked(&podUse{uid: uid, node: node, cpu: req.CPUMilli, mem: req.MemMiB, reserved: true, expires: s.now().Add(ttl)})
}

// Unreserve drops an in-flight decision that did not land; committed assignments stay.
func (s *State) Unreserve(uid types.UID) {
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
	for _, p := range s.pods {
		if p.reserved && now.After(p.expires) {
			s.removeLocked(p)
			n++
		}
	}
	for uid, u := range s.uses {
		if u.reserved && now.After(u.expires) {
			s.clearUseLocked(uid, true)
			n++
		}
	}
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

// View runs f with read access to the named nodes' states (missing nodes get a nil state and the
// reason). f must not keep the states after it returns.
func (s *State) View(names []string, f func(name string, n *placement.NodeState, missing string)) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	now := s.now()
	for _, name := range names {
		e := s.nodes[name]
		if why := s.unusable(e, now); why != "" {
			f(name, nil, why)
		} else {
			f(name, e.state, "")
		}
	}
}

// bindBase is what a bind's decision starts from (decide, bind.go): a node's inventory, labels,
// CPU and memory (used: less the binding pod's own hold), the pod's own in-flight decision there
// and the other pods' (Filter's holds, other binds' reservations).
type bindBase struct {
	inv                        *api.NodeInventory
	labels                     map[string]string
	cpu, mem, usedCPU, usedMem int64
	own                        *api.PodAssignment
	holds                      map[types.UID]*api.PodAssignment
}

// bindBase returns node's base for binding pod uid, or nil and why placement must not use the node.
func (s *State) bindBase(node string, uid types.UID) (*bindBase, string) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	e := s.nodes[node]
	if missing := s.unusable(e, s.now()); missing != "" {
		return nil, missing
	}
	// CPU and memory come from the informers (every pod's requests), less this pod's own hold:
	// the GPU choice inside the node then weighs them as Filter and the simulator do.
	b := &bindBase{inv: e.inv, labels: e.labels, holds: map[types.UID]*api.PodAssignment{},
		cpu: e.state.CPUMilli, mem: e.state.MemMiB, usedCPU: e.state.UsedCPU, usedMem: e.state.UsedMem}
	if u := s.uses[uid]; u != nil && u.node == node && u.applied {
		b.usedCPU, b.usedMem = b.usedCPU-u.cpu, b.usedMem-u.mem
	}
	for other, p := range s.podsOn[node] {
		switch {
		case !p.reserved:
		case other == uid:
			b.own = p.assignment
		default:
			b.holds[other] = p.assignment
		}
	}
	return b, ""
}

// parallelMin is the node count from which viewIndexed spreads the work over GOMAXPROCS goroutines.
const parallelMin = 512

// viewIndexed is View for hot loops: f gets the worker number (0..workers-1, for per-worker scratch),
// the name's index and the node's slot (-1 when there is no node), and runs on up to workers
// goroutines at once, all under one read lock.
func (s *State) viewIndexed(names []string, workers int, f func(w, i, slot int, n *placement.NodeState, missing string)) {
	s.viewIndexedThen(names, workers, f, nil)
}

// revisit visits some names of a viewIndexedThen call again (names[order[k]], in that order as
// workers come free); g returns false to stop its worker. Only names that had a node.
type revisit func(order []int, g func(w, i, slot int, n *placement.NodeState) bool)

// viewIndexedThen is viewIndexed, then (when not nil) then under the same read lock: it may visit
// names again with the node states f saw.
func (s *State) viewIndexedThen(names []string, workers int, f func(w, i, slot int, n *placement.NodeState, missing string), then func(again revisit)) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	entries := s.resolved.resolve(names, s.nodeGen, s.nodes)
	now := s.now()
	spread(len(names), workers, parallelMin, 64, func(w, i int) bool {
		if e := entries[i]; e != nil && e.inv != nil && s.InventoryMaxAge <= 0 {
			f(w, i, e.slot, e.state, "") // the common case, without the checks' call
		} else if why := s.unusable(e, now); why != "" {
			f(w, i, -1, nil, why)
		} else {
			f(w, i, e.slot, e.state, "")
		}
		return true
	})
	if then != nil {
		then(func(order []int, g func(w, i, slot int, n *placement.NodeState) bool) {
			spread(len(order), workers, 32, 1, func(w, k int) bool {
				e := entries[order[k]]
				return g(w, order[k], e.slot, e.state)
			})
		})
	}
}

// spread calls fn(w, k) for k in 0..count-1, in order on the calling goroutine below parallelFrom
// items, else on workers goroutines taking chunks of k in order; fn returning false stops its
// goroutine.
func spread(count, workers, parallelFrom, chunk int, fn func(w, k int) bool) {
	if workers <= 1 || count < parallelFrom {
		for k := range count {
			if !fn(0, k) {
				return
			}
		}
		return
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				start := int(next.Add(int64(chunk))) - chunk
				if start >= count {
					return
				}
				for k := start; k < min(start+chunk, count); k++ {
					if !fn(w, k) {
						return
					}
				}
			}
		}()
	}
	wg.Wait()
}

// resolveCache remembers the last few name lists resolved to node entries (the least recently used
// goes). Entries stay valid while no node is created or deleted (an entry's state may change; the
// entry pointer does not).
type resolveCache struct {
	mu    sync.Mutex
	slots [2]resolved
	next  int
}

type resolved struct {
	gen     uint64
	names   []string
	entries []*nodeEntry
}

// resolve returns the entries of names (nil where unknown); callers hold the State's read lock.
func (c *resolveCache) resolve(names []string, gen uint64, nodes map[string]*nodeEntry) []*nodeEntry {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := range c.slots {
		sl := &c.slots[i]
		if sl.gen == gen && sl.entries != nil && slices.Equal(sl.names, names) {
			// The other slot goes next: pick-one's filter (every node) and prioritize (its one
			// node, a new list each pod) alternate, and the long list must stay.
			c.next = (i + 1) % len(c.slots)
			return sl.entries
		}
	}
	entries := make([]*nodeEntry, len(names))
	for i, n := range names {
		entries[i] = nodes[n]
	}
	c.slots[c.next] = resolved{gen: gen, names: slices.Clone(names), entries: entries}
	c.next = (c.next + 1) % len(c.slots)
	return entries
}

// internNames runs f with intern, which returns the State's own string for a known node's name
// (the map lookup takes the bytes without allocating) and a new string for any other; f runs under
// one read lock (the request decoder reads thousands of names per call, wire.go).
func (s *State) internNames(f func(intern func(b []byte) string)) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	f(func(b []byte) string {
		if e := s.nodes[string(b)]; e != nil {
			return e.name
		}
		return string(b)
	})
}

// NamespaceUsage is the GPU resources held (committed or reserved) by pods of a namespace.
func (s *State) NamespaceUsage(ns string) map[string]int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := map[string]int64{}
	for _, p := range s.pods {
		if p.namespace != ns || p.req == nil {
			continue
		}
		for k, v := range requestQuantities(p.req) {
			out[k] += v
		}
	}
	return out
}

// Conflicts is how many times the state applied a pod on a GPU that another entry held.
func (s *State) Conflicts() int64 { return s.conflicts.Load() }

// Holds reports whether the state has an entry (committed or reserved) for the pod.
func (s *State) Holds(uid types.UID) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.pods[uid] != nil
}
