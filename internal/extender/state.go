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
// lands (the pod's annotation shows up) or fails (unreserve) or their TTL passes.
//
// Only the State's own files (state*.go) take its lock or read its maps; the rest of the package
// goes through its methods:
//   - writers (state_update.go): UpsertNode, DeleteNode, UpsertPod and DeletePod for the
//     informers; reserve, unreserve and ExpireReservations for the verbs' in-flight
//     decisions, and holdChoice for Filter's (only for a pending pod the informer has shown:
//     state_pending.go);
//   - node views (state.go): View, and viewIndexed and viewIndexedThen for the verbs' hot loops
//     (name lists resolved to nodes through a cache); internNames for the request decoder
//     (wire.go); bindBase for bind's decision;
//   - pod views: request (a pod's request, parsed once per pod version: state_requests.go),
//     reserved, Holds, namespaceUsage, and victimsFreeing for preemption (state_preempt.go);
//   - the change subscription for the evaluation warmer (state_changes.go): subscribeChanges,
//     takeChanges, viewEntries, usableEntries;
//   - Shapes (the task-shape statistics), nodeSlots and Conflicts.
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
	// pending are the unbound, non-terminated pods the informer has shown, by UID: the only pods
	// Filter's choice may be held for (state_pending.go).
	pending map[types.UID]pendingPod
	// uses are the CPU and memory requests of pods bound to a node (every pod, not only GPU pods) and
	// of our reservations, charged to the node's state so that CPU shapes placement as in the
	// simulator; usesOn indexes them by node.
	uses   map[types.UID]*podUse
	usesOn map[string]map[types.UID]*podUse
	// nsUsage is each namespace's requestQuantities summed over its entries in pods, kept as
	// entries come and go (addLocked, removeLocked): Filter's quota check asks every call, and
	// summing every pod per call cost a scan linear in the cluster's pods.
	nsUsage map[string]map[string]int64
	// nodeGen counts node entries created or deleted; resolved caches name lists resolved to
	// entries under a nodeGen (the scheduler sends the same lists again and again).
	nodeGen  uint64
	resolved resolveCache
	// nameLookups counts the names internNames looked up in nodes (not predicted; a test reads it).
	nameLookups atomic.Int64
	// slots is one more than the highest node slot handed out; freeSlots are those of deleted nodes.
	slots     atomic.Int64
	freeSlots []int
	ttl       time.Duration
	now       func() time.Time
	// InventoryMaxAge, when positive, makes nodes whose inventory heartbeat is missing, unreadable
	// or not renewed for longer, as observed on the State's clock, unusable (set before the
	// informers start).
	InventoryMaxAge time.Duration
	// conflicts counts pod entries applied on a GPU another entry already holds (should stay 0).
	conflicts atomic.Int64
	// expired counts pods whose in-flight reservation expired (no bind outcome seen within the TTL).
	expired atomic.Int64
	log     *slog.Logger
	// changes lists the nodes whose placement state changed, for the change subscription
	// (state_changes.go: the evaluation warmer).
	changes changeLog
	// claims are the allocated DRA claims of Tessera's driver, by claim UID, and claimsOn by node
	// (state_claims.go); claimSrc, when set, reads claim pods' claims (nil: claims are not read,
	// and the node agent's holdings count prepared ones).
	claims   map[types.UID]*claimEntry
	claimsOn map[string]map[types.UID]*claimEntry
	claimSrc *ClaimSource
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
	// heartbeat is the node agent's heartbeat annotation as last seen, and heartbeatSeen when (on
	// the State's own monotonic clock) it was first seen with that value: the agent's timestamp is
	// written on the agent's clock, so freshness is timed by observation, as NodeLocker times Leases
	// (a dead node whose clock runs fast must not stay placeable). heartbeatErr says why the
	// heartbeat is missing or unreadable ("" when it is not).
	heartbeat     string
	heartbeatSeen time.Time
	heartbeatErr  string
	// slot is the entry's index in per-node tables (the evaluation memo); freed slots are reused.
	slot int
	// deleted: the entry left the State's nodes (guarded by the State's lock); an entry never
	// comes back, a node seen again gets a new one.
	deleted bool
	// changed: the entry is in the change log (guarded by changeLog.mu).
	changed bool
}

// unusable says why placement must not use the node now ("" when it may): no entry, no valid
// inventory, or (with InventoryMaxAge) an inventory whose heartbeat this State has not seen
// renewed for longer than InventoryMaxAge (now is the State's clock; the check runs at every
// view, so a dead node, which sends no informer event, goes stale all the same).
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
	case now.Sub(e.heartbeatSeen) > s.InventoryMaxAge:
		return fmt.Sprintf("node's GPU inventory is stale: heartbeat not renewed for %s as observed by the extender (at most %s); is tessera-node running there?",
			now.Sub(e.heartbeatSeen).Round(time.Second), s.InventoryMaxAge)
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
	// claimHold marks Filter's hold for a pod whose GPUs are DRA claims: dropped once its claim is
	// seen allocated (state_claims.go).
	claimHold bool
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
		log = discardLog
	}
	return &State{nodes: map[string]*nodeEntry{}, pods: map[types.UID]*podEntry{}, shapes: placement.NewShapeStats(),
		typeIDs: map[string]int{}, podsOn: map[string]map[types.UID]*podEntry{}, observed: map[types.UID]*placement.Request{},
		uses: map[types.UID]*podUse{}, usesOn: map[string]map[types.UID]*podUse{}, nsUsage: map[string]map[string]int64{},
		requests: map[types.UID]parsedRequest{}, pending: map[types.UID]pendingPod{}, parse: RequestFromPod, ttl: ttl, now: time.Now, log: log,
		claims: map[types.UID]*claimEntry{}, claimsOn: map[string]map[types.UID]*claimEntry{}}
}

// Shapes returns the task-shape statistics of the pods seen so far (FGD's typical shapes).
func (s *State) Shapes() *placement.ShapeStats { return s.shapes }

// nodeSlots is the number of node slots handed out (per-node tables need this many).
func (s *State) nodeSlots() int { return int(s.slots.Load()) }

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
// CPU and memory (used: less the binding pod's own hold), the pod's own in-flight decision there,
// the other pods' (Filter's holds, other binds' reservations) and what the node agent's ledger
// holds for pods this state does not track (held: applyHoldingsLocked's view of the node's
// holdings annotation, placed on a NodeState of the same inventory).
type bindBase struct {
	inv                        *api.NodeInventory
	labels                     map[string]string
	cpu, mem, usedCPU, usedMem int64
	own                        *api.PodAssignment
	holds                      map[types.UID]*api.PodAssignment
	held                       map[types.UID]placement.Placement
	// counted is the other pods' assignments the informers count on the node (bound pods, not
	// this process's in-flight decisions): what bind's list of the node's assignments would show
	// once the informers have caught up with the API server.
	counted map[types.UID]*api.PodAssignment
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
	b := &bindBase{inv: e.inv, labels: e.labels, holds: map[types.UID]*api.PodAssignment{}, held: map[types.UID]placement.Placement{},
		counted: map[types.UID]*api.PodAssignment{}, cpu: e.state.CPUMilli, mem: e.state.MemMiB, usedCPU: e.state.UsedCPU, usedMem: e.state.UsedMem}
	if u := s.uses[uid]; u != nil && u.node == node && u.applied {
		b.usedCPU, b.usedMem = b.usedCPU-u.cpu, b.usedMem-u.mem
	}
	for other, p := range s.podsOn[node] {
		switch {
		case other == uid && !p.reserved:
		case !p.reserved:
			b.counted[other] = p.assignment
		case other == uid:
			b.own = p.assignment
		default:
			b.holds[other] = p.assignment
		}
	}
	// The node's holdings, as applyHoldingsLocked counts them for Filter (pods this state tracks
	// are left out there, so they are not counted twice).
	for other, pl := range e.held {
		if other != uid {
			b.held[other] = pl
		}
	}
	// Allocated claims (keyed by claim UID, which no pod of the fresh list has).
	for cu, ce := range s.claimsOn[node] {
		if ce.applied {
			b.held[cu] = ce.placement
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
// entry pointer does not). The request decoder puts the lists it reads (internNames: it looks each
// name up once, for its string and its entry), so a list in an order never seen before is not
// looked up again here; kube-scheduler's parallel Filter sends its nodes in a new order each call.
type resolveCache struct {
	mu    sync.Mutex
	slots [2]resolved
	next  int
	// misses counts lists resolve had to look up itself (a test reads it).
	misses int
}

type resolved struct {
	gen     uint64
	names   []string
	entries []*nodeEntry
	// index is each entry's index in entries plus one, by node slot (0: not in the list); only
	// the request decoder's lists have it (followingNames).
	index []int32
}

// resolve returns the entries of names (nil where unknown); callers hold the State's read lock.
func (c *resolveCache) resolve(names []string, gen uint64, nodes map[string]*nodeEntry) []*nodeEntry {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := range c.slots {
		sl := &c.slots[i]
		// The names are usually the decoder's, the cached list's own strings: comparing them
		// compares pointers, not bytes.
		if sl.gen == gen && sl.entries != nil && slices.Equal(sl.names, names) {
			// The other slot goes next: pick-one's filter (every node) and prioritize (its one
			// node, a new list each pod) alternate, and the long list must stay.
			c.next = (i + 1) % len(c.slots)
			return sl.entries
		}
	}
	c.misses++
	entries := make([]*nodeEntry, len(names))
	for i, n := range names {
		entries[i] = nodes[n]
	}
	c.putLocked(resolved{gen: gen, names: slices.Clone(names), entries: entries})
	return entries
}

// longest is the longest list remembered under gen (the filter's, not prioritize's one name), the
// most recent of equals; empty when none is. Its slices do not change after put.
func (c *resolveCache) longest(gen uint64) resolved {
	c.mu.Lock()
	defer c.mu.Unlock()
	var best resolved
	for k := range len(c.slots) { // the most recent first
		sl := c.slots[(c.next+len(c.slots)-1-k)%len(c.slots)]
		if sl.gen == gen && len(sl.names) > len(best.names) {
			best = sl
		}
	}
	return best
}

// put remembers names resolved to entries under gen; r is kept (its slices must not change after:
// resolve hands them to callers outside the cache's lock).
func (c *resolveCache) put(r resolved) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.putLocked(r)
}

func (c *resolveCache) putLocked(r resolved) {
	c.slots[c.next] = r
	c.next = (c.next + 1) % len(c.slots)
}

// internNames runs f with intern, which returns the State's own string for a known node's name
// (the map lookup takes the bytes without allocating) and a new string for any other; f runs under
// one read lock (the request decoder reads thousands of names per call, wire.go) and returns the
// list it made of intern's strings, in order (nil when it gave up on the list). That list is put in
// the resolve cache with the entries the same lookups found, so the verb that reads it resolves no
// name again (one map lookup per name per call, whatever the order). most bounds how many names
// f reads: the entries are sized by it, not by the cluster (prioritize sends one name).
//
// Each name is first compared with the one that followed the previous name in the last long list
// resolved under the same node generation (followingNames): kube-scheduler's Filter walks its
// node list in order from a rotating start, in chunks, so most names follow the one before as they
// did last call, and the comparison reads that list's arrays in order where the map lookup misses
// the cache three times per name (its group, the key's bytes, the entry).
func (s *State) internNames(most int, f func(intern func(b []byte) string) []string) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	entries := make([]*nodeEntry, 0, min(most, len(s.nodes)))
	next := followingNames{last: s.resolved.longest(s.nodeGen)}
	lookups := 0
	names := f(func(b []byte) string {
		if name, e, ok := next.take(b); ok {
			entries = append(entries, e)
			return name
		}
		lookups++
		e := s.nodes[string(b)]
		entries = append(entries, e)
		next.seek(e)
		if e != nil {
			return e.name
		}
		return string(b)
	})
	s.nameLookups.Add(int64(lookups))
	if names != nil && len(names) == len(entries) {
		var index []int32
		if len(entries) > 1 { // prioritize's one name predicts nothing
			index = make([]int32, s.nodeSlots())
			for i, e := range entries {
				if e != nil && e.slot < len(index) {
					index[e.slot] = int32(i + 1)
				}
			}
		}
		s.resolved.put(resolved{gen: s.nodeGen, names: slices.Clone(names), entries: entries, index: index})
	}
}

// followingNames predicts each name of a list from the last list resolved: the name after the
// previous one there. A name that is not the one predicted is looked up in the State's map, and
// its index in the last list found by its node slot (resolved.index), so the prediction follows a
// new starting point. Where predictions keep failing (an order unlike the last list's: shuffled,
// say) it stops predicting for the rest of the list: such a list costs what it cost without them
// plus a few dozen failed comparisons.
type followingNames struct {
	last         resolved // under the current node generation; empty: no prediction
	at           int      // the index in last of the next name predicted
	hits, misses int
}

// giveUpMisses is how many failed predictions a list may have before they stop, unless most
// predictions held: kube-scheduler's parallel Filter sends its nodes as chunks in the order its
// workers finish them (at 5,000 nodes about 70 chunks of 70), each chunk in its node list's order,
// so a chunked list misses once per chunk.
const giveUpMisses = 32

// take returns the predicted name and entry when b is the name predicted.
func (p *followingNames) take(b []byte) (string, *nodeEntry, bool) {
	if p.at >= len(p.last.names) || p.last.names[p.at] != string(b) {
		return "", nil, false
	}
	name, e := p.last.names[p.at], p.last.entries[p.at]
	p.hits++
	if p.at++; p.at == len(p.last.names) {
		p.at = 0 // a rotation goes on from the list's start
	}
	return name, e, true
}

// seek predicts, after a name that was not the one predicted (its entry e, nil for an unknown
// name), the name that followed e in the last list.
func (p *followingNames) seek(e *nodeEntry) {
	n := len(p.last.names)
	if n == 0 {
		return
	}
	if p.misses++; p.misses > giveUpMisses && p.misses > p.hits {
		p.last = resolved{}
		return
	}
	p.at = n
	if e != nil && e.slot < len(p.last.index) {
		if i := int(p.last.index[e.slot]) - 1; i >= 0 && p.last.entries[i] == e {
			p.at = (i + 1) % n
		}
	}
}

// namespaceUsage is the GPU resources held (committed or reserved) by pods of a namespace.
func (s *State) namespaceUsage(ns string) map[string]int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := maps.Clone(s.nsUsage[ns])
	if out == nil {
		out = map[string]int64{}
	}
	return out
}

// countUsageLocked adds p's requestQuantities to its namespace's usage (sign 1) or takes them off
// (sign -1); resources and namespaces that come to zero are dropped, so the map holds only what
// is held.
func (s *State) countUsageLocked(p *podEntry, sign int64) {
	if p.req == nil {
		return
	}
	u := s.nsUsage[p.namespace]
	if u == nil {
		u = map[string]int64{}
		s.nsUsage[p.namespace] = u
	}
	for k, v := range requestQuantities(p.req) {
		if u[k] += sign * v; u[k] == 0 {
			delete(u, k)
		}
	}
	if len(u) == 0 {
		delete(s.nsUsage, p.namespace)
	}
}

// Conflicts is how many times the state applied a pod on a GPU that another entry held.
func (s *State) Conflicts() int64 { return s.conflicts.Load() }

// ExpiredReservations is how many pods' in-flight reservations ExpireReservations dropped: binds
// whose outcome the extender never saw within the reservation TTL.
func (s *State) ExpiredReservations() int64 { return s.expired.Load() }

// Holds reports whether the state has an entry (committed or reserved) for the pod.
func (s *State) Holds(uid types.UID) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.pods[uid] != nil
}
