package extender

import (
	"context"
	"sync"
	"testing"
	"time"
)

// skewedClock is a process's clock in a test: base plus what the test advanced it by.
type skewedClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *skewedClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *skewedClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// TestSecurityNodeLockClockSkew: a node's bind Lease held by replica a, whose clock runs 16 s
// behind b's (so a's renewTime is 16 s "in the past" for b: more than the 15 s Lease), is not
// taken by b until b has observed the same record for the Lease's duration on its own clock; a
// record that changes (a released and took the lock again) starts the observation over. Before
// (renewTime compared with the local clock) b took it at once (issue 30).
func TestSecurityNodeLockClockSkew(t *testing.T) {
	cs, _ := fakeAPI(t)
	base := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	ca, cb := &skewedClock{t: base.Add(-16 * time.Second)}, &skewedClock{t: base}
	a := &NodeLocker{Client: cs, Namespace: "kube-system", Identity: "a", Duration: 15 * time.Second, now: ca.now}
	b := &NodeLocker{Client: cs, Namespace: "kube-system", Identity: "b", Duration: 15 * time.Second, now: cb.now}
	ctx := context.Background()
	held, err := a.Lock(ctx, "n1")
	if err != nil {
		t.Fatal(err)
	}
	if want := base.Add(-16 * time.Second).Add(7500 * time.Millisecond); !held.SafeUntil().Equal(want) {
		t.Fatalf("a's SafeUntil %v, want %v (half the duration after acquiring, on a's clock)", held.SafeUntil(), want)
	}
	try := func(when string) *NodeLock {
		t.Helper()
		tctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		nl, err := b.Lock(tctx, "n1")
		if err == nil {
			return nl
		}
		if tctx.Err() == nil {
			t.Fatalf("%s: %v", when, err)
		}
		return nil
	}
	if nl := try("at once"); nl != nil {
		t.Fatal("b took the Lease a holds at once: a renewTime 16 s behind b's clock was taken as expired")
	}
	cb.advance(10 * time.Second)
	if nl := try("after 10 s"); nl != nil {
		t.Fatal("b took the Lease a holds after observing it unchanged for 10 s (less than its 15 s)")
	}
	// a releases and takes the lock again: a new record (resourceVersion), which b observes from
	// its next look on.
	held.Unlock(ctx)
	if held, err = a.Lock(ctx, "n1"); err != nil {
		t.Fatal(err)
	}
	if nl := try("a's new record"); nl != nil {
		t.Fatal("b took the Lease a took again: 10 s of observing the old record counted for the new one")
	}
	cb.advance(10 * time.Second)
	if nl := try("10 s after seeing the new record"); nl != nil {
		t.Fatal("b took the Lease after observing a's new record for 10 s: the observation did not start over when the record changed")
	}
	cb.advance(6 * time.Second)
	nl := try("16 s after seeing the new record")
	if nl == nil {
		t.Fatal("b never took the Lease a left unrenewed for 16 s of b's clock")
	}
	// a's own lock was valid for half the duration on a's clock, and not after.
	ca.advance(7 * time.Second)
	if !held.Valid() {
		t.Fatal("a's lock stopped being valid before SafeUntil")
	}
	ca.advance(time.Second)
	if held.Valid() {
		t.Fatal("a's lock is still valid past SafeUntil")
	}
	nl.Unlock(ctx)
	// A released Lease is free at once.
	if nl := try("released"); nl == nil {
		t.Fatal("b could not take a released Lease")
	} else {
		nl.Unlock(ctx)
	}
}
