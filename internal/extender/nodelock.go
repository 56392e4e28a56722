package extender

import (
	"context"
	"fmt"
	"math"
	"strings"
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
//
// A held Lease expires by observation, as client-go's leader election times it: only once this
// process has seen the same holder, renewTime and resourceVersion for longer than the Lease's
// duration on its own (monotonic) clock. The holder's renewTime is written on the holder's clock,
// so comparing it with the local clock would let a replica whose clock runs ahead (16 s of skew
// against a 15 s Lease) take a Lease its holder still uses.
type NodeLocker struct {
	Client    kubernetes.Interface
	Namespace string
	// Identity names this process in the Lease's holderIdentity.
	Identity string
	// Duration is how long a Lease stays valid without release (a crashed holder blocks this long).
	Duration time.Duration
	// Keep leaves a node's Lease held after a bind instead of freeing it: the next bind on the node
	// takes it back without an API call while it is young (see reuseFor), or renews it with one
	// compare-and-swap, instead of a read, a write and a release (three of a bind's round trips).
	// Only the leader binds, so holding costs others nothing until it loses leadership; then
	// ReleaseKept frees what it holds (a crash leaves them to expire, as a crash mid-bind does).
	Keep bool

	mu    sync.Mutex
	locks map[string]*nodeMutexes
	// observed is, per node, the held Lease record this process last saw and since when (guarded
	// by mu).
	observed map[string]leaseObservation
	// kept is, per node, the Lease this process holds between binds (Keep) as it last wrote it and
	// when it started that write on its own clock (guarded by mu).
	kept map[string]keptLease
	// now is the local clock (time.Now when nil; tests set it).
	now func() time.Time
}

// keptLease is a Lease this process wrote and keeps between binds.
type keptLease struct {
	lease    *coordinationv1.Lease
	acquired time.Time
	caughtUp bool
}

// leaseObservation is a held Lease's record as this process saw it, and when it first saw it on
// its own clock.
type leaseObservation struct {
	holder  string
	renew   time.Time
	version string
	since   time.Time
}

func (l *NodeLocker) clock() time.Time {
	if l.now != nil {
		return l.now()
	}
	return time.Now()
}

// LeaseName is the per-node bind Lease's name.
func LeaseName(node string) string { return leasePrefix + node }

const leasePrefix = "tessera-bind-"

// NodeLock is a held node lock.
type NodeLock struct {
	l        *NodeLocker
	node     string
	lease    *coordinationv1.Lease
	acquired time.Time
	local    *sync.Mutex
	use      *sync.RWMutex
	// caughtUp: a bind under this Lease, held without a break since, found the informers' view of
	// the node's assignments complete (MarkCaughtUp). A Lease acquired afresh starts without it.
	caughtUp bool
}

// CaughtUp reports whether a bind under this Lease, held without a break since, marked the
// informers' view of the node's assignments complete.
func (nl *NodeLock) CaughtUp() bool { return nl.caughtUp }

// MarkCaughtUp records that the informers' view of the node's assignments is complete (a list
// under this lock showed nothing they did not count); it lasts while the Lease is kept and renewed.
func (nl *NodeLock) MarkCaughtUp() { nl.caughtUp = true }

// nodeMutexes are one node's process-local locks (use is taken before local).
type nodeMutexes struct {
	// local orders this process's binds on the node.
	local sync.Mutex
	// use is held for reading from Lock until the bind's last write under the Lease has ended
	// (past Handoff), and for writing by ReleaseKept: a kept Lease is never freed while a write
	// made under it is in flight.
	use sync.RWMutex
}

func (l *NodeLocker) mutexes(node string) *nodeMutexes {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.locks == nil {
		l.locks = map[string]*nodeMutexes{}
	}
	m := l.locks[node]
	if m == nil {
		m = &nodeMutexes{}
		l.locks[node] = m
	}
	return m
}

func (l *NodeLocker) localMutex(node string) *sync.Mutex { return &l.mutexes(node).local }

func (l *NodeLocker) useMutex(node string) *sync.RWMutex { return &l.mutexes(node).use }

// Lock acquires the node's Lease, retrying with jittered backoff until ctx ends. A Lease kept from
// an earlier bind (Keep) is taken back without an API call while young, else renewed by a
// compare-and-swap on the version this process wrote; a failed swap (another process took the
// expired Lease, or the record changed) drops it and acquires afresh.
func (l *NodeLocker) Lock(ctx context.Context, node string) (*NodeLock, error) {
	use, local := l.useMutex(node), l.localMutex(node)
	use.RLock()
	local.Lock()
	leases := l.Client.CoordinationV1().Leases(l.Namespace)
	if k, ok := l.takeKept(node); ok {
		if l.clock().Before(k.acquired.Add(l.Duration / 4)) {
			return &NodeLock{l: l, node: node, lease: k.lease, acquired: k.acquired, local: local, use: use, caughtUp: k.caughtUp}, nil
		}
		now := metav1.NewMicroTime(l.clock())
		next := k.lease.DeepCopy() // the version this process wrote: the update is a compare-and-swap
		next.Spec.RenewTime = &now
		if got, err := leases.Update(ctx, next, metav1.UpdateOptions{}); err == nil {
			return &NodeLock{l: l, node: node, lease: got, acquired: now.Time, local: local, use: use, caughtUp: k.caughtUp}, nil
		}
	}
	name := LeaseName(node)
	secs := int32(max(1, l.Duration/time.Second))
	var lock *NodeLock
	// Tried at once, then a step of lockBackoff after each try that found the Lease held or lost a
	// compare-and-swap, until ctx ends (its error returned) or the API server answers an error that
	// retrying does not cure (returned).
	err := lockBackoff.DelayFunc().Until(ctx, true, true, func(ctx context.Context) (bool, error) {
		now := metav1.NewMicroTime(l.clock())
		cur, err := leases.Get(ctx, name, metav1.GetOptions{})
		var got *coordinationv1.Lease
		switch {
		case apierrors.IsNotFound(err):
			got, err = leases.Create(ctx, &coordinationv1.Lease{
				ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: l.Namespace},
				Spec:       coordinationv1.LeaseSpec{HolderIdentity: &l.Identity, LeaseDurationSeconds: &secs, AcquireTime: &now, RenewTime: &now},
			}, metav1.CreateOptions{})
		case err != nil:
		case l.expired(node, cur, now.Time):
			next := cur.DeepCopy() // carries cur's resourceVersion: the update is a compare-and-swap
			next.Spec.HolderIdentity, next.Spec.LeaseDurationSeconds = &l.Identity, &secs
			next.Spec.AcquireTime, next.Spec.RenewTime = &now, &now
			got, err = leases.Update(ctx, next, metav1.UpdateOptions{})
		default:
			err = errHeld
		}
		if err == nil {
			l.forget(node)
			lock = &NodeLock{l: l, node: node, lease: got, acquired: now.Time, local: local, use: use}
			return true, nil
		}
		if !apierrors.IsConflict(err) && !apierrors.IsAlreadyExists(err) && err != errHeld {
			return false, err
		}
		return false, nil
	})
	if err == nil {
		return lock, nil
	}
	local.Unlock()
	use.RUnlock()
	return nil, fmt.Errorf("lock node %s (lease %s/%s): %w", node, l.Namespace, name, err)
}

// lockBackoff spaces out the tries of a held Lease: small waits (a bind holds the lock for
// milliseconds) growing from 4 ms by half each time to 20 ms, each up to a quarter longer at random
// so that contenders do not retry in step (at the cap 20-25 ms, as the linear 2 ms + 3 ms per try
// + 0-5 ms spacing this replaced).
var lockBackoff = wait.Backoff{Duration: 4 * time.Millisecond, Factor: 1.5, Jitter: 0.25, Cap: 20 * time.Millisecond, Steps: math.MaxInt32}

var errHeld = fmt.Errorf("lease held by another extender")

// expired reports whether a node's Lease has no holder or its holder let it expire: this process
// has observed the same record (holder, renewTime, resourceVersion) since more than the Lease's
// duration ago on its own clock (now). A record not seen before starts its observation.
func (l *NodeLocker) expired(node string, lease *coordinationv1.Lease, now time.Time) bool {
	s := lease.Spec
	if s.HolderIdentity == nil || *s.HolderIdentity == "" || s.RenewTime == nil || s.LeaseDurationSeconds == nil {
		return true
	}
	o, fresh := l.observe(node, lease, now)
	return !fresh && now.Sub(o.since) > time.Duration(*s.LeaseDurationSeconds)*time.Second
}

// observe records a held Lease's record as seen now, unless the same record (holder, renewTime,
// resourceVersion) was seen before; it returns the observation in force and whether it starts now.
func (l *NodeLocker) observe(node string, lease *coordinationv1.Lease, now time.Time) (leaseObservation, bool) {
	s := lease.Spec
	seen := leaseObservation{holder: *s.HolderIdentity, renew: s.RenewTime.Time, version: lease.ResourceVersion, since: now}
	l.mu.Lock()
	defer l.mu.Unlock()
	o, ok := l.observed[node]
	if ok && o.holder == seen.holder && o.renew.Equal(seen.renew) && o.version == seen.version {
		return o, false
	}
	if l.observed == nil {
		l.observed = map[string]leaseObservation{}
	}
	l.observed[node] = seen
	return seen, true
}

// Observe records a bind Lease as a watch delivers it, so that the time a Lease has gone unchanged
// counts from when this process first saw it, not from its first Lock of that node: with Keep, a
// leader that dies holds the Lease of every node it bound lately, and a replica that took over would
// otherwise wait a Lease duration on each node after winning the election (TestMultiNode/LeaderKill:
// 35 s from the kill to the next bind with 15 s Leases). Leases of other names, free ones and this
// process's own are ignored. It is safe for the same reason as Lock's own observations: an
// observation starts no earlier than the record it saw was written.
func (l *NodeLocker) Observe(lease *coordinationv1.Lease) {
	node, ok := strings.CutPrefix(lease.Name, leasePrefix)
	s := lease.Spec
	if !ok || lease.Namespace != l.Namespace || s.HolderIdentity == nil || *s.HolderIdentity == "" || *s.HolderIdentity == l.Identity ||
		s.RenewTime == nil || s.LeaseDurationSeconds == nil {
		return
	}
	l.observe(node, lease, l.clock())
}

// takeKept removes and returns the node's kept Lease, if any.
func (l *NodeLocker) takeKept(node string) (keptLease, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	k, ok := l.kept[node]
	delete(l.kept, node)
	return k, ok
}

// ReleaseKept frees every Lease kept between binds (on losing leadership, at shutdown), each by a
// compare-and-swap on the version this process wrote (one that fails simply expires), once the
// writes made under it have ended.
func (l *NodeLocker) ReleaseKept(ctx context.Context) {
	l.mu.Lock()
	nodes := make([]string, 0, len(l.kept))
	for node := range l.kept {
		nodes = append(nodes, node)
	}
	l.mu.Unlock()
	for _, node := range nodes {
		use, local := l.useMutex(node), l.localMutex(node)
		use.Lock()
		local.Lock()
		if k, ok := l.takeKept(node); ok {
			releaseLease(ctx, l, k.lease)
		}
		local.Unlock()
		use.Unlock()
	}
}

// forget drops the node's observation (this process holds the Lease now).
func (l *NodeLocker) forget(node string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.observed, node)
}

// Valid reports whether the lock is still safely held: well inside its duration, so that a
// holder delayed past it (and possibly overtaken) does not write on stale information.
func (nl *NodeLock) Valid() bool { return nl.l.clock().Before(nl.SafeUntil()) }

// SafeUntil is when the lock stops being safely held (half its duration after acquiring: another
// process can take it only after observing it unchanged for the whole duration, which it starts
// after this process wrote it).
func (nl *NodeLock) SafeUntil() time.Time { return nl.acquired.Add(nl.l.Duration / 2) }

// Unlock frees the process-local mutex, and the Lease unless the locker keeps it for the next bind
// (Keep).
func (nl *NodeLock) Unlock(ctx context.Context) {
	defer nl.use.RUnlock()
	nl.unlockLocal(ctx)
}

// Handoff lets this process's next bind on the node in (it frees the process-local mutex and, Keep,
// keeps the Lease) while this bind's last write is still in flight: done ends the hold, and
// ReleaseKept waits for it, so the Lease is never freed for another process under that write.
// Without Keep it returns nil and the caller keeps the lock until Unlock (the Lease would be freed).
func (nl *NodeLock) Handoff(ctx context.Context) (done func()) {
	if !nl.l.Keep {
		return nil
	}
	nl.unlockLocal(ctx)
	return nl.use.RUnlock
}

func (nl *NodeLock) unlockLocal(ctx context.Context) {
	defer nl.local.Unlock()
	if nl.l.Keep {
		nl.l.mu.Lock()
		defer nl.l.mu.Unlock()
		if nl.l.kept == nil {
			nl.l.kept = map[string]keptLease{}
		}
		nl.l.kept[nl.node] = keptLease{lease: nl.lease, acquired: nl.acquired, caughtUp: nl.caughtUp}
		return
	}
	releaseLease(ctx, nl.l, nl.lease)
}

// releaseLease frees a Lease this process wrote (a compare-and-swap on that version; if it fails the
// Lease simply expires).
func releaseLease(ctx context.Context, l *NodeLocker, lease *coordinationv1.Lease) {
	next := lease.DeepCopy()
	empty := ""
	next.Spec.HolderIdentity = &empty
	_, _ = l.Client.CoordinationV1().Leases(l.Namespace).Update(ctx, next, metav1.UpdateOptions{})
}
