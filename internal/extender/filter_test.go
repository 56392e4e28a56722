package extender

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

func newTestExtender(t testing.TB, policy string) *Extender {
	t.Helper()
	eng, err := placement.NewEngine(policy)
	if err != nil {
		t.Fatal(err)
	}
	// The test pods name no scheduler: the API server's default, which the test extender serves.
	return &Extender{Engine: eng, State: NewState(DefaultTTL, nil), Class: ClassOptions{AllowPolicyOverride: true}, SchedulerNames: []string{corev1.DefaultSchedulerName}}
}

// DefaultTTL is the reservation TTL used in tests.
const DefaultTTL = configv1.DefaultReservationTTL

func TestFilterReasons(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	// n1: 2 GPUs, each half used by a 8 GiB share: 16 GiB free in total but no GPU holds 10 GiB.
	x.State.UpsertNode(testNode(testInventory("n1", 1, 2, "V100M16"), nil))
	x.State.UpsertPod(assigned(sharePod("a", 1, 8, 0), "n1", api.DeviceAssignment{UUID: gpuUUID(1, 0), MemoryBytes: 8 << 30}), x.Class)
	x.State.UpsertPod(assigned(sharePod("b", 1, 8, 0), "n1", api.DeviceAssignment{UUID: gpuUUID(1, 1), MemoryBytes: 8 << 30}), x.Class)
	// n2: 2 GPUs, one whole-owned and one with a share: nothing offered whole.
	x.State.UpsertNode(testNode(testInventory("n2", 2, 2, "T4"), map[string]string{api.LabelPool: "inference"}))
	x.State.UpsertPod(assigned(wholePod("c", 1), "n2", api.DeviceAssignment{UUID: gpuUUID(2, 0), Whole: true}), x.Class)
	x.State.UpsertPod(assigned(sharePod("d", 1, 2, 10), "n2", api.DeviceAssignment{UUID: gpuUUID(2, 1), MemoryBytes: 2 << 30, CoresPercent: 10}), x.Class)
	// n3: empty 4 GPUs; n4: no inventory.
	x.State.UpsertNode(testNode(testInventory("n3", 3, 4, "V100M32"), nil))
	x.State.UpsertNode(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n4"}})
	names := []string{"n1", "n2", "n3", "n4", "n5"}

	withModel := sharePod("model", 1, 1, 0)
	withModel.Annotations[api.AnnotationGPUModel] = "T4|V100M16"
	pooled := wholePod("pooled", 1)
	pooled.Spec.NodeSelector = map[string]string{api.LabelPool: "training"}
	badCores := testPod("bad", corev1.ResourceList{api.ResourceShare: resource.MustParse("1"), api.ResourceShareMemory: resource.MustParse("1Gi"), api.ResourceShareCores: resource.MustParse("150")})
	cases := []struct {
		name   string
		pod    *corev1.Pod
		fit    []string
		reason map[string]string // node -> substring of its reason
		// unres are nodes no preemption can help (FailedAndUnresolvableNodes); resolvable ones are in
		// FailedNodes (freeing capacity there could make room).
		unres, resolvable []string
	}{
		{"share looks sufficient", sharePod("p1", 1, 15, 0), []string{"n3"}, map[string]string{
			"n1": "only 0 GPUs can take one (free in total: 16384 MiB", "n2": "only 0 GPUs", "n4": "publishes no GPU inventory", "n5": "not known"}, nil, []string{"n1", "n2"}},
		{"two shares need two GPUs", sharePod("p2", 2, 4, 0), []string{"n1", "n3"}, map[string]string{"n2": "needs 2 shares"}, nil, nil},
		{"whole GPUs locked to shares", wholePod("p3", 1), []string{"n3"}, map[string]string{"n1": "0 are free, 2 are locked to shares", "n2": "1 are locked to shares, 1 are held whole"}, nil, nil},
		{"too many GPUs", wholePod("p4", 3), []string{"n3"}, map[string]string{"n1": "node has 2 usable"}, nil, nil},
		{"model constraint", withModel, []string{"n1", "n2"}, map[string]string{"n3": "restricted to GPU models T4|V100M16, node has V100M32"}, nil, nil},
		{"pool", pooled, nil, map[string]string{"n3": `pod asks for pool "training"`, "n2": `node is in GPU pool "inference"`}, []string{"n2", "n3"}, nil},
		{"invalid request", badCores, nil, map[string]string{"n3": "must be between 1 and 100"}, names, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			res := x.Filter(&extenderv1.ExtenderArgs{Pod: tc.pod, NodeNames: &names})
			if res.NodeNames == nil || strings.Join(*res.NodeNames, ",") != strings.Join(tc.fit, ",") {
				t.Fatalf("fit = %v, want %v (failed %v / %v)", res.NodeNames, tc.fit, res.FailedNodes, res.FailedAndUnresolvableNodes)
			}
			for node, want := range tc.reason {
				got := res.FailedNodes[node] + res.FailedAndUnresolvableNodes[node]
				if !strings.Contains(got, want) {
					t.Errorf("node %s: reason %q does not contain %q", node, got, want)
				}
			}
			for _, node := range tc.unres {
				if _, ok := res.FailedAndUnresolvableNodes[node]; !ok || res.FailedNodes[node] != "" {
					t.Errorf("node %s: not (only) in FailedAndUnresolvableNodes: %q / %q", node, res.FailedNodes[node], res.FailedAndUnresolvableNodes[node])
				}
			}
			for _, node := range tc.resolvable {
				if _, ok := res.FailedNodes[node]; !ok || res.FailedAndUnresolvableNodes[node] != "" {
					t.Errorf("node %s: not (only) in FailedNodes: %q / %q", node, res.FailedNodes[node], res.FailedAndUnresolvableNodes[node])
				}
			}
		})
	}
}

func TestQuota(t *testing.T) {
	x := newTestExtender(t, api.PolicyBinpack)
	x.State.UpsertNode(testNode(testInventory("n1", 1, 4, "T4"), nil))
	x.State.UpsertPod(assigned(wholePod("held", 2), "n1", api.DeviceAssignment{UUID: gpuUUID(1, 0), Whole: true}, api.DeviceAssignment{UUID: gpuUUID(1, 1), Whole: true}), x.Class)
	q := &corev1.ResourceQuota{ObjectMeta: metav1.ObjectMeta{Name: "gpus", Namespace: "default"},
		Spec: corev1.ResourceQuotaSpec{Hard: corev1.ResourceList{"requests." + api.ResourceGPU: resource.MustParse("3")}}}
	x.Quotas = func(string) []*corev1.ResourceQuota { return []*corev1.ResourceQuota{q} }
	names := []string{"n1"}
	if res := x.Filter(&extenderv1.ExtenderArgs{Pod: wholePod("one", 1), NodeNames: &names}); len(*res.NodeNames) != 1 {
		t.Fatalf("1 more GPU is within quota: %+v", res)
	}
	res := x.Filter(&extenderv1.ExtenderArgs{Pod: wholePod("two", 2), NodeNames: &names})
	if len(*res.NodeNames) != 0 || !strings.Contains(res.FailedNodes["n1"], "requests.nvidia.com/gpu would be 4, hard limit 3") {
		t.Fatalf("2 more GPUs exceed the quota: %+v", res)
	}
}

func TestPrioritizeOrdering(t *testing.T) {
	names := []string{"empty", "half"}
	setup := func(policy string) *Extender {
		x := newTestExtender(t, policy)
		x.State.UpsertNode(testNode(testInventory("empty", 1, 4, "T4"), nil))
		x.State.UpsertNode(testNode(testInventory("half", 2, 4, "T4"), nil))
		x.State.UpsertPod(assigned(wholePod("w", 2), "half", api.DeviceAssignment{UUID: gpuUUID(2, 0), Whole: true}, api.DeviceAssignment{UUID: gpuUUID(2, 1), Whole: true}), x.Class)
		return x
	}
	cases := []struct{ policy, best string }{
		{api.PolicyBinpack, "half"}, {api.PolicySpread, "empty"}, {api.PolicyBestFit, "half"},
	}
	for _, tc := range cases {
		t.Run(tc.policy, func(t *testing.T) {
			x := setup(tc.policy)
			list, err := x.Prioritize(&extenderv1.ExtenderArgs{Pod: wholePod("p", 1), NodeNames: &names})
			if err != nil {
				t.Fatal(err)
			}
			best := (*list)[0]
			for _, h := range *list {
				if h.Score > best.Score {
					best = h
				}
			}
			if best.Host != tc.best || best.Score != extenderv1.MaxExtenderPriority {
				t.Fatalf("scores %+v, want %s best", *list, tc.best)
			}
		})
	}
	// The per-pod override beats the configured policy.
	x := setup(api.PolicyBinpack)
	pod := wholePod("p", 1)
	pod.Annotations[api.AnnotationPolicy] = api.PolicySpread
	list, _ := x.Prioritize(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names})
	if (*list)[0].Score != 10 || (*list)[1].Score != 0 {
		t.Fatalf("spread override: %+v", *list)
	}
}

func TestTopologyClosePair(t *testing.T) {
	n := placement.NewNodeState(testInventory("n", 1, 4, "A100"), nil)
	n.GPUs[0].Whole = true // GPU 0 taken: the NVLink pair left is 2-3, not 1-2
	r := &placement.Request{Containers: []placement.ContainerShape{{Name: "main", Whole: 2}}}
	c, u := placement.Candidates(n, r)
	if u != nil || len(c) != 1 || c[0].Devices[0].GPU != 2 || c[0].Devices[1].GPU != 3 {
		t.Fatalf("candidates %+v %v, want GPUs 2 and 3", c, u)
	}
}

func TestStateRebuildAndRelease(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	pod := assigned(sharePod("s", 1, 4, 50), "n1", api.DeviceAssignment{UUID: gpuUUID(1, 0), MemoryBytes: 4 << 30, CoresPercent: 50})
	x.State.UpsertPod(pod, x.Class) // the pod arrives before its node: applied when the node shows up
	x.State.UpsertNode(testNode(testInventory("n1", 1, 1, "T4"), nil))
	check := func(wantMilli int) {
		t.Helper()
		x.State.View([]string{"n1"}, func(_ string, n *placement.NodeState, _ string) {
			if got := n.GPUs[0].UsedMilli; got != wantMilli {
				t.Fatalf("used milli %d, want %d", got, wantMilli)
			}
		})
	}
	check(500)
	done := pod.DeepCopy()
	done.Status.Phase = corev1.PodSucceeded
	x.State.UpsertPod(done, x.Class)
	check(0)
}

// An mdev parent GPU is never given whole or shared, and an assignment written on a pod that asks
// for no GPU (a forged annotation) holds nothing.
func TestMdevParentsAndForgedAssignments(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	inv := testInventory("n1", 1, 2, "A100")
	inv.GPUs[1].Mdev = []api.MdevType{{Name: "A100-4C", ID: "nvidia-500", Available: 10}}
	x.State.UpsertNode(testNode(inv, nil))
	forged := testPod("forged", corev1.ResourceList{})
	forged = assigned(forged, "n1", api.DeviceAssignment{UUID: gpuUUID(1, 0), Whole: true})
	x.State.UpsertPod(forged, x.Class)
	names := []string{"n1"}
	// GPU 0 is free despite the forged whole assignment; GPU 1 is an mdev parent: one GPU fits.
	if res := x.Filter(&extenderv1.ExtenderArgs{Pod: wholePod("one", 1), NodeNames: &names}); res.NodeNames == nil || len(*res.NodeNames) != 1 {
		t.Errorf("one whole GPU: fit %v failed %v", res.NodeNames, res.FailedNodes)
	}
	if res := x.Filter(&extenderv1.ExtenderArgs{Pod: sharePod("two", 2, 1, 0), NodeNames: &names}); res.NodeNames != nil && len(*res.NodeNames) != 0 {
		t.Errorf("two shares fit a node with one GPU usable for shares: %v", *res.NodeNames)
	}
}
