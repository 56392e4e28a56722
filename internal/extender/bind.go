package extender

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// ErrNotLeader is returned by Bind on a replica that does not hold the leader Lease.
var ErrNotLeader = errors.New("this tessera-extender replica is not the leader; the scheduler will retry")

// Bind chooses the pod's GPUs on the node, writes the assignment annotation, then binds, all under
// the node's Lease lock. The choice is made against the assignments read from the API server (not the
// informer cache, which may lag another process) and counted by the same rule as the state (trust.go:
// bound pods, and this process's own reservations). The Binding is made before the lock is released,
// so the next holder's list never meets an assignment still in flight from another process. The write
// is fenced: the annotation PATCH carries the pod's resourceVersion, the Binding must finish while the
// lock is still well inside its duration, and a write that landed too late is rolled back.
//
// The pod is read from the informer's cache when it has it (one round trip fewer): every write
// made from that copy is fenced on its resourceVersion (the assignment PATCH) or its UID (the
// Binding), so a stale copy costs a conflict and one retry from a fresh read, never a wrong write.
func (x *Extender) Bind(ctx context.Context, args *extenderv1.ExtenderBindingArgs) error {
	if x.Leader != nil && !x.Leader.Load() {
		return ErrNotLeader
	}
	if x.BindTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, x.BindTimeout)
		defer cancel()
	}
	if pod := x.cachedPod(args); pod != nil {
		if err := x.bindPod(ctx, args, pod, true); !errors.Is(err, errStaleCopy) {
			return err
		}
	}
	pod, err := x.Client.CoreV1().Pods(args.PodNamespace).Get(ctx, args.PodName, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("bind %s/%s: get pod: %w", args.PodNamespace, args.PodName, err)
	}
	return x.bindPod(ctx, args, pod, false)
}

// errStaleCopy says the informer's copy of the pod was behind the API server's (the fenced
// assignment write conflicted): Bind reads the pod afresh and binds again.
var errStaleCopy = errors.New("the informer's copy of the pod is stale")

// cachedPod is the informer's copy of the pod the scheduler names (by UID, then namespace and
// name), or nil when there is none.
func (x *Extender) cachedPod(args *extenderv1.ExtenderBindingArgs) *corev1.Pod {
	if x.PodByUID == nil || args.PodUID == "" {
		return nil
	}
	if p := x.PodByUID(args.PodUID); p != nil && p.Namespace == args.PodNamespace && p.Name == args.PodName {
		return p
	}
	return nil
}

// bindPod is Bind for a pod read from the cache (cached) or from the API server. The copy is not
// modified (the cache's is shared).
func (x *Extender) bindPod(ctx context.Context, args *extenderv1.ExtenderBindingArgs, pod *corev1.Pod, cached bool) error {
	if args.PodUID != "" && pod.UID != args.PodUID {
		return fmt.Errorf("bind %s/%s: pod UID is %s, the scheduler asked for %s (pod was recreated)", args.PodNamespace, args.PodName, pod.UID, args.PodUID)
	}
	if name := schedulerName(pod); !slices.Contains(x.SchedulerNames, name) {
		x.log().Warn("bind refused: the pod's scheduler is not one this extender serves", "pod", args.PodNamespace+"/"+args.PodName, "schedulerName", name, "serves", x.SchedulerNames)
		return fmt.Errorf("bind %s/%s: the pod's schedulerName %q is not one this extender serves %q", args.PodNamespace, args.PodName, name, x.SchedulerNames)
	}
	if pod.Spec.NodeName != "" {
		if pod.Spec.NodeName == args.Node {
			return nil // an earlier attempt landed (its answer was lost)
		}
		return fmt.Errorf("bind %s/%s: already bound to %s", args.PodNamespace, args.PodName, pod.Spec.NodeName)
	}
	// The node as the informer has it (a taint or cordon added since the scheduler's filter counts;
	// the scheduler's own view is an informer's too), read from the API server when not cached.
	var node *corev1.Node
	if x.NodeByName != nil {
		node = x.NodeByName(args.Node)
	}
	if node == nil {
		var err error
		if node, err = x.Client.CoreV1().Nodes().Get(ctx, args.Node, metav1.GetOptions{}); err != nil {
			return fmt.Errorf("bind %s/%s: get node %s: %w", args.PodNamespace, args.PodName, args.Node, err)
		}
	}
	if why := infeasible(pod, node, x.log()); why != "" {
		x.log().Warn("bind refused: the node is not feasible for the pod", "pod", args.PodNamespace+"/"+args.PodName, "node", args.Node, "why", why)
		x.event(pod, corev1.EventTypeWarning, "GPUBindRefused", "node %s: %s", args.Node, why)
		return fmt.Errorf("bind %s/%s to node %s refused: %s", args.PodNamespace, args.PodName, args.Node, why)
	}
	req, err := x.State.request(pod, x.Class)
	if err != nil {
		x.event(pod, corev1.EventTypeWarning, "GPUPlacementRefused", "%v", err)
		return err
	}
	if !req.WantsGPU() {
		return x.bind(ctx, pod, req, args.Node)
	}
	lock, err := x.Locker.Lock(ctx, args.Node)
	if err != nil {
		x.event(pod, corev1.EventTypeWarning, "GPUBindFailed", "node %s: %v", args.Node, err)
		return err
	}
	unlock := func() { lock.Unlock(context.WithoutCancel(ctx)) }
	defer func() { unlock() }()
	// Every API call from here must end while the lock is safely held.
	lctx, cancel := context.WithDeadline(ctx, lock.SafeUntil())
	defer cancel()
	written, err := x.assign(lctx, lock, pod, req, args.Node)
	if cached && apierrors.IsConflict(err) {
		return errStaleCopy
	}
	if err != nil {
		x.event(pod, corev1.EventTypeWarning, "GPUBindFailed", "node %s: %v", args.Node, err)
		return err
	}
	// With the Lease kept, the next bind on the node in this process need not wait for this
	// Binding: it counts this pod by its reservation (the state, or its list through counted's
	// rule for this process's own reservations), and the Lease stays held until the Binding ends,
	// so no other process lists the node meanwhile.
	if done := lock.Handoff(context.WithoutCancel(ctx)); done != nil {
		unlock = done
	}
	if err := x.bind(lctx, written, req, args.Node); err != nil {
		x.release(written)
		return err
	}
	if a, err := api.DecodeAssignment([]byte(written.Annotations[api.AnnotationAssignment])); err == nil {
		x.event(written, corev1.EventTypeNormal, "GPUAssigned", "node %s: %s", args.Node, describeAssignment(a))
	}
	return nil
}

// schedulerName is the pod's spec.schedulerName, empty read as the API server defaults it.
func schedulerName(pod *corev1.Pod) string {
	if pod.Spec.SchedulerName == "" {
		return corev1.DefaultSchedulerName
	}
	return pod.Spec.SchedulerName
}

// describeAssignment says which GPUs each container got, and how much of them, for the pod's
// Normal Event: "main: GPU-1a2b share 10Gi memory 30% cores; side: GPU-3c4d whole".
func describeAssignment(a *api.PodAssignment) string {
	var parts []string
	for _, c := range a.Containers {
		var devs []string
		for _, d := range c.Devices {
			switch {
			case d.Whole:
				devs = append(devs, d.UUID+" whole")
			case d.CoresPercent > 0:
				devs = append(devs, fmt.Sprintf("%s share %s memory %d%% cores", d.UUID, resource.NewQuantity(d.MemoryBytes, resource.BinarySI), d.CoresPercent))
			default:
				devs = append(devs, fmt.Sprintf("%s share %s memory, cores uncapped", d.UUID, resource.NewQuantity(d.MemoryBytes, resource.BinarySI)))
			}
		}
		parts = append(parts, c.Name+": "+strings.Join(devs, ", "))
	}
	return strings.Join(parts, "; ")
}

// bind posts the Binding. An error is ambiguous (the Binding may have landed and its answer been
// lost): the pod is read again, and one bound to the node is a success.
func (x *Extender) bind(ctx context.Context, pod *corev1.Pod, req *placement.Request, node string) error {
	pods := x.Client.CoreV1().Pods(pod.Namespace)
	err := pods.Bind(ctx, &corev1.Binding{
		ObjectMeta: metav1.ObjectMeta{Name: pod.Name, Namespace: pod.Namespace, UID: pod.UID},
		Target:     corev1.ObjectReference{Kind: "Node", Name: node},
	}, metav1.CreateOptions{})
	if err != nil {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if cur, gerr := pods.Get(rctx, pod.Name, metav1.GetOptions{}); gerr == nil && cur.UID == pod.UID && cur.Spec.NodeName == node {
			x.log().Info("bound (the Binding's answer was an error, the pod is bound)", "pod", req.Key, "node", node, "err", err)
			return nil
		}
		x.event(pod, corev1.EventTypeWarning, "GPUBindFailed", "binding to node %s failed: %v", node, err)
		return fmt.Errorf("bind %s to %s: %w", req.Key, node, err)
	}
	x.log().Info("bound", "pod", req.Key, "node", node, "policy", x.Engine.PolicyFor(req).Name())
	return nil
}

// assign picks and writes the assignment under the node lock and returns the pod as written.
func (x *Extender) assign(ctx context.Context, lock *NodeLock, pod *corev1.Pod, req *placement.Request, node string) (*corev1.Pod, error) {
	a, err := x.decide(ctx, lock, pod, req, node)
	if err != nil {
		return nil, err
	}
	if !lock.Valid() {
		return nil, fmt.Errorf("node lock for %s held too long (%s); retrying is safer than writing on stale state", node, x.Locker.Duration/2)
	}
	enc, err := api.EncodeAssignment(a)
	if err != nil {
		return nil, fmt.Errorf("encode assignment: %w", err)
	}
	// resourceVersion makes the PATCH a compare-and-swap on the pod we decided for.
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{
		"resourceVersion": pod.ResourceVersion,
		"annotations":     map[string]string{api.AnnotationAssignment: string(enc)},
		"labels":          map[string]string{api.LabelAssignedNode: node},
	}})
	x.State.reserve(pod.UID, req.Key, pod.Namespace, req, a)
	written, err := x.Client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	if err != nil {
		x.State.unreserve(pod.UID)
		return nil, fmt.Errorf("write assignment of %s: %w", req.Key, err)
	}
	if !lock.Valid() {
		// The write may have landed after another process could take the lock: undo it.
		x.release(written)
		return nil, fmt.Errorf("node lock for %s expired while the assignment was written; rolled back", node)
	}
	return written, nil
}

// decide builds the node's state from the API server's view of its assignments and places req.
//
// The API server's view is a list of the node's assignments, unless the lock proves the informers'
// view is as good (lock.CaughtUp): this process has held the node's Lease without a break since a
// list that showed nothing the informers did not count. Every writer of assignments holds the
// Lease, so nothing was written on the node since but by this process, which counts its own writes
// as reservations until the informers see them.
func (x *Extender) decide(ctx context.Context, lock *NodeLock, pod *corev1.Pod, req *placement.Request, node string) (*api.PodAssignment, error) {
	// This process's in-flight decisions on the node (Filter's holds, other binds' reservations):
	// the API server's list does not show a hold whose pod has no annotation yet, and a bind that
	// chose past it would give one GPU to two pods in the state (the live divergence of issue 14).
	base, missing := x.State.bindBase(node, pod.UID)
	if base == nil {
		return nil, errors.New(missing)
	}
	holds := base.holds
	n := placement.NewNodeState(base.inv, base.labels)
	n.CPUMilli, n.MemMiB, n.UsedCPU, n.UsedMem = base.cpu, base.mem, base.usedCPU, base.usedMem
	if lock.CaughtUp() {
		for _, a := range base.counted {
			p := placementOf(n, a)
			n.Apply(&placement.Request{}, &p)
		}
	} else {
		request := func(p *corev1.Pod) (*placement.Request, error) { return x.State.request(p, x.Class) }
		list, err := x.Client.CoreV1().Pods("").List(ctx, metav1.ListOptions{
			LabelSelector: labels.SelectorFromSet(labels.Set{api.LabelAssignedNode: node}).String(),
		})
		if err != nil {
			return nil, fmt.Errorf("list assignments on node %s: %w", node, err)
		}
		caughtUp := true
		for i := range list.Items {
			other := &list.Items[i]
			if other.UID == pod.UID {
				continue
			}
			// The same rule as the informer state (trust.go): the label only narrows the list.
			a, _ := counted(other, request, x.State.reserved)
			if a == nil || a.Node != node {
				continue
			}
			if known, ok := base.counted[other.UID]; !ok || !reflect.DeepEqual(known, a) {
				if known, ok = holds[other.UID]; !ok || !reflect.DeepEqual(known, a) {
					caughtUp = false // the informers have not seen this assignment yet
				}
			}
			delete(holds, other.UID) // counted from the API server's copy
			delete(base.held, other.UID)
			p := placementOf(n, a)
			n.Apply(&placement.Request{}, &p)
		}
		if caughtUp {
			lock.MarkCaughtUp()
		}
	}
	for _, a := range holds {
		p := placementOf(n, a)
		n.Apply(&placement.Request{}, &p)
	}
	// What the node agent's ledger holds for pods the state does not track (a local placement, a
	// restarting container's hold) is occupied here as it is for Filter: a bind whose Filter
	// reservation is missing, expired or stale must not hand out a GPU the node still holds.
	for _, p := range base.held {
		n.Apply(&placement.Request{}, &p)
	}
	// Filter's choice for this pod stands while it still fits: it is the policy's choice made in
	// arrival order (as the simulator places), not one made against holds of pods filtered later.
	if own := base.own; own != nil {
		if p := placementFor(n, req, own); placement.Fits(n, req, &p) {
			return BuildAssignment(n, req, &p), nil
		}
	}
	p, _, u := x.Engine.EvaluateOn(x.State.Shapes().ScoreContext(), n, req)
	if u != nil {
		return nil, fmt.Errorf("GPU request no longer fits node %s: %s", node, u.Msg)
	}
	return BuildAssignment(n, req, &p), nil
}

// placementFor is placementOf with each device's container indexing req's containers (an assignment
// lists only the containers that got GPUs), as Fits and BuildAssignment expect.
func placementFor(n *placement.NodeState, req *placement.Request, a *api.PodAssignment) placement.Placement {
	p := placementOf(n, a)
	for i := range p.Devices {
		d := &p.Devices[i]
		name := a.Containers[d.Container].Name
		d.Container = -1 // not in the request: Fits refuses it
		for ci := range req.Containers {
			if req.Containers[ci].Name == name {
				d.Container = ci
			}
		}
	}
	return p
}

// BuildAssignment turns a placement into the per-container annotation document.
func BuildAssignment(n *placement.NodeState, req *placement.Request, p *placement.Placement) *api.PodAssignment {
	a := &api.PodAssignment{APIVersion: api.Version, Node: n.Name}
	for ci, c := range req.Containers {
		ca := api.ContainerAssignment{Name: c.Name}
		for _, d := range p.Devices {
			if d.Container != ci {
				continue
			}
			da := api.DeviceAssignment{UUID: n.GPUs[d.GPU].UUID, Whole: d.Whole}
			if !d.Whole {
				da.MemoryBytes, da.CoresPercent = d.Memory, d.Milli/10
			}
			ca.Devices = append(ca.Devices, da)
		}
		if len(ca.Devices) > 0 {
			a.Containers = append(a.Containers, ca)
		}
	}
	return a
}

// release removes a pod's assignment after a failed bind (fenced on the version we wrote, so an
// assignment someone wrote since stays).
func (x *Extender) release(pod *corev1.Pod) {
	x.State.unreserve(pod.UID)
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{
		"resourceVersion": pod.ResourceVersion,
		"annotations":     map[string]any{api.AnnotationAssignment: nil},
		"labels":          map[string]any{api.LabelAssignedNode: nil},
	}})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := x.Client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		x.log().Error("release assignment after failed bind", "pod", pod.Namespace+"/"+pod.Name, "err", err)
	}
}
