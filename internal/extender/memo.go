package extender

import (
	"sync"
	"sync/atomic"

	"github.com/tessera-gpu/tessera/internal/placement"
)

// evalMemo remembers, per request digest and node, the outcome of evaluating the request on the
// node: valid while the node is the same state object at the same version and the typical-shape
// snapshot is the same. Between two pods of one shape the scheduler sends the same nodes again and
// only the few that changed (the last binds, pod deletions) are evaluated again; a scheduling queue
// cycles through far fewer shapes than it has pods (126 request shapes among 8,152 GPU pods in the
// openb trace), so most Filter calls cost a lookup per node instead of an evaluation.
//
// Memory is bounded: at most evalMemoBudget bytes of tables (a table holds one slot per node), the
// least recently used request's table goes first, and every table goes when the snapshot changes.
type evalMemo struct {
	mu       sync.Mutex
	snapshot *placement.FragCache
	tables   map[string]*evalTable
	tick     uint64
	// remembered and evaluated count node outcomes taken from the memo and computed afresh.
	remembered, evaluated atomic.Int64
}

// evalMemoBudget bounds the memo: one table of a 5,000-node cluster is about 5000 x (8 + 48) bytes,
// so 64 MiB keep about 240 request shapes (the openb default trace has 126).
const evalMemoBudget = 64 << 20

// evalSlotBytes is what one node slot of a table costs: the pointer plus the outcome it points to.
const evalSlotBytes = 8 + 48

type evalTable struct {
	used  atomic.Uint64
	slots []atomic.Pointer[evalOutcome]
}

// evalOutcome is one node's outcome for the table's request: the policy score and the newest GPU
// generation of the best placement, or why the request does not fit (explained: u has its message).
type evalOutcome struct {
	state     *placement.NodeState
	version   uint64
	score     float64
	gen       float64
	u         *placement.Unfit
	explained bool
}

// table returns the request's table under snapshot, sized for node slots 0..slots-1; a new
// snapshot drops every table (outcomes depend on every typical shape's weight).
func (m *evalMemo) table(snapshot *placement.FragCache, digest string, slots int) *evalTable {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.snapshot != snapshot || m.tables == nil {
		m.snapshot, m.tables = snapshot, map[string]*evalTable{}
	}
	m.tick++
	t := m.tables[digest]
	if t == nil || len(t.slots) < slots {
		// A table holds every node slot there is; a node added since gets a new, larger table.
		maxTables := max(4, evalMemoBudget/(evalSlotBytes*max(slots, 1)))
		for len(m.tables) >= maxTables {
			m.evictOldest()
		}
		t = &evalTable{slots: make([]atomic.Pointer[evalOutcome], slots+slots/8+8)}
		m.tables[digest] = t
	}
	t.used.Store(m.tick)
	return t
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

// lookup returns the remembered outcome of node slot for n in its current version (with the Unfit
// message when explain is set), or nil.
func (t *evalTable) lookup(slot int, n *placement.NodeState, explain bool) *evalOutcome {
	if t == nil || slot < 0 || slot >= len(t.slots) {
		return nil
	}
	o := t.slots[slot].Load()
	if o == nil || o.state != n || o.version != n.Version() || (explain && o.u != nil && !o.explained) {
		return nil
	}
	return o
}

// store remembers an outcome (its state and version are those the evaluation read).
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
	m.tables = nil
}
