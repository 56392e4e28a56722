package extender

import (
	"sync"
	"sync/atomic"

	"github.com/tessera-gpu/tessera/internal/placement"
)

// The State's change subscription: the evaluation warmer (warm.go) learns which nodes' placement
// state changed since it last looked, and re-evaluates them through viewEntries.

// changeLog lists node entries whose placement state changed (deduplicated), once a warmer reads it.
type changeLog struct {
	on      atomic.Bool
	mu      sync.Mutex
	entries []*nodeEntry
	signal  chan struct{}
	// arrivals are the requests of GPU pods first counted since the last take (pending pods: their
	// Filter call is still to come).
	arrivals []*placement.Request
}

// arrive records a pod's request when the pod is first counted, so that the warmer can give a
// shape without a table one before the pod's Filter call (callers hold the State's write lock).
func (c *changeLog) arrive(r *placement.Request) {
	if !c.on.Load() {
		return
	}
	c.mu.Lock()
	c.arrivals = append(c.arrivals, r)
	c.mu.Unlock()
	c.wake()
}

// takeArrivals returns the requests arrived since the last take and empties the list.
func (c *changeLog) takeArrivals() []*placement.Request {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := c.arrivals
	c.arrivals = nil
	return out
}

// touch records that e's placement state changed (callers hold the State's write lock).
func (c *changeLog) touch(e *nodeEntry) {
	if !c.on.Load() {
		return
	}
	c.mu.Lock()
	if !e.changed {
		e.changed = true
		c.entries = append(c.entries, e)
	}
	c.mu.Unlock()
	c.wake()
}

// wake tells the subscriber that there is something to take (once, however many wakes it missed).
func (c *changeLog) wake() {
	select {
	case c.signal <- struct{}{}:
	default:
	}
}

// start turns the log on (a State without a warmer keeps none) and returns its wake-up channel.
func (c *changeLog) start() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.signal == nil {
		c.signal = make(chan struct{}, 1)
	}
	c.on.Store(true)
	return c.signal
}

// take returns the entries changed since the last take and empties the log.
func (c *changeLog) take() []*nodeEntry {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := c.entries
	for _, e := range out {
		e.changed = false
	}
	c.entries = nil
	return out
}

// subscribeChanges turns the change log on (a State without a subscriber keeps none) and returns
// the channel that wakes the subscriber after a change; there is one subscriber (the warmer).
func (s *State) subscribeChanges() <-chan struct{} { return s.changes.start() }

// takeChanges returns the node entries changed since the last take (each once) and empties the log.
func (s *State) takeChanges() []*nodeEntry { return s.changes.take() }

// viewEntries runs f, under one read lock, on the state of each of entries that is still the
// State's and usable (one deleted since, or not offered to placement, is skipped: no outcome of
// it is read). f must not keep the states after it returns.
func (s *State) viewEntries(entries []*nodeEntry, f func(slot int, n *placement.NodeState)) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	now := s.now()
	for _, e := range entries {
		if e.deleted || s.unusable(e, now) != "" { // not s.nodes[e.name] != e: a name lookup per node and table
			continue
		}
		f(e.slot, e.state)
	}
}

// usableEntries lists the node entries placement may use now.
func (s *State) usableEntries() []*nodeEntry {
	s.mu.RLock()
	defer s.mu.RUnlock()
	now := s.now()
	out := make([]*nodeEntry, 0, len(s.nodes))
	for _, e := range s.nodes {
		if s.unusable(e, now) == "" {
			out = append(out, e)
		}
	}
	return out
}
