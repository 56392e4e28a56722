package extender

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	k8stesting "k8s.io/client-go/testing"
)

// TestNodeLockRetrySchedule pins Lock's retries of a held Lease on a synctest bubble's clock: the
// Lease is read at once, then after waits growing from 4 ms to 20 ms (each up to a quarter longer)
// and staying there; an expired Lease is taken at the next try; the context's end ends the wait at
// once with its error and frees the node's local locks; an API error other than held or a lost
// compare-and-swap is returned from the first try.
func TestNodeLockRetrySchedule(t *testing.T) { synctest.Test(t, nodeLockRetrySchedule) }

func nodeLockRetrySchedule(t *testing.T) {
	cs, _ := fakeAPI(t)
	var gets atomic.Int64 // synctest.Wait orders nothing for the race detector
	cs.PrependReactor("get", "leases", func(a k8stesting.Action) (bool, runtime.Object, error) {
		gets.Add(1)
		if a.(k8stesting.GetAction).GetName() == LeaseName("forbidden") {
			return true, nil, apierrors.NewForbidden(schema.GroupResource{Group: "coordination.k8s.io", Resource: "leases"}, LeaseName("forbidden"), errors.New("RBAC"))
		}
		return false, nil, nil
	})
	other := &NodeLocker{Client: cs, Namespace: "kube-system", Identity: "other", Duration: 15 * time.Second}
	l := &NodeLocker{Client: cs, Namespace: "kube-system", Identity: "a", Duration: 15 * time.Second}
	ctx := context.Background()
	for _, node := range []string{"n1", "n2"} {
		if _, err := other.Lock(ctx, node); err != nil { // held, never renewed
			t.Fatal(err)
		}
	}
	type locked struct {
		nl  *NodeLock
		err error
	}
	lock := func(ctx context.Context, node string) <-chan locked {
		out := make(chan locked, 1)
		go func() {
			nl, err := l.Lock(ctx, node)
			out <- locked{nl, err}
		}()
		return out
	}
	tries := func(when string, lo, hi int64) {
		t.Helper()
		synctest.Wait()
		if n := gets.Load(); n < lo || n > hi {
			t.Fatalf("%s: the Lease read %d times, want %d to %d", when, n, lo, hi)
		}
	}

	gets.Store(0)
	got := lock(ctx, "n1")
	tries("at once", 1, 1)
	time.Sleep(3 * time.Millisecond)
	tries("3 ms in", 1, 1)
	// Waits 4-5, 6-7.5, 9-11.25, 13.5-16.9, then 20-25 ms: tries at 0 and by 100 ms 6 or 7 more.
	time.Sleep(97 * time.Millisecond)
	tries("100 ms in", 7, 8)
	// At the 20-25 ms cap: 1 s in, 43 to 53 tries.
	time.Sleep(900 * time.Millisecond)
	tries("1 s in", 43, 53)
	select {
	case r := <-got:
		t.Fatalf("took a Lease held and not expired: %v", r.err)
	default:
	}
	// The Lease unchanged for longer than its 15 s: expired, taken at the next try.
	time.Sleep(15 * time.Second)
	synctest.Wait()
	select {
	case r := <-got:
		if r.err != nil {
			t.Fatal(r.err)
		}
		r.nl.Unlock(ctx)
	default:
		t.Fatal("an expired Lease not taken")
	}

	// The context's end: returned at once with its error, the node's locks free.
	cctx, cancel := context.WithCancel(ctx)
	got = lock(cctx, "n2")
	time.Sleep(50 * time.Millisecond)
	cancel()
	synctest.Wait()
	select {
	case r := <-got:
		if !errors.Is(r.err, context.Canceled) || r.nl != nil {
			t.Fatalf("Lock after its context ended: %v, want context.Canceled", r.err)
		}
	default:
		t.Fatal("Lock still waiting after its context ended")
	}
	if !l.localMutex("n2").TryLock() || !l.useMutex("n2").TryLock() {
		t.Fatal("the node's local locks still held after Lock gave up")
	}

	// An error retrying does not cure: returned from the first try.
	gets.Store(0)
	got = lock(ctx, "forbidden")
	synctest.Wait()
	select {
	case r := <-got:
		if !apierrors.IsForbidden(r.err) {
			t.Fatalf("Lock on a forbidden Lease: %v, want the API server's Forbidden", r.err)
		}
	default:
		t.Fatal("Lock retries a forbidden Lease")
	}
	tries("forbidden", 1, 1)
}
