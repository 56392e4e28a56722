package extender

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/strategicpatch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/record"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// fakeAPI is a fake clientset made to behave like the API server where the bind protocol relies
// on it: Lease updates are compare-and-swaps on resourceVersion (the fake tracker does not check
// versions, so a reactor does), and pods/binding sets spec.nodeName (optionally failing).
func fakeAPI(t *testing.T, objs ...runtime.Object) (*fake.Clientset, *bool) {
	cs := fake.NewClientset(objs...)
	var mu sync.Mutex
	rv := 0
	failBind := new(bool)
	leases := schema.GroupVersionResource{Group: "coordination.k8s.io", Version: "v1", Resource: "leases"}
	cs.PrependReactor("create", "leases", func(a k8stesting.Action) (bool, runtime.Object, error) {
		mu.Lock()
		defer mu.Unlock()
		l := a.(k8stesting.CreateAction).GetObject().(*coordinationv1.Lease).DeepCopy()
		rv++
		l.ResourceVersion = strconv.Itoa(rv)
		if err := cs.Tracker().Create(leases, l, l.Namespace); err != nil {
			return true, nil, err
		}
		return true, l, nil
	})
	cs.PrependReactor("update", "leases", func(a k8stesting.Action) (bool, runtime.Object, error) {
		mu.Lock()
		defer mu.Unlock()
		l := a.(k8stesting.UpdateAction).GetObject().(*coordinationv1.Lease).DeepCopy()
		cur, err := cs.Tracker().Get(leases, l.Namespace, l.Name)
		if err != nil {
			return true, nil, err
		}
		if cur.(*coordinationv1.Lease).ResourceVersion != l.ResourceVersion {
			return true, nil, apierrors.NewConflict(leases.GroupResource(), l.Name, fmt.Errorf("resourceVersion %s is stale", l.ResourceVersion))
		}
		rv++
		l.ResourceVersion = strconv.Itoa(rv)
		return true, l, cs.Tracker().Update(leases, l, l.Namespace)
	})
	// Pods: every write gives the pod a new resourceVersion; a merge patch that carries one is a
	// compare-and-swap on it, and a Binding is refused for a bound pod or another UID, as the API
	// server refuses them (Conflict).
	podsGVR := corev1.SchemeGroupVersion.WithResource("pods")
	cs.PrependReactor("patch", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		pa := a.(k8stesting.PatchAction)
		if a.GetSubresource() != "" || pa.GetPatchType() != types.MergePatchType {
			return false, nil, nil
		}
		var pre struct {
			Metadata struct {
				ResourceVersion *string `json:"resourceVersion"`
			} `json:"metadata"`
		}
		if err := json.Unmarshal(pa.GetPatch(), &pre); err != nil {
			return true, nil, apierrors.NewBadRequest(err.Error())
		}
		mu.Lock()
		defer mu.Unlock()
		obj, err := cs.Tracker().Get(podsGVR, pa.GetNamespace(), pa.GetName())
		if err != nil {
			return true, nil, err
		}
		cur := obj.(*corev1.Pod)
		if v := pre.Metadata.ResourceVersion; v != nil && *v != "" && *v != cur.ResourceVersion {
			return true, nil, apierrors.NewConflict(podsGVR.GroupResource(), cur.Name, fmt.Errorf("resourceVersion %s is stale (now %s)", *v, cur.ResourceVersion))
		}
		orig, err := json.Marshal(cur)
		if err != nil {
			return true, nil, err
		}
		merged, err := strategicpatch.StrategicMergePatch(orig, pa.GetPatch(), corev1.Pod{})
		if err != nil {
			return true, nil, apierrors.NewBadRequest(err.Error())
		}
		next := &corev1.Pod{}
		if err := json.Unmarshal(merged, next); err != nil {
			return true, nil, err
		}
		rv++
		next.ResourceVersion = strconv.Itoa(rv)
		return true, next, cs.Tracker().Update(podsGVR, next, next.Namespace)
	})
	cs.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() != "binding" {
			return false, nil, nil
		}
		if *failBind {
			return true, nil, fmt.Errorf("injected binding failure")
		}
		b := a.(k8stesting.CreateAction).GetObject().(*corev1.Binding)
		mu.Lock()
		defer mu.Unlock()
		obj, err := cs.Tracker().Get(podsGVR, b.Namespace, b.Name)
		if err != nil {
			return true, nil, err
		}
		p := obj.(*corev1.Pod).DeepCopy()
		if b.UID != "" && b.UID != p.UID {
			return true, nil, apierrors.NewConflict(podsGVR.GroupResource(), p.Name, fmt.Errorf("precondition failed: UID %s, the pod's is %s", b.UID, p.UID))
		}
		if p.Spec.NodeName != "" {
			return true, nil, apierrors.NewConflict(podsGVR.GroupResource(), p.Name, fmt.Errorf("pod %s is already assigned to node %q", p.Name, p.Spec.NodeName))
		}
		p.Spec.NodeName = b.Target.Name
		rv++
		p.ResourceVersion = strconv.Itoa(rv)
		return true, b, cs.Tracker().Update(podsGVR, p, p.Namespace)
	})
	return cs, failBind
}

func newBinder(t *testing.T, cs *fake.Clientset, id string, node *corev1.Node) *Extender {
	x := newTestExtender(t, api.PolicyTessera)
	x.Client = cs
	x.Locker = &NodeLocker{Client: cs, Namespace: "kube-system", Identity: id, Duration: 15 * time.Second}
	x.State.UpsertNode(node)
	return x
}

// bindAndRead binds pod to node n1 through a new binder over a fake API holding node and pod, and
// returns the binder, the pod as the API server has it afterwards, and Bind's error.
func bindAndRead(t *testing.T, node *corev1.Node, pod *corev1.Pod) (*Extender, *corev1.Pod, error) {
	t.Helper()
	cs, _ := fakeAPI(t, node, pod)
	x := newBinder(t, cs, "a", node)
	err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: pod.Name, PodNamespace: "default", PodUID: pod.UID, Node: "n1"})
	got, gerr := cs.CoreV1().Pods("default").Get(context.Background(), pod.Name, metav1.GetOptions{})
	if gerr != nil {
		t.Fatal(gerr)
	}
	return x, got, err
}

func TestBindWritesAssignment(t *testing.T) {
	node := testNode(testInventory("n1", 1, 2, "T4"), nil)
	pod := sharePod("s", 2, 4, 30)
	cs, _ := fakeAPI(t, node, pod)
	x := newBinder(t, cs, "a", node)
	events := record.NewFakeRecorder(4)
	x.Events = events
	if err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: "s", PodNamespace: "default", PodUID: pod.UID, Node: "n1"}); err != nil {
		t.Fatal(err)
	}
	got, _ := cs.CoreV1().Pods("default").Get(context.Background(), "s", metav1.GetOptions{})
	a, err := api.DecodeAssignment([]byte(got.Annotations[api.AnnotationAssignment]))
	if err != nil {
		t.Fatal(err)
	}
	if got.Spec.NodeName != "n1" || a.Node != "n1" || len(a.Containers[0].Devices) != 2 || a.Containers[0].Devices[0].CoresPercent != 30 ||
		a.Containers[0].Devices[0].MemoryBytes != 4<<30 || got.Labels[api.LabelAssignedNode] != "n1" {
		t.Fatalf("pod after bind: node %q labels %v assignment %+v", got.Spec.NodeName, got.Labels, a)
	}
	if !x.State.Holds(pod.UID) {
		t.Fatal("bind left no reservation in the state")
	}
	// A Normal Event on the pod says which GPUs, how much memory and compute.
	d := a.Containers[0].Devices
	want := fmt.Sprintf("Normal GPUAssigned node n1: main: %s share 4Gi memory 30%% cores, %s share 4Gi memory 30%% cores", d[0].UUID, d[1].UUID)
	select {
	case e := <-events.Events:
		if e != want {
			t.Errorf("bind Event %q, want %q", e, want)
		}
	default:
		t.Error("no Event on bind")
	}
}

func TestBindFailureReleases(t *testing.T) {
	node := testNode(testInventory("n1", 1, 1, "T4"), nil)
	pod := wholePod("w", 1)
	cs, failBind := fakeAPI(t, node, pod)
	*failBind = true
	x := newBinder(t, cs, "a", node)
	if err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: "w", PodNamespace: "default", Node: "n1"}); err == nil {
		t.Fatal("bind should fail")
	}
	got, _ := cs.CoreV1().Pods("default").Get(context.Background(), "w", metav1.GetOptions{})
	if _, ok := got.Annotations[api.AnnotationAssignment]; ok || x.State.Holds(pod.UID) {
		t.Fatalf("failed bind kept its assignment: %v holds=%v", got.Annotations, x.State.Holds(pod.UID))
	}
	*failBind = false
	if err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: "w", PodNamespace: "default", Node: "n1"}); err != nil {
		t.Fatalf("the released GPU should be free again: %v", err)
	}
}

// TestConcurrentBindersNeverOvercommit races two independent extender instances (each its own
// State and NodeLocker identity, sharing only the fake API) binding 12 one-GPU pods onto a 4-GPU
// node: exactly 4 must land and no GPU may be given twice. The fake API stands in for the API
// server's resourceVersion checks through reactors (see fakeAPI); the same test against a real
// kube-apiserver belongs to the control-plane e2e suite.
func TestConcurrentBindersNeverOvercommit(t *testing.T) {
	node := testNode(testInventory("n1", 1, 4, "A100"), nil)
	objs := []runtime.Object{node}
	for i := 0; i < 12; i++ {
		objs = append(objs, wholePod(fmt.Sprintf("p%d", i), 1))
	}
	cs, _ := fakeAPI(t, objs...)
	binders := []*Extender{newBinder(t, cs, "replica-a", node), newBinder(t, cs, "replica-b", node)}
	var wg sync.WaitGroup
	var mu sync.Mutex
	ok := 0
	for i := 0; i < 12; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			err := binders[i%2].Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: fmt.Sprintf("p%d", i), PodNamespace: "default", Node: "n1"})
			if err == nil {
				mu.Lock()
				ok++
				mu.Unlock()
			}
		}(i)
	}
	wg.Wait()
	list, _ := cs.CoreV1().Pods("default").List(context.Background(), metav1.ListOptions{})
	owner := map[string]string{}
	for _, p := range list.Items {
		raw, has := p.Annotations[api.AnnotationAssignment]
		if !has {
			continue
		}
		a, err := api.DecodeAssignment([]byte(raw))
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range a.Containers[0].Devices {
			if prev, dup := owner[d.UUID]; dup {
				t.Fatalf("GPU %s given to %s and %s", d.UUID, prev, p.Name)
			}
			owner[d.UUID] = p.Name
		}
	}
	if ok != 4 || len(owner) != 4 {
		t.Fatalf("%d binds succeeded, %d GPUs assigned; want 4 and 4", ok, len(owner))
	}
}

// TestLockBackoff: a held Lease is retried after small waits growing from 4 ms to 20 ms, each up to
// a quarter longer, and the shared lockBackoff is not advanced by a Lock's copy of it.
func TestLockBackoff(t *testing.T) {
	b := lockBackoff
	nominal := []time.Duration{4 * time.Millisecond, 6 * time.Millisecond, 9 * time.Millisecond, 13500 * time.Microsecond, 20 * time.Millisecond, 20 * time.Millisecond, 20 * time.Millisecond}
	for i, n := range nominal {
		if d := b.Step(); d < n || d > n*5/4 {
			t.Errorf("try %d: wait %v, want %v to %v", i, d, n, n*5/4)
		}
	}
	if lockBackoff.Duration != 4*time.Millisecond {
		t.Errorf("lockBackoff advanced to %v", lockBackoff.Duration)
	}
}

// TestSecurityBindServesItsSchedulers: Bind binds only pods whose spec.schedulerName is one this
// extender serves; a call naming any other pod (another tenant's, one without GPUs that no filter
// ever saw) is refused and leaves it unbound.
func TestSecurityBindServesItsSchedulers(t *testing.T) {
	cpuOnly := testPod("cpu", corev1.ResourceList{})
	for _, tc := range []struct {
		name      string
		serves    []string
		scheduler string
		pod       *corev1.Pod
		bound     bool
	}{
		{"served", []string{"tessera-scheduler"}, "tessera-scheduler", wholePod("w", 1), true},
		{"empty is default-scheduler", []string{"tessera-scheduler", corev1.DefaultSchedulerName}, "", wholePod("w", 1), true},
		{"other scheduler", []string{"tessera-scheduler"}, "other-scheduler", wholePod("w", 1), false},
		{"default-scheduler not served, no GPU", []string{"tessera-scheduler"}, corev1.DefaultSchedulerName, cpuOnly, false},
		{"serves none", nil, "tessera-scheduler", wholePod("w", 1), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			node := testNode(testInventory("n1", 1, 1, "T4"), nil)
			pod := tc.pod.DeepCopy()
			pod.Spec.SchedulerName = tc.scheduler
			cs, _ := fakeAPI(t, node, pod)
			x := newBinder(t, cs, "a", node)
			x.SchedulerNames = tc.serves
			err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: pod.Name, PodNamespace: "default", PodUID: pod.UID, Node: "n1"})
			got, gerr := cs.CoreV1().Pods("default").Get(context.Background(), pod.Name, metav1.GetOptions{})
			if gerr != nil {
				t.Fatal(gerr)
			}
			if tc.bound {
				if err != nil || got.Spec.NodeName != "n1" {
					t.Fatalf("bind of a pod of a served scheduler: err %v, node %q", err, got.Spec.NodeName)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), "is not one this extender serves") {
				t.Fatalf("bind of a pod of scheduler %q (serving %q): err %v, want a refusal", tc.scheduler, tc.serves, err)
			}
			if got.Spec.NodeName != "" || got.Annotations[api.AnnotationAssignment] != "" || x.State.Holds(pod.UID) {
				t.Fatalf("refused bind left node %q assignment %q holds=%v", got.Spec.NodeName, got.Annotations[api.AnnotationAssignment], x.State.Holds(pod.UID))
			}
		})
	}
}
