package placement

import (
	"cmp"
	"math"
	"slices"
	"sync"
	"sync/atomic"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// evalMemo is an Evaluator's memory. It remembers, per request digest and node, the outcome of evaluating the request on the
// node: valid while the node is the same state object with the same usage (its usage digest) and the typical-shape
// snapshot is the same. Between two pods of one shape the scheduler sends the same nodes again and
// only the few that changed (the last binds, pod deletions) are evaluated again; a scheduling queue
// cycles through far fewer shapes than it has pods (126 request shapes among 8,152 GPU pods in the
// openb trace), so most Filter calls cost a lookup per node instead of an evaluation.
//
// Memory is bounded: at most evalMemoBudget bytes of tables (a table holds one slot per node), the
// least recently used request's table goes first, and every table goes when the snapshot changes.
// A staged snapshot (ShapeStats.StageSnapshots) has tables of its own, next, which the
// warmer fills for the most recently used requests before the snapshot serves (StagedTables, Warm;
// the extender's warm.go).
type evalMemo struct {
	mu       sync.Mutex
	snapshot *FragCache
	version  uint64 // the snapshot's number (ScoreContext.Snapshot)
	tables   map[string]*evalTable
	next     nextTables
	tick     uint64
	// pending are the requests of the tables the last snapshot change dropped, for the warmer to
	// fill under the new snapshot (WarmTables).
	pending []pendingRequest
	// bounds are the node states' bound data under the serving snapshot (pick-one Filter).
	bounds *nodeBounds
	// remembered and evaluated count node outcomes calls took from the memo and computed afresh
	// (Evaluation.Exact, Bound); bounded the nodes pick-one Filter bounded instead of evaluating
	// them; warmed those the warmer computed (Warm).
	remembered, evaluated, bounded, warmed atomic.Int64
	// boundData counts the node bound data computed (NodeBound: once per node state and
	// snapshot, whoever asks first: a call or the warmer).
	boundData atomic.Int64
	// twinned counts what was taken from a twin (twinKey) instead of computed.
	twinned atomic.Int64
}

// nextTables are the tables of a staged snapshot (by digest) and its node bounds.
type nextTables struct {
	snapshot *FragCache
	version  uint64
	tables   map[string]*evalTable
	bounds   *nodeBounds
}

type pendingRequest struct {
	req  *Request
	used uint64
}

// evalMemoBudget bounds the memo: one table of a 5,000-node cluster is about 5000 x evalSlotBytes
// (76) bytes, so 64 MiB keep about 176 request shapes (the openb default trace has 126).
const evalMemoBudget = 64 << 20

// evalSlotBytes is what one node slot of a table costs: the pointer plus the outcome it points to,
// the bound word, and its part of the table's twins (at most one entry of about 96 bytes, map
// overhead included, per twinShare slots).
const evalSlotBytes = 8 + 8 + 48 + 96/twinShare

// twinShare bounds a table's twins to one entry per twinShare node slots: on a cluster whose nodes
// are all in states of their own, twins only cost (an entry per node and table), and where states
// repeat, the repeated ones (empty nodes of a class) are met early and kept.
const twinShare = 8

type evalTable struct {
	used  atomic.Uint64
	slots []atomic.Pointer[evalOutcome]
	// req is the request the table was made for (every request with its digest evaluates alike).
	req *Request
	// bounds are the memo's node bounds under the table's snapshot (shared by every table);
	// boundWords the request's score bound per node slot where it was bounded and not evaluated:
	// the bound (wordOfBound: rounded up, within 1.3e-10) and the generation of the node's bound data it was computed
	// from (nodeBoundSlot.gen; valid while that is the slot's current, valid data). A word, not an
	// outcome: pick-one bounds nearly every node of every shape it meets, and an allocation per node
	// made garbage collection the tail of a never-seen shape's call.
	bounds     atomic.Pointer[nodeBounds] // set under the memo's lock, read by calls in flight
	boundWords []atomic.Uint64
	twins      twins[twin]
}

// twinKey names a node state by what placement reads of it: its hardware class (TypeID: the
// TypeKey, everything static that placement and scoring read) and its usage digest (everything in
// use). Two nodes with equal keys evaluate alike for every request under one snapshot, whatever
// their names, so the first one's outcome, bound and bound data serve the others (a cluster's empty
// nodes of one hardware class, or its full ones, are one evaluation, not thousands); the usage
// digest's collision odds (about 2^-64, keyed per process) are the memo's own.
type twinKey struct {
	typeID int
	usage  uint64
}

// twinKeyOf is n's twinKey at usage; false where n has no hardware class or untracked usage.
func twinKeyOf(n *NodeState, usage uint64) (twinKey, bool) {
	return twinKey{n.TypeID, usage}, n.TypeID != 0 && n.tracked
}

// twins maps node states by content (twinKey) to what was computed for the first of them: a
// table's outcomes and bounds (twin), or a snapshot's node bound data (*NodeBound). At most one
// entry per distinct node state, dropped with the table or bounds that hold it. The map is keyed by
// a word mixed from the key (a uint64 key is the map's fast path: a filter call asks once per node)
// and each entry keeps its whole key, so two keys that mix alike never share an entry.
type twins[V any] struct {
	mu    sync.Mutex
	m     map[uint64]twinEntry[V]
	limit int // the most entries kept (0: no limit)
}

type twinEntry[V any] struct {
	k twinKey
	v V
}

func (k twinKey) word() uint64 { return k.usage ^ mix64(uint64(k.typeID)) }

func (t *twins[V]) get(k twinKey) (v V, ok bool) {
	t.mu.Lock()
	e, ok := t.m[k.word()]
	t.mu.Unlock()
	if !ok || e.k != k {
		return v, false
	}
	return e.v, true
}

// put keeps v for k where better (nil: keep any) says it improves on what is kept; an entry of
// another key on the same word stays.
func (t *twins[V]) put(k twinKey, v V, better func(old V) bool) {
	t.mu.Lock()
	if t.m == nil {
		t.m = map[uint64]twinEntry[V]{}
	}
	old, ok := t.m[k.word()]
	if !ok && (t.limit == 0 || len(t.m) < t.limit) || ok && old.k == k && better != nil && better(old.v) {
		t.m[k.word()] = twinEntry[V]{k, v}
	}
	t.mu.Unlock()
}

// twin is what a table knows of one node state: its outcome (exact, or why the request does not
// fit), else an upper bound of its score (b, of kind ScoreBound; kind ScoreExact: none).
type twin struct {
	o    *evalOutcome
	b    float64
	kind ScoreKind
}

// rank orders what a twin knows: an outcome, then a bound.
func (tw twin) rank() int {
	switch {
	case tw.o != nil:
		return 2
	case tw.kind == ScoreBound:
		return 1
	}
	return 0
}

// twin returns what t knows of the node state k (the zero twin: nothing).
func (t *evalTable) twin(k twinKey, ok bool) twin {
	if t == nil || !ok {
		return twin{}
	}
	tw, _ := t.twins.get(k)
	return tw
}

// putTwin keeps tw for the node state k where it knows more than what is kept.
func (t *evalTable) putTwin(k twinKey, ok bool, tw twin) {
	if t == nil || !ok {
		return
	}
	t.twins.put(k, tw, func(old twin) bool { return tw.rank() > old.rank() })
}

// nodeBounds keep each node state's NodeBound under one snapshot, by node slot: what a
// score bound reads of a node is the same for every request shape, so a shape never seen bounds
// the nodes at the cost of a few operations each (valid while the node is the same state object
// with the same usage digest, as outcomes are). About 5,000 x 200 bytes; not counted in the budget.
type nodeBounds struct {
	slots []atomic.Pointer[nodeBoundSlot]
	gens  atomic.Uint32
	twins twins[*NodeBound]
}

// twin returns the bound data kept for the node state k (nil: none; b may be nil).
func (b *nodeBounds) twin(k twinKey, ok bool) *NodeBound {
	if b == nil || !ok {
		return nil
	}
	nb, _ := b.twins.get(k)
	return nb
}

// putTwin keeps nb for the node state k (the first kept stays: all are alike).
func (b *nodeBounds) putTwin(k twinKey, ok bool, nb *NodeBound) {
	if b == nil || !ok || nb == nil {
		return
	}
	b.twins.put(k, nb, nil)
}

type nodeBoundSlot struct {
	state *NodeState
	usage uint64
	nb    *NodeBound
	gen   uint32 // unique per put (from 1): what a table's bound word refers to
}

// sized returns b, or new empty node bounds where b is nil or has fewer than slots slots.
func sized(b *nodeBounds, slots int) *nodeBounds {
	if b == nil || len(b.slots) < slots {
		return &nodeBounds{slots: make([]atomic.Pointer[nodeBoundSlot], slots+slots/8+8)}
	}
	return b
}

// get returns the kept bound data of node slot for n with usage (nil: none; b may be nil).
func (b *nodeBounds) get(slot int, n *NodeState, usage uint64) *nodeBoundSlot {
	if b == nil || slot < 0 || slot >= len(b.slots) {
		return nil
	}
	if s := b.slots[slot].Load(); s != nil && s.state == n && s.usage == usage {
		return s
	}
	return nil
}

// put keeps nb for node slot (n with usage) and returns the kept slot (nil where none is kept).
func (b *nodeBounds) put(slot int, n *NodeState, usage uint64, nb *NodeBound) *nodeBoundSlot {
	if b == nil || slot < 0 || slot >= len(b.slots) {
		return nil
	}
	s := &nodeBoundSlot{state: n, usage: usage, nb: nb, gen: b.gens.Add(1)}
	b.slots[slot].Store(s)
	return s
}

// bound returns the request's remembered bound of node slot computed from nb's data, and its kind
// (ScoreBound or ScoreCoarse).
func (t *evalTable) bound(slot int, nb *nodeBoundSlot) (float64, ScoreKind, bool) {
	if t == nil || nb == nil || slot < 0 || slot >= len(t.boundWords) {
		return 0, 0, false
	}
	w := t.boundWords[slot].Load()
	if uint32(w>>32)&^coarseWord != nb.gen&^coarseWord {
		return 0, 0, false
	}
	kind := ScoreBound
	if uint32(w>>32)&coarseWord != 0 {
		kind = ScoreCoarse
	}
	return boundOfWord(uint32(w)), kind, true
}

// A bound word's value half: the bound's ceiling I (the top byte: 0 is -Inf, 255 +Inf, c is
// I = c-2 for -1..250) and how far below I the bound is, in units of 1/boundDenom (the low 24 bits,
// at most boundFracMax). A score is an integer less a tie-break of at most 1e-3 (k·1e-6/(GPUs
// placed)), so its bound reads back within 2/boundDenom (1.3e-10) above it, below ScoreEpsilon: a
// node whose bound equals the leader's score ties it, and refineBounds skips it where the tie goes
// to the leader by name. A float32 rounded up read 44.99981 back as 44.9998131, which beat every
// such tie: on the live benchmark's 4,852 nodes (mostly in a few states) a shape whose bounds were
// remembered then evaluated every node (~3 ms of a call). A bound more than 1e-3 below its
// ceiling (no score is) reads back as ceiling - 1e-3: still an upper bound.
const (
	boundDenom   = 16e9
	boundFracMax = 16_000_000 // 1e-3 * boundDenom, below 1<<24
	boundInfCode = 255
)

// wordOfBound is b's value half, never read back below b (an upper bound stays one).
func wordOfBound(b float64) uint32 {
	switch {
	case math.IsInf(b, -1):
		return 0
	case math.IsNaN(b) || b > boundInfCode-5:
		return boundInfCode << 24
	case b < -1:
		return 1 << 24 // ceiling -1
	}
	c := math.Ceil(b)
	// One unit more than the floor: what rounding in the product and the read's division can take
	// is far below a unit (1/boundDenom), so the read stays above b.
	num := uint32(max(math.Floor((c-b)*boundDenom)-1, 0))
	return uint32(c+2)<<24 | min(num, boundFracMax)
}

// boundOfWord reads a value half back (wordOfBound).
func boundOfWord(w uint32) float64 {
	switch c := w >> 24; c {
	case 0:
		return math.Inf(-1)
	case boundInfCode:
		return math.Inf(1)
	default:
		return float64(int(c)-2) - float64(w&(1<<24-1))/boundDenom
	}
}

// coarseWord marks a bound word's coarse bound (in its generation half: generations are unique in
// their lower 31 bits, for the first 2^31 node bound data kept under one snapshot).
const coarseWord = 1 << 31

// storeBound remembers the request's bound b of node slot (of kind ScoreBound or ScoreCoarse),
// computed from nb's data.
func (t *evalTable) storeBound(slot int, nb *nodeBoundSlot, b float64, kind ScoreKind) {
	if t == nil || nb == nil || slot < 0 || slot >= len(t.boundWords) {
		return
	}
	gen := nb.gen &^ coarseWord
	if kind == ScoreCoarse {
		gen |= coarseWord
	}
	t.boundWords[slot].Store(uint64(gen)<<32 | uint64(wordOfBound(b)))
}

// evalOutcome is one node's outcome for the table's request: the policy score and the newest GPU
// generation of the best placement, or why the request does not fit (explained: u has its message).
type evalOutcome struct {
	state     *NodeState
	usage     uint64 // the node's usage digest the evaluation read (NodeState.UsageDigest)
	score     float64
	gen       float64
	u         *Unfit
	explained bool
}

// outcome is o as an exact Outcome.
func (o *evalOutcome) outcome() Outcome {
	return Outcome{Score: o.score, Gen: o.gen, Unfit: o.u}
}

// table returns the request's table under snapshot, sized for node slots 0..slots-1; a new
// snapshot drops every table (outcomes depend on every typical shape's weight).
func (m *evalMemo) table(sc *ScoreContext, digest string, req *Request, slots int) *evalTable {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.switchLocked(sc) {
		return nil // a call that read the snapshot before the one the memo holds: not remembered
	}
	m.tick++
	t := m.tables[digest]
	if t == nil || len(t.slots) < slots {
		// A table holds every node slot there is; a node added since gets a new, larger table.
		t = m.newTableLocked(digest, req, slots)
	}
	m.bounds = sized(m.bounds, slots)
	t.bounds.Store(m.bounds)
	t.used.Store(m.tick)
	return t
}

// switchLocked moves the memo to sc's snapshot if it is not there yet: to the tables filled for it
// while it was staged, or to none, and then the requests of the tables left behind become pending
// (most recently used first) for the warmer. False when sc's snapshot is older than the memo's (a
// concurrent call already moved on): never move back.
func (m *evalMemo) switchLocked(sc *ScoreContext) bool {
	if m.snapshot != nil && sc.Snapshot < m.version {
		return false
	}
	snapshot := sc.Cache
	if m.snapshot == snapshot && m.tables != nil {
		return true
	}
	tables, staged := map[string]*evalTable{}, m.next.snapshot == snapshot && m.next.tables != nil
	var bounds *nodeBounds
	if staged {
		// Filled while staged for the requests used most.
		tables, bounds = m.next.tables, m.next.bounds
	}
	if m.snapshot != snapshot {
		m.pending = m.leftBehindLocked(tables)
	}
	m.snapshot, m.version, m.tables, m.bounds = snapshot, sc.Snapshot, tables, bounds
	if m.next.version <= sc.Snapshot {
		m.next = nextTables{}
	}
	return true
}

// leftBehindLocked returns the requests of the serving tables and of those still pending that have
// no table in next (the snapshot the memo moves to), most recently used first, each once: the
// warmer gives them tables under next after the move (warmTables). A table the staged snapshot did
// not get (past the warmer's staging limit) is refilled then instead of emptied until its shape's
// next pod, whose call would bound or evaluate every node (about 2 ms at 4,852 nodes live, ~290
// calls a run of 1,500 pods with 177 snapshot promotions and 93 shapes against 32 staged).
func (m *evalMemo) leftBehindLocked(next map[string]*evalTable) []pendingRequest {
	left := make([]pendingRequest, 0, len(m.tables)+len(m.pending))
	seen := make(map[string]bool, len(m.tables)+len(m.pending))
	add := func(req *Request, used uint64) {
		if d := req.Digest(); next[d] == nil && !seen[d] {
			seen[d] = true
			left = append(left, pendingRequest{req, used})
		}
	}
	for _, t := range m.tables {
		add(t.req, t.used.Load())
	}
	for _, p := range m.pending {
		add(p.req, p.used)
	}
	slices.SortFunc(left, func(a, b pendingRequest) int { return cmp.Compare(b.used, a.used) })
	return left
}

// stagedTables returns tables under the staged snapshot sc for the warmer to fill for every node:
// one for each of the limit most recently used requests of the serving snapshot (nil when sc is
// not newer than the serving snapshot).
func (m *evalMemo) stagedTables(sc *ScoreContext, slots, limit int) []WarmTable {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.snapshot == nil || sc.Snapshot <= m.version {
		return nil
	}
	if m.next.snapshot != sc.Cache {
		m.next = nextTables{snapshot: sc.Cache, version: sc.Snapshot, tables: map[string]*evalTable{}}
	}
	m.next.bounds = sized(m.next.bounds, slots)
	type used struct {
		digest string
		t      *evalTable
		at     uint64
	}
	var recent []used
	for d, t := range m.tables {
		recent = append(recent, used{d, t, t.used.Load()})
	}
	slices.SortFunc(recent, func(a, b used) int { return cmp.Compare(b.at, a.at) })
	var out []WarmTable
	for _, u := range recent[:min(limit, len(recent))] {
		t := m.next.tables[u.digest]
		if t == nil || len(t.slots) < slots {
			t = newEvalTable(u.t.req, slots)
			m.next.tables[u.digest] = t
		}
		t.bounds.Store(m.next.bounds)
		t.used.Store(u.at)
		out = append(out, WarmTable{t, u.t.req})
	}
	return out
}

func (m *evalMemo) newTableLocked(digest string, req *Request, slots int) *evalTable {
	maxTables := max(4, evalMemoBudget/(evalSlotBytes*max(slots, 1)))
	for len(m.tables) >= maxTables {
		m.evictOldest()
	}
	t := newEvalTable(req, slots)
	m.tables[digest] = t
	return t
}

// newEvalTable is an empty table for req with room for node slots 0..slots-1 and some to spare
// (nodes added later).
func newEvalTable(req *Request, slots int) *evalTable {
	n := slots + slots/8 + 8
	t := &evalTable{slots: make([]atomic.Pointer[evalOutcome], n), boundWords: make([]atomic.Uint64, n), req: req}
	t.twins.limit = n/twinShare + 1
	return t
}

// warmTables returns the tables under snapshot for the warmer, most recently used first: every
// table in use, and fresh ones made for (at most freshLimit of) the requests a snapshot change left
// pending, to be filled for every node.
func (m *evalMemo) warmTables(sc *ScoreContext, slots, freshLimit int) (tables, fresh []WarmTable) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.tables == nil && len(m.pending) == 0 || !m.switchLocked(sc) {
		return nil, nil // nothing asked yet (or reset), or sc is older than the memo's snapshot
	}
	made := map[*evalTable]bool{}
	// The memo keeps tables filled for freshLimit requests at most: those filled while staged count.
	for _, p := range m.pending[:min(max(freshLimit-len(m.tables), 0), len(m.pending))] {
		d := p.req.Digest()
		if t := m.tables[d]; t == nil || len(t.slots) < slots {
			t = m.newTableLocked(d, p.req, slots)
			t.used.Store(p.used)
			made[t] = true
			fresh = append(fresh, WarmTable{t, p.req})
		}
	}
	m.pending = nil
	m.bounds = sized(m.bounds, slots)
	for _, t := range m.tables {
		t.bounds.Store(m.bounds) // made here, or earlier for fewer slots
		if !made[t] {
			tables = append(tables, WarmTable{t, t.req})
		}
	}
	slices.SortFunc(tables, func(a, b WarmTable) int { return cmp.Compare(b.t.used.Load(), a.t.used.Load()) })
	return tables, fresh
}

// expect is Evaluator.Expect.
func (m *evalMemo) expect(e *Engine, sc *ScoreContext, slots int, reqs []*Request) []WarmTable {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.switchLocked(sc) {
		return nil
	}
	var fresh []WarmTable
	for _, r := range reqs {
		d := r.Digest()
		if t := m.tables[d]; t != nil && len(t.slots) >= slots || e.PolicyFor(r).Name() == api.PolicyRandom {
			continue
		}
		m.tick++
		t := m.newTableLocked(d, r, slots)
		t.used.Store(m.tick)
		fresh = append(fresh, WarmTable{t, r})
	}
	m.bounds = sized(m.bounds, slots)
	for _, wt := range fresh {
		wt.t.bounds.Store(m.bounds)
	}
	return fresh
}

func (m *evalMemo) evictOldest() {
	var oldest string
	var at uint64
	first := true
	for d, t := range m.tables {
		if u := t.used.Load(); first || u < at {
			oldest, at, first = d, u, false
		}
	}
	delete(m.tables, oldest)
}

// lookup returns the remembered outcome of node slot for n with its current usage (with the Unfit
// message when explain is set), or nil.
func (t *evalTable) lookup(slot int, n *NodeState, explain bool) *evalOutcome {
	if t == nil || slot < 0 || slot >= len(t.slots) {
		return nil
	}
	o := t.slots[slot].Load()
	if o == nil || o.state != n || o.usage != n.UsageDigest() || (explain && o.u != nil && !o.explained) {
		return nil
	}
	return o
}

// store remembers an outcome (its state and usage are those the evaluation read).
func (t *evalTable) store(slot int, o *evalOutcome) {
	if t == nil || slot < 0 || slot >= len(t.slots) {
		return
	}
	t.slots[slot].Store(o)
}

// reset forgets every remembered outcome (benchmarks of the evaluation itself).
func (m *evalMemo) reset() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.snapshot, m.version, m.tables, m.pending, m.next, m.bounds = nil, 0, nil, nil, nextTables{}, nil
}
