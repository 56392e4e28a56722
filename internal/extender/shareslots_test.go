package extender

import (
	"context"
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestShareSlotsPerGPU: the node agent offers SharesPerGPU share tokens per GPU and refuses the
// container of one more share (the multi-node e2e saw 26 small shares put on one A100 and pods stuck
// in CreateContainerError), so Filter and Bind refuse a node whose GPUs all hold that many shares,
// however much memory and compute is left, naming the limit, and place on a GPU with a slot free.
func TestShareSlotsPerGPU(t *testing.T) {
	inv := testInventory("n1", 1, 2, "T4")
	inv.SharesPerGPU = 2
	node := testNode(inv, nil)
	// GPU 0 holds two 1 GiB shares (full); GPU 1 holds one or two.
	held := func(gpu1 int) []runtime.Object {
		var objs []runtime.Object
		for i, g := range append([]int{0, 0}, make([]int, gpu1)...) {
			if i >= 2 {
				g = 1
			}
			objs = append(objs, assigned(sharePod(fmt.Sprintf("h%d", i), 1, 1, 1), "n1",
				api.DeviceAssignment{UUID: gpuUUID(1, g), MemoryBytes: 1 << 30, CoresPercent: 1}))
		}
		return objs
	}
	names := []string{"n1"}
	bind := func(x *Extender, pod *corev1.Pod) error {
		return x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: pod.Name, PodNamespace: "default", PodUID: pod.UID, Node: "n1"})
	}

	t.Run("all GPUs full", func(t *testing.T) {
		pod := sharePod("new", 1, 1, 1)
		objs := held(2)
		cs, _ := fakeAPI(t, append(objs, node, pod)...)
		x := newBinder(t, cs, "a", node)
		for _, o := range objs {
			x.State.UpsertPod(o.(*corev1.Pod), x.Class)
		}
		res := x.Filter(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names})
		reason := res.FailedNodes["n1"] + res.FailedAndUnresolvableNodes["n1"]
		if res.NodeNames != nil && len(*res.NodeNames) > 0 || !strings.Contains(reason, "2 GPUs hold the most shares the node offers per GPU (2)") {
			t.Fatalf("Filter: fit %v, reason %q; want n1 refused naming the limit of 2", res.NodeNames, reason)
		}
		if err := bind(x, pod); err == nil || !strings.Contains(err.Error(), "the most shares the node offers per GPU (2)") {
			t.Fatalf("Bind onto full GPUs: %v, want a refusal naming the limit", err)
		}
	})

	t.Run("a slot free on GPU 1", func(t *testing.T) {
		pod := sharePod("new", 1, 1, 1)
		objs := held(1)
		cs, _ := fakeAPI(t, append(objs, node, pod)...)
		x := newBinder(t, cs, "a", node)
		for _, o := range objs {
			x.State.UpsertPod(o.(*corev1.Pod), x.Class)
		}
		if res := x.Filter(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names}); res.NodeNames == nil || len(*res.NodeNames) != 1 {
			t.Fatalf("Filter: fit %v (failed %v / %v), want n1", res.NodeNames, res.FailedNodes, res.FailedAndUnresolvableNodes)
		}
		if err := bind(x, pod); err != nil {
			t.Fatal(err)
		}
		got, err := cs.CoreV1().Pods("default").Get(context.Background(), pod.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		a, err := api.DecodeAssignment([]byte(got.Annotations[api.AnnotationAssignment]))
		if err != nil {
			t.Fatal(err)
		}
		if d := a.Containers[0].Devices; len(d) != 1 || d[0].UUID != gpuUUID(1, 1) {
			t.Fatalf("bound onto %+v, want GPU 1 (GPU 0 holds its 2 shares)", d)
		}
	})
}
