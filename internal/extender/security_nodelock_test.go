package extender

import (
	"context"
	"sync"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
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
	try := func(when string) *NodeLock { t.Helper(); return tryLock(t, ctx, b, "n1", when) }
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

// TestNodeLockObservedBeforeLeading: replica a binds on n1 and keeps the node's Lease (Keep), then
// dies holding it. Replica b watched the bind Leases all along (WireLeaseObserver), so the time the
// Lease went unchanged counts from when b's watch saw it, not from b's first Lock of n1: once b's
// clock has passed the Lease's duration since that sighting, b's first Lock takes it at once (before
// the watch, b waited a whole duration more from its first Lock: 35 s from a leader's kill to the
// next bind with 15 s Leases). It never takes it earlier, and a record that changes (a renewed it)
// starts the observation over. Mutations: Observe doing nothing fails it (the watch's sighting
// never arrives); an observation counted from the record's renewTime instead of this process's
// sighting fails the 14 s step.
func TestNodeLockObservedBeforeLeading(t *testing.T) {
	cs, _ := fakeAPI(t)
	base := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	ca, cb := &skewedClock{t: base}, &skewedClock{t: base}
	a := &NodeLocker{Client: cs, Namespace: "kube-system", Identity: "a", Duration: 15 * time.Second, Keep: true, now: ca.now}
	b := &NodeLocker{Client: cs, Namespace: "kube-system", Identity: "b", Duration: 15 * time.Second, now: cb.now}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	f := informers.NewSharedInformerFactoryWithOptions(cs, 0, informers.WithNamespace("kube-system"))
	if err := WireLeaseObserver(f, b); err != nil {
		t.Fatal(err)
	}
	f.Start(ctx.Done())
	sighted := func() (leaseObservation, bool) {
		b.mu.Lock()
		defer b.mu.Unlock()
		o, ok := b.observed["n1"]
		return o, ok
	}
	waitSighting := func(version string) {
		t.Helper()
		if err := wait.PollUntilContextTimeout(ctx, 5*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
			o, ok := sighted()
			return ok && o.version == version, nil
		}); err != nil {
			o, _ := sighted()
			t.Fatalf("b's watch never saw version %s of a's Lease (last sighting %+v)", version, o)
		}
	}
	held, err := a.Lock(ctx, "n1")
	if err != nil {
		t.Fatal(err)
	}
	held.Unlock(ctx) // kept: a still holds the Lease
	waitSighting(held.lease.ResourceVersion)
	try := func(when string) *NodeLock { t.Helper(); return tryLock(t, ctx, b, "n1", when) }
	// a renews its kept Lease once (a bind a quarter of the duration later): a new record.
	ca.advance(4 * time.Second)
	cb.advance(4 * time.Second)
	if held, err = a.Lock(ctx, "n1"); err != nil {
		t.Fatal(err)
	}
	held.Unlock(ctx)
	waitSighting(held.lease.ResourceVersion)
	// a dies. 14 s of b's clock after the renewal was seen: still a's.
	cb.advance(14 * time.Second)
	if nl := try("14 s after the sighting"); nl != nil {
		t.Fatal("b took a's kept Lease 14 s after seeing its last renewal (less than its 15 s): the watch made the Lease expire early")
	}
	cb.advance(2 * time.Second)
	nl := try("16 s after the sighting")
	if nl == nil {
		t.Fatal("b did not take a's Lease at its first Lock 16 s after its watch saw the last renewal: the observation did not count from the watch's sighting")
	}
	nl.Unlock(ctx)
}

// tryLock tries l.Lock(node) for 100 ms: the lock if taken, nil if the Lease stayed held; any other
// error fails the test, naming when.
func tryLock(t *testing.T, ctx context.Context, l *NodeLocker, node, when string) *NodeLock {
	t.Helper()
	tctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	nl, err := l.Lock(tctx, node)
	if err == nil {
		return nl
	}
	if tctx.Err() == nil {
		t.Fatalf("%s: %v", when, err)
	}
	return nil
}
