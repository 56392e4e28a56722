package extender

import (
	"context"
	"fmt"
	"math"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
)

// NodeLocker serialises binds onto one node across extender processes with a per-node
// coordination.k8s.io Lease used as a mutex: acquiring is a compare-and-swap on the Lease's
// resourceVersion (create, or update of a free or expired Lease), so two processes can never both
// hold it; the API server is the only shared state. Inside one process a mutex per node orders
// the callers first, so the Lease sees one contender per process.
type NodeLocker struct {
	Client    kubernetes.Interface
	Namespace string
	// Identity names this process in the Lease's holderIdentity.
	Identity string
	// Duration is how long a Lease stays valid without release (a crashed holder blocks this long).
	Duration time.Duration

	mu    sync.Mutex
	local map[string]*sync.Mutex
}

// LeaseName is the per-node bind Lease's name.
func LeaseName(node string) string { return "tessera-bind-" + node }

// NodeLock is a held node lock.
type NodeLock struct {
	l        *NodeLocker
	node     string
	lease    *coordinationv1.Lease
	acquired time.Time
	local    *sync.Mutex
}

func (l *NodeLocker) localMutex(node string) *sync.Mutex {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.local == nil {
		l.local = map[string]*sync.Mutex{}
	}
	m := l.local[node]
	if m == nil {
		m = &sync.Mutex{}
		l.local[node] = m
	}
	return m
}

// Lock acquires the node's Lease, retrying with jittered backoff until ctx ends.
func (l *NodeLocker) Lock(ctx context.Context, node string) (*NodeLock, error) {
	local := l.localMutex(node)
	local.Lock()
	leases := l.Client.CoordinationV1().Leases(l.Namespace)
	name := LeaseName(node)
	secs := int32(max(1, l.Duration/time.Second))
	backoff := lockBackoff
	for {
		now := metav1.NewMicroTime(time.Now())
		cur, err := leases.Get(ctx, name, metav1.GetOptions{})
		var got *coordinationv1.Lease
		switch {
		case apierrors.IsNotFound(err):
			got, err = leases.Create(ctx, &coordinationv1.Lease{
				ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: l.Namespace},
				Spec:       coordinationv1.LeaseSpec{HolderIdentity: &l.Identity, LeaseDurationSeconds: &secs, AcquireTime: &now, RenewTime: &now},
			}, metav1.CreateOptions{})
		case err != nil:
		case leaseFree(cur, now.Time):
			next := cur.DeepCopy() // carries cur's resourceVersion: the update is a compare-and-swap
			next.Spec.HolderIdentity, next.Spec.LeaseDurationSeconds = &l.Identity, &secs
			next.Spec.AcquireTime, next.Spec.RenewTime = &now, &now
			got, err = leases.Update(ctx, next, metav1.UpdateOptions{})
		default:
			err = errHeld
		}
		if err == nil {
			return &NodeLock{l: l, node: node, lease: got, acquired: now.Time, local: local}, nil
		}
		if !apierrors.IsConflict(err) && !apierrors.IsAlreadyExists(err) && err != errHeld {
			local.Unlock()
			return nil, fmt.Errorf("lock node %s (lease %s/%s): %w", node, l.Namespace, name, err)
		}
		select {
		case <-ctx.Done():
			local.Unlock()
			return nil, fmt.Errorf("lock node %s (lease %s/%s): %w", node, l.Namespace, name, ctx.Err())
		case <-time.After(backoff.Step()):
		}
	}
}

// lockBackoff spaces out the tries of a held Lease: small waits (a bind holds the lock for
// milliseconds) growing from 4 ms by half each time to 20 ms, each up to a quarter longer at random
// so that contenders do not retry in step (at the cap 20-25 ms, as the linear 2 ms + 3 ms per try
// + 0-5 ms spacing this replaced).
var lockBackoff = wait.Backoff{Duration: 4 * time.Millisecond, Factor: 1.5, Jitter: 0.25, Cap: 20 * time.Millisecond, Steps: math.MaxInt32}

var errHeld = fmt.Errorf("lease held by another extender")

// leaseFree reports whether a Lease has no holder or its holder let it expire.
func leaseFree(l *coordinationv1.Lease, now time.Time) bool {
	s := l.Spec
	if s.HolderIdentity == nil || *s.HolderIdentity == "" || s.RenewTime == nil || s.LeaseDurationSeconds == nil {
		return true
	}
	return now.After(s.RenewTime.Add(time.Duration(*s.LeaseDurationSeconds) * time.Second))
}

// Valid reports whether the lock is still safely held: well inside its duration, so that a
// holder delayed past it (and possibly overtaken) does not write on stale information.
func (nl *NodeLock) Valid() bool { return time.Now().Before(nl.SafeUntil()) }

// SafeUntil is when the lock stops being safely held (half its duration after acquiring: another
// process can take it only after the whole duration).
func (nl *NodeLock) SafeUntil() time.Time { return nl.acquired.Add(nl.l.Duration / 2) }

// Unlock frees the Lease (a compare-and-swap on the version we wrote; if it fails the Lease
// simply expires) and the process-local mutex.
func (nl *NodeLock) Unlock(ctx context.Context) {
	defer nl.local.Unlock()
	next := nl.lease.DeepCopy()
	empty := ""
	next.Spec.HolderIdentity = &empty
	_, _ = nl.l.Client.CoordinationV1().Leases(nl.l.Namespace).Update(ctx, next, metav1.UpdateOptions{})
}
