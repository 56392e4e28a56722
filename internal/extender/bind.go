package extender

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// ErrNotLeader is returned by Bind on a replica that does not hold the leader Lease.
var ErrNotLeader = errors.New("this tessera-extender replica is not the leader; the scheduler will retry")

// Bind chooses the pod's GPUs on the node, writes the assignment annotation, then binds. The
// choice is made under the node's Lease lock against the assignments read from the API server
// (not the informer cache, which may lag another process), and the annotation is written before
// the lock is released, so concurrent binders - in this process or another - never over-commit
// a GPU. A failed bind removes the annotation and releases the reservation.
func (x *Extender) Bind(ctx context.Context, args *extenderv1.ExtenderBindingArgs) error {
	if x.Leader != nil && !x.Leader.Load() {
		return ErrNotLeader
	}
	if x.BindTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, x.BindTimeout)
		defer cancel()
	}
	pods := x.Client.CoreV1().Pods(args.PodNamespace)
	pod, err := pods.Get(ctx, args.PodName, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("bind %s/%s: get pod: %w", args.PodNamespace, args.PodName, err)
	}
	if args.PodUID != "" && pod.UID != args.PodUID {
		return fmt.Errorf("bind %s/%s: pod UID is %s, the scheduler asked for %s (pod was recreated)", args.PodNamespace, args.PodName, pod.UID, args.PodUID)
	}
	req, err := RequestFromPod(pod, x.Class)
	if err != nil {
		x.event(pod, corev1.EventTypeWarning, "GPUPlacementRefused", "%v", err)
		return err
	}
	var assigned *api.PodAssignment
	if req.WantsGPU() {
		if assigned, err = x.assign(ctx, pod, req, args.Node); err != nil {
			x.event(pod, corev1.EventTypeWarning, "GPUBindFailed", "node %s: %v", args.Node, err)
			return err
		}
	}
	err = pods.Bind(ctx, &corev1.Binding{
		ObjectMeta: metav1.ObjectMeta{Name: pod.Name, Namespace: pod.Namespace, UID: pod.UID},
		Target:     corev1.ObjectReference{Kind: "Node", Name: args.Node},
	}, metav1.CreateOptions{})
	if err != nil {
		if req.WantsGPU() {
			x.release(pod)
		}
		x.event(pod, corev1.EventTypeWarning, "GPUBindFailed", "binding to node %s failed, GPUs released: %v", args.Node, err)
		return fmt.Errorf("bind %s to %s: %w", req.Key, args.Node, err)
	}
	if assigned != nil {
		x.event(pod, corev1.EventTypeNormal, "GPUAssigned", "node %s: %s", args.Node, describeAssignment(assigned))
	}
	x.log().Info("bound", "pod", req.Key, "node", args.Node, "policy", x.Engine.PolicyFor(req).Name())
	return nil
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

// assign picks and writes the assignment under the node lock.
func (x *Extender) assign(ctx context.Context, pod *corev1.Pod, req *Request, node string) (*api.PodAssignment, error) {
	lock, err := x.Locker.Lock(ctx, node)
	if err != nil {
		return nil, err
	}
	defer lock.Unlock(context.WithoutCancel(ctx))
	a, err := x.decide(ctx, pod, req, node)
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
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{
		"annotations": map[string]string{api.AnnotationAssignment: string(enc)},
		"labels":      map[string]string{api.LabelAssignedNode: node},
	}})
	x.State.Reserve(pod.UID, req.Key, pod.Namespace, req, a)
	if _, err := x.Client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		x.State.Unreserve(pod.UID)
		return nil, fmt.Errorf("write assignment of %s: %w", req.Key, err)
	}
	return a, nil
}

// decide builds the node's state from the API server's view of its assignments and places req.
func (x *Extender) decide(ctx context.Context, pod *corev1.Pod, req *Request, node string) (*api.PodAssignment, error) {
	var inv *api.NodeInventory
	var labelsOf map[string]string
	missing := ""
	x.State.mu.RLock()
	if e := x.State.nodes[node]; e != nil && e.inv != nil {
		inv, labelsOf = e.inv, e.labels
	} else if e != nil {
		missing = e.invErr
	} else {
		missing = "node is not known to the extender yet"
	}
	x.State.mu.RUnlock()
	if inv == nil {
		return nil, errors.New(missing)
	}
	list, err := x.Client.CoreV1().Pods("").List(ctx, metav1.ListOptions{
		LabelSelector: labels.SelectorFromSet(labels.Set{api.LabelAssignedNode: node}).String(),
	})
	if err != nil {
		return nil, fmt.Errorf("list assignments on node %s: %w", node, err)
	}
	n := NewNodeState(inv, labelsOf)
	for i := range list.Items {
		other := &list.Items[i]
		if other.UID == pod.UID || podTerminated(other) {
			continue
		}
		a, err := api.DecodeAssignment([]byte(other.Annotations[api.AnnotationAssignment]))
		if err != nil || a.Node != node || (other.Spec.NodeName != "" && other.Spec.NodeName != node) {
			continue
		}
		p := placementOf(n, a)
		n.Apply(&Request{}, &p)
	}
	sc := x.State.Shapes().ScoreContext()
	p, _, u := x.Engine.Evaluate(sc, n, req)
	if u != nil {
		return nil, fmt.Errorf("GPU request no longer fits node %s: %s", node, u.Msg)
	}
	return BuildAssignment(n, req, &p), nil
}

// BuildAssignment turns a placement into the per-container annotation document.
func BuildAssignment(n *NodeState, req *Request, p *Placement) *api.PodAssignment {
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

// release removes a pod's assignment after a failed bind.
func (x *Extender) release(pod *corev1.Pod) {
	x.State.Unreserve(pod.UID)
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{
		"annotations": map[string]any{api.AnnotationAssignment: nil},
		"labels":      map[string]any{api.LabelAssignedNode: nil},
	}})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := x.Client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		x.log().Error("release assignment after failed bind", "pod", pod.Namespace+"/"+pod.Name, "err", err)
	}
}
