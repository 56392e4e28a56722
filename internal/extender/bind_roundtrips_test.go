package extender

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// cacheFrom makes x read pods by UID from a fixed set of copies, as the informer's cache would.
func cacheFrom(x *Extender, pods ...*corev1.Pod) {
	x.PodByUID = func(uid types.UID) *corev1.Pod {
		for _, p := range pods {
			if p.UID == uid {
				return p
			}
		}
		return nil
	}
}

// apiCalls lists the actions a clientset saw from index from on, as "verb resource[/sub]".
func apiCalls(cs *fake.Clientset, from int) []string {
	var out []string
	for _, a := range cs.Actions()[from:] {
		s := a.GetVerb() + " " + a.GetResource().Resource
		if a.GetSubresource() != "" {
			s += "/" + a.GetSubresource()
		}
		out = append(out, s)
	}
	return out
}

// TestBindRoundTrips: with the pod in the informer's cache and the node's Lease kept from the last
// bind, whose list of the node's assignments showed nothing the informers did not count, a bind
// makes three API calls (the node, the assignment PATCH, the Binding); the first bind on a node
// also reads and creates its Lease and lists the node's assignments, and none frees the Lease.
func TestBindRoundTrips(t *testing.T) {
	node := testNode(testInventory("n1", 1, 4, "A100"), nil)
	a, b := wholePod("a", 1), wholePod("b", 1)
	cs, _ := fakeAPI(t, node, a, b)
	x := newBinder(t, cs, "replica-a", node)
	x.Locker.Keep = true
	cacheFrom(x, a, b)
	ctx := context.Background()
	from := len(cs.Actions())
	if err := x.Bind(ctx, &extenderv1.ExtenderBindingArgs{PodName: "a", PodNamespace: "default", PodUID: a.UID, Node: "n1"}); err != nil {
		t.Fatal(err)
	}
	want := "[get nodes get leases create leases list pods patch pods create pods/binding]"
	if got := fmt.Sprint(apiCalls(cs, from)); got != want {
		t.Errorf("first bind on the node: %s, want %s", got, want)
	}
	from = len(cs.Actions())
	if err := x.Bind(ctx, &extenderv1.ExtenderBindingArgs{PodName: "b", PodNamespace: "default", PodUID: b.UID, Node: "n1"}); err != nil {
		t.Fatal(err)
	}
	want = "[get nodes patch pods create pods/binding]"
	if got := fmt.Sprint(apiCalls(cs, from)); got != want {
		t.Errorf("second bind on the node: %s, want %s", got, want)
	}
}

// TestBindStaleCachedPodFenced: the informer's copy of the pod lags the API server's, where an
// earlier attempt of this bind already wrote GPU 1 and bound the pod (its answer lost). The
// assignment PATCH made from the stale copy carries the copy's resourceVersion, so it conflicts;
// bind reads the pod afresh, finds it bound to the node and succeeds without writing again. Without
// the fence the stale copy's decision (GPU 0) would overwrite the assignment the pod runs with.
func TestBindStaleCachedPodFenced(t *testing.T) {
	node := testNode(testInventory("n1", 1, 2, "A100"), nil)
	stale := wholePod("w", 1)
	stale.ResourceVersion = "1"
	current := assigned(wholePod("w", 1), "n1", api.DeviceAssignment{UUID: gpuUUID(1, 1), Whole: true})
	current.ResourceVersion = "2"
	cs, _ := fakeAPI(t, node, current)
	x := newBinder(t, cs, "a", node)
	cacheFrom(x, stale)
	before := current.Annotations[api.AnnotationAssignment]
	from := len(cs.Actions())
	if err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: "w", PodNamespace: "default", PodUID: stale.UID, Node: "n1"}); err != nil {
		t.Fatalf("bind from a stale copy of a pod already bound to the node: %v", err)
	}
	got, err := cs.CoreV1().Pods("default").Get(context.Background(), "w", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if after := got.Annotations[api.AnnotationAssignment]; after != before || got.Spec.NodeName != "n1" {
		t.Fatalf("the bound pod's assignment changed from %s to %s (node %q): a write from the stale copy landed", before, after, got.Spec.NodeName)
	}
	calls := apiCalls(cs, from)
	if fmt.Sprint(calls[len(calls)-1]) != "get pods" {
		t.Errorf("calls %v: want the fresh read of the pod last (it is bound: nothing more to do)", calls)
	}
}

// TestNodeLockKept: a Lease kept between binds (Keep) is taken back without an API call while young,
// renewed with one compare-and-swap when older, and never taken back once another process has
// taken it (it expired unrenewed, as observed by that process): the renewal's swap on the version
// this process wrote fails, and Lock waits like any contender. ReleaseKept frees it for others at
// once.
func TestNodeLockKept(t *testing.T) {
	cs, _ := fakeAPI(t)
	base := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	ca, cb := &skewedClock{t: base}, &skewedClock{t: base}
	a := &NodeLocker{Client: cs, Namespace: "kube-system", Identity: "a", Duration: 15 * time.Second, Keep: true, now: ca.now}
	b := &NodeLocker{Client: cs, Namespace: "kube-system", Identity: "b", Duration: 15 * time.Second, now: cb.now}
	ctx := context.Background()
	lock := func(l *NodeLocker) *NodeLock {
		t.Helper()
		tctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		nl, err := l.Lock(tctx, "n1")
		if err != nil && tctx.Err() == nil {
			t.Fatal(err)
		}
		return nl
	}
	holder := func() string {
		t.Helper()
		l, err := cs.CoordinationV1().Leases("kube-system").Get(ctx, LeaseName("n1"), metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return *l.Spec.HolderIdentity
	}
	first := lock(a)
	first.Unlock(ctx)
	if h := holder(); h != "a" {
		t.Fatalf("after a kept Lease's unlock the holder is %q, want a (kept, not freed)", h)
	}
	if lock(b) != nil {
		t.Fatal("b took the Lease a keeps")
	}
	// Young: taken back with no API call, safe until the first acquisition's bound.
	from := len(cs.Actions())
	again := lock(a)
	if again == nil || len(cs.Actions()) != from || !again.SafeUntil().Equal(first.SafeUntil()) {
		t.Fatalf("a young kept Lease: lock %v, %d API calls, safe until %v; want taken back with none, safe until %v", again != nil, len(cs.Actions())-from, again.SafeUntil(), first.SafeUntil())
	}
	again.Unlock(ctx)
	// Older than a quarter of its duration: one renewal.
	ca.advance(5 * time.Second)
	cb.advance(5 * time.Second)
	from = len(cs.Actions())
	renewed := lock(a)
	if renewed == nil || fmt.Sprint(apiCalls(cs, from)) != "[update leases]" || !renewed.SafeUntil().Equal(ca.now().Add(7500*time.Millisecond)) {
		t.Fatalf("an older kept Lease: calls %v; want one update, safe for half the duration from now", apiCalls(cs, from))
	}
	renewed.Unlock(ctx)
	// a stops binding; b observes the record unchanged for longer than the duration and takes it.
	if lock(b) != nil {
		t.Fatal("b took the Lease a renewed")
	}
	ca.advance(16 * time.Second)
	cb.advance(16 * time.Second)
	taken := lock(b)
	if taken == nil {
		t.Fatal("b never took the Lease a left unrenewed for 16 s")
	}
	if nl := lock(a); nl != nil {
		t.Fatalf("a took back its kept Lease while b holds it (holder now %q)", holder())
	}
	if h := holder(); h != "b" {
		t.Fatalf("holder %q after a's attempt, want b", h)
	}
	taken.Unlock(ctx)
	// ReleaseKept: what a keeps is free for b at once.
	lock(a).Unlock(ctx)
	a.ReleaseKept(ctx)
	if nl := lock(b); nl == nil {
		t.Fatal("b could not take the Lease a released with ReleaseKept")
	}
}

// TestBindNoCopyInCache: a pod the cache does not have (or has under another name) is read from the
// API server, as before.
func TestBindNoCopyInCache(t *testing.T) {
	node := testNode(testInventory("n1", 1, 1, "A100"), nil)
	pod := wholePod("w", 1)
	other := wholePod("x", 1)
	other.UID = pod.UID // a copy under another name must not stand in
	cs, _ := fakeAPI(t, node, pod)
	x := newBinder(t, cs, "a", node)
	cacheFrom(x, other)
	from := len(cs.Actions())
	if err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: "w", PodNamespace: "default", PodUID: pod.UID, Node: "n1"}); err != nil {
		t.Fatal(err)
	}
	if calls := apiCalls(cs, from); calls[0] != "get pods" {
		t.Fatalf("calls %v: want the pod read from the API server first", calls)
	}
}

// TestSecurityNodeLockKeptNotRetaken: once another process has taken a Lease this process kept
// (it went unrenewed for longer than its duration, as the taker observed on its own clock), Lock
// never takes it back from the kept copy: reuse is bounded by a quarter of the duration on the
// keeper's clock, and the renewal is a compare-and-swap on the version the keeper wrote.
func TestSecurityNodeLockKeptNotRetaken(t *testing.T) {
	cs, _ := fakeAPI(t)
	base := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	ca, cb := &skewedClock{t: base}, &skewedClock{t: base.Add(time.Hour)} // skewed: observation, not renewTime, times b's take
	a := &NodeLocker{Client: cs, Namespace: "kube-system", Identity: "a", Duration: 15 * time.Second, Keep: true, now: ca.now}
	b := &NodeLocker{Client: cs, Namespace: "kube-system", Identity: "b", Duration: 15 * time.Second, now: cb.now}
	ctx := context.Background()
	try := func(l *NodeLocker) *NodeLock {
		tctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		nl, _ := l.Lock(tctx, "n1")
		return nl
	}
	first := try(a)
	if first == nil {
		t.Fatal("a could not lock a free node")
	}
	first.Unlock(ctx)
	if try(b) != nil {
		t.Fatal("b took the Lease a keeps at once")
	}
	cb.advance(16 * time.Second)
	ca.advance(16 * time.Second)
	if try(b) == nil {
		t.Fatal("b never took the Lease a left unrenewed for 16 s")
	}
	if nl := try(a); nl != nil {
		t.Fatal("a locked the node b holds: its kept Lease was reused or renewed over b's")
	}
}

// TestSecurityBindListSkipFenced: bind skips the list of the node's assignments only under a Lease
// held without a break since a list that the informers' view matched. Replica a binds two pods
// (the second without a list); a's Lease then expires unrenewed and replica b, whose writes a's
// informers have not seen, takes it and binds a pod. a's next bind must acquire the
// Lease afresh and list again, so it sees b's GPU and never gives it twice; a list that shows an
// assignment the informers have not counted keeps the next bind listing too.
func TestSecurityBindListSkipFenced(t *testing.T) {
	node := testNode(testInventory("n1", 1, 6, "A100"), nil)
	p1, p2, p3, p4, q := wholePod("p1", 1), wholePod("p2", 1), wholePod("p3", 1), wholePod("p4", 1), wholePod("q", 1)
	cs, _ := fakeAPI(t, node, p1, p2, p3, p4, q)
	base := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	ca, cb := &skewedClock{t: base}, &skewedClock{t: base}
	a := newBinder(t, cs, "replica-a", node)
	a.Locker.Keep, a.Locker.now = true, ca.now
	cacheFrom(a, p1, p2, p3, p4)
	b := newBinder(t, cs, "replica-b", node)
	b.Locker.now = cb.now
	cacheFrom(b, q)
	ctx := context.Background()
	bind := func(x *Extender, p *corev1.Pod) []string {
		t.Helper()
		from := len(cs.Actions())
		if err := x.Bind(ctx, &extenderv1.ExtenderBindingArgs{PodName: p.Name, PodNamespace: "default", PodUID: p.UID, Node: "n1"}); err != nil {
			t.Fatalf("bind %s: %v", p.Name, err)
		}
		return apiCalls(cs, from)
	}
	listed := func(calls []string) bool { return slices.Contains(calls, "list pods") }
	if !listed(bind(a, p1)) {
		t.Fatal("the first bind under a new Lease did not list the node's assignments")
	}
	if listed(bind(a, p2)) {
		t.Fatal("a bind under the kept Lease, after a list the informers matched, listed again")
	}
	// b starts observing a's Lease, which a leaves unrenewed past its duration; b takes it.
	tctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	if _, err := b.Locker.Lock(tctx, "n1"); err == nil {
		t.Fatal("b took a's kept Lease at once")
	}
	cancel()
	ca.advance(16 * time.Second)
	cb.advance(16 * time.Second)
	bind(b, q)
	if !listed(bind(a, p3)) {
		t.Fatal("a's bind after b held the node's Lease did not list the node's assignments")
	}
	// b's pod is still unknown to a's informers: the list did not match, so the next bind lists.
	if !listed(bind(a, p4)) {
		t.Fatal("a bind after a list that showed an assignment the informers had not counted skipped the list")
	}
	owner := map[string]string{}
	list, _ := cs.CoreV1().Pods("default").List(ctx, metav1.ListOptions{})
	for _, p := range list.Items {
		asg, err := api.DecodeAssignment([]byte(p.Annotations[api.AnnotationAssignment]))
		if err != nil {
			t.Fatalf("pod %s: %v", p.Name, err)
		}
		for _, d := range asg.Containers[0].Devices {
			if prev, dup := owner[d.UUID]; dup {
				t.Fatalf("GPU %s given to %s and %s", d.UUID, prev, p.Name)
			}
			owner[d.UUID] = p.Name
		}
	}
}

// TestBindHandoff: with the Lease kept, a bind's Binding is made with the node's process-local
// mutex already free (the next bind on the node in this process need not wait for it) and the
// node's use still held (ReleaseKept cannot free the Lease under it). The fake clientset runs one
// call at a time, so the test looks at the two locks from inside the Binding.
func TestBindHandoff(t *testing.T) {
	node := testNode(testInventory("n1", 1, 2, "A100"), nil)
	a := wholePod("a", 1)
	cs, _ := fakeAPI(t, node, a)
	x := newBinder(t, cs, "replica-a", node)
	x.Locker.Keep = true
	cacheFrom(x, a)
	var localFree, useFree, seen bool
	cs.PrependReactor("create", "pods", func(act k8stesting.Action) (bool, runtime.Object, error) {
		if act.GetSubresource() != "binding" {
			return false, nil, nil
		}
		seen = true
		if localFree = x.Locker.localMutex("n1").TryLock(); localFree {
			x.Locker.localMutex("n1").Unlock()
		}
		if useFree = x.Locker.useMutex("n1").TryLock(); useFree {
			x.Locker.useMutex("n1").Unlock()
		}
		return false, nil, nil
	})
	if err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: "a", PodNamespace: "default", PodUID: a.UID, Node: "n1"}); err != nil {
		t.Fatal(err)
	}
	if !seen || !localFree || useFree {
		t.Fatalf("during the Binding: node's local mutex free %v (want true), its use free %v (want false)", localFree, useFree)
	}
	if !x.Locker.useMutex("n1").TryLock() || !x.Locker.localMutex("n1").TryLock() {
		t.Fatal("the node's locks are still held after the bind")
	}
}

// TestSecurityReleaseKeptWaitsForHandoff: ReleaseKept (the replica stops leading) does not free a
// kept Lease while a write made under it is in flight (a lock handed off, not done): another
// replica could otherwise take the Lease and list the node while this pod's assignment is written
// but the pod not bound (another process's list does not count it) and give its GPU again.
func TestSecurityReleaseKeptWaitsForHandoff(t *testing.T) {
	cs, _ := fakeAPI(t)
	a := &NodeLocker{Client: cs, Namespace: "kube-system", Identity: "a", Duration: 15 * time.Second, Keep: true}
	ctx := context.Background()
	nl, err := a.Lock(ctx, "n1")
	if err != nil {
		t.Fatal(err)
	}
	done := nl.Handoff(ctx)
	released := make(chan struct{})
	go func() {
		a.ReleaseKept(ctx)
		close(released)
	}()
	select {
	case <-released:
		t.Fatal("ReleaseKept freed the node's Lease while a write under it was in flight")
	case <-time.After(time.Second): // bounded wait for a return that must not happen
	}
	done()
	<-released
	l, err := cs.CoordinationV1().Leases("kube-system").Get(ctx, LeaseName("n1"), metav1.GetOptions{})
	if err != nil || *l.Spec.HolderIdentity != "" {
		t.Fatalf("after ReleaseKept the Lease is %v (%v), want free", l.Spec.HolderIdentity, err)
	}
}

// assignedGPU is the one GPU the pod's assignment names.
func assignedGPU(t *testing.T, cs *fake.Clientset, pod string) string {
	t.Helper()
	p, err := cs.CoreV1().Pods("default").Get(context.Background(), pod, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	a, err := api.DecodeAssignment([]byte(p.Annotations[api.AnnotationAssignment]))
	if err != nil || len(a.Containers) != 1 || len(a.Containers[0].Devices) != 1 {
		t.Fatalf("pod %s: assignment %+v (%v)", pod, a, err)
	}
	return a.Containers[0].Devices[0].UUID
}

// TestBindNodeFromCache: with the node in the informer's cache the bind reads no node from the API
// server (two calls on a node bound last: the PATCH and the Binding), and the cached copy is the
// one checked: a taint the pod does not tolerate there refuses the bind. A node not in the cache
// is read from the API server.
func TestBindNodeFromCache(t *testing.T) {
	node := testNode(testInventory("n1", 1, 4, "A100"), nil)
	a, b, c := wholePod("a", 1), wholePod("b", 1), wholePod("c", 1)
	cs, _ := fakeAPI(t, node, a, b, c)
	x := newBinder(t, cs, "replica-a", node)
	x.Locker.Keep = true
	cacheFrom(x, a, b, c)
	cached := node.DeepCopy()
	x.NodeByName = func(name string) *corev1.Node {
		if name == cached.Name {
			return cached
		}
		return nil
	}
	ctx := context.Background()
	bind := func(p *corev1.Pod) ([]string, error) {
		from := len(cs.Actions())
		err := x.Bind(ctx, &extenderv1.ExtenderBindingArgs{PodName: p.Name, PodNamespace: "default", PodUID: p.UID, Node: "n1"})
		return apiCalls(cs, from), err
	}
	if _, err := bind(a); err != nil {
		t.Fatal(err)
	}
	calls, err := bind(b)
	if err != nil || fmt.Sprint(calls) != "[patch pods create pods/binding]" {
		t.Fatalf("second bind: %v (%v), want [patch pods create pods/binding]", calls, err)
	}
	cached.Spec.Taints = []corev1.Taint{{Key: "gpu", Value: "broken", Effect: corev1.TaintEffectNoSchedule}}
	if calls, err := bind(c); err == nil || len(calls) != 0 {
		t.Fatalf("bind onto a node whose cached copy has a taint the pod does not tolerate: %v, calls %v; want refused before any call", err, calls)
	}
	cached.Name = "elsewhere" // n1 no longer in the cache
	cached.Spec.Taints = nil
	if calls, err := bind(c); err != nil || calls[0] != "get nodes" {
		t.Fatalf("a node not in the cache: %v (%v), want it read from the API server first", calls, err)
	}
}
