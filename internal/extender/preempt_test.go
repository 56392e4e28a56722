package extender

import (
	"fmt"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestPreemptKeepsOnlyNodesWhereVictimsFreeTheRightGPU: two shares hold 60% of GPU 0 and GPU 1 on a
// 2-GPU node; evicting the share on GPU 0 alone frees no whole GPU, evicting both does.
func TestPreemptKeepsOnlyNodesWhereVictimsFreeTheRightGPU(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	for i, n := range []string{"n1", "n2"} {
		x.State.UpsertNode(testNode(testInventory(n, i+1, 2, "T4"), nil))
	}
	var victims []string
	for i, n := range []string{"n1", "n2"} {
		for g := range 2 {
			p := assigned(sharePod(n+"-s"+string(rune('0'+g)), 1, 2, 60), n,
				api.DeviceAssignment{UUID: gpuUUID(i+1, g), MemoryBytes: 2 << 30, CoresPercent: 60})
			x.State.UpsertPod(p, x.Class)
			victims = append(victims, string(p.UID))
		}
	}
	args := &extenderv1.ExtenderPreemptionArgs{Pod: wholePod("big", 1), NodeNameToMetaVictims: map[string]*extenderv1.MetaVictims{
		"n1": {Pods: []*extenderv1.MetaPod{{UID: victims[0]}}},                    // frees GPU 0 only
		"n2": {Pods: []*extenderv1.MetaPod{{UID: victims[2]}, {UID: victims[3]}}}, // frees both GPUs
	}}
	res := x.Preempt(args)
	if _, ok := res.NodeNameToMetaVictims["n2"]; !ok {
		t.Fatalf("n2's victims free two GPUs, node dropped: %v", res.NodeNameToMetaVictims)
	}
	if _, ok := res.NodeNameToMetaVictims["n1"]; !ok {
		t.Fatalf("n1's victim frees GPU 0, node dropped: %v", res.NodeNameToMetaVictims)
	}
	args.Pod = wholePod("bigger", 2)
	res = x.Preempt(args)
	if _, ok := res.NodeNameToMetaVictims["n1"]; ok {
		t.Fatal("n1 kept: evicting one share frees one GPU, the preemptor needs two")
	}
	if _, ok := res.NodeNameToMetaVictims["n2"]; !ok {
		t.Fatal("n2 dropped although its victims free both GPUs")
	}
}

// TestPreemptNamesTheVictimsThatFreeAGPU: GPU 0 holds a low-priority and a mid-priority 30% share,
// GPU 1 two mid-priority 50% shares. An 80% preemptor of high priority for whom the scheduler picked
// the low share (by tokens; it frees too little) gets the fewest pods that free a GPU, the cheapest
// of those: the low share and the mid share beside it (not GPU 1's two mid shares, which cost more);
// the same set where the scheduler had picked one of GPU 1's shares, which is then spared. A
// preemptor of priority between the two may evict only the low share: the node is dropped.
func TestPreemptNamesTheVictimsThatFreeAGPU(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	x.State.UpsertNode(testNode(testInventory("n1", 1, 2, "T4"), nil))
	uid := map[string]string{}
	for _, s := range []struct {
		name       string
		gpu, cores int
		priority   int32
	}{{"low", 0, 30, 100}, {"mid-z0", 0, 30, 1000}, {"mid-a1", 1, 50, 1000}, {"mid-b1", 1, 50, 1000}} {
		p := assigned(sharePod(s.name, 1, 2, s.cores), "n1", api.DeviceAssignment{UUID: gpuUUID(1, s.gpu), MemoryBytes: 2 << 30, CoresPercent: s.cores})
		p.Spec.Priority = &s.priority
		x.State.UpsertPod(p, x.Class)
		uid[s.name] = string(p.UID)
	}
	preemptor := func(priority int32) *extenderv1.ExtenderPreemptionArgs {
		p := sharePod("big", 1, 2, 80)
		p.Spec.Priority = &priority
		return &extenderv1.ExtenderPreemptionArgs{Pod: p, NodeNameToMetaVictims: map[string]*extenderv1.MetaVictims{
			"n1": {Pods: []*extenderv1.MetaPod{{UID: uid["low"]}}, NumPDBViolations: 0}}}
	}
	got := victimUIDs(t, x.Preempt(preemptor(10000)), "n1", "evicting the low and the mid share on GPU 0 frees it")
	if want := []string{uid["low"], uid["mid-z0"]}; !slices.Equal(got, want) {
		t.Fatalf("victims %v, want the scheduler's low share then mid-z0 %v", got, want)
	}
	args := preemptor(10000)
	args.NodeNameToMetaVictims["n1"].Pods = []*extenderv1.MetaPod{{UID: uid["mid-a1"]}}
	got = victimUIDs(t, x.Preempt(args), "n1", "the same pods free GPU 0 whichever the scheduler picked")
	if want := []string{uid["low"], uid["mid-z0"]}; !slices.Equal(got, want) {
		t.Fatalf("victims %v where the scheduler picked mid-a1, want %v", got, want)
	}
	if res := x.Preempt(preemptor(500)); len(res.NodeNameToMetaVictims) != 0 {
		t.Fatalf("a preemptor of priority 500 may evict only the low share, which frees too little: %v", res.NodeNameToMetaVictims)
	}
}

// TestPreemptNamesVictimsGreedilyPastTheSearchLimit: with more candidates than the subset search
// takes (16 low-priority half shares on 8 GPUs, pod i on GPU i mod 8), the pods are added lowest
// priority first, then by name, until a GPU is free (s00..s08: GPU 0), and those not needed are
// given back: s00 and s08 remain.
func TestPreemptNamesVictimsGreedilyPastTheSearchLimit(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	x.State.UpsertNode(testNode(testInventory("n1", 1, 8, "T4"), nil))
	var uids []string
	low := int32(100)
	for i := range 16 {
		p := assigned(sharePod(fmt.Sprintf("s%02d", i), 1, 1, 50), "n1", api.DeviceAssignment{UUID: gpuUUID(1, i%8), MemoryBytes: 1 << 30, CoresPercent: 50})
		p.Spec.Priority = &low
		x.State.UpsertPod(p, x.Class)
		uids = append(uids, string(p.UID))
	}
	if maxVictimSearch >= 16 {
		t.Fatalf("the case needs more candidates than maxVictimSearch (%d)", maxVictimSearch)
	}
	high := int32(1000)
	pod := wholePod("big", 1)
	pod.Spec.Priority = &high
	res := x.Preempt(&extenderv1.ExtenderPreemptionArgs{Pod: pod, NodeNameToMetaVictims: map[string]*extenderv1.MetaVictims{
		"n1": {Pods: []*extenderv1.MetaPod{{UID: uids[15]}}}}})
	got := victimUIDs(t, res, "n1", "evicting two shares of one GPU frees it")
	// The scheduler's victim (s15, GPU 7) frees nothing the preemptor needs and is given back too.
	if want := []string{uids[0], uids[8]}; !slices.Equal(got, want) {
		t.Fatalf("victims %v, want %v", got, want)
	}
}

// TestPreemptKeepsVictimsThatFreeCPU: the scheduler's victim holds no GPU but the CPU the
// preemptor needs; the extender keeps it and names the share whose GPU the preemptor needs beside it.
func TestPreemptKeepsVictimsThatFreeCPU(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	n := testNode(testInventory("n1", 1, 2, "T4"), nil)
	n.Status.Allocatable = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("8"), corev1.ResourceMemory: resource.MustParse("64Gi")}
	x.State.UpsertNode(n)
	low, high := int32(100), int32(1000)
	withCPU := func(p *corev1.Pod, cpu string) *corev1.Pod {
		p.Spec.Containers[0].Resources.Requests = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse(cpu)}
		p.Spec.Priority = &low
		return p
	}
	cpuOnly := withCPU(testPod("cpu-only", corev1.ResourceList{}), "6")
	cpuOnly.Spec.NodeName = "n1"
	x.State.UpsertPod(cpuOnly, x.Class)
	for g := range 2 {
		p := withCPU(assigned(sharePod(fmt.Sprintf("share-%d", g), 1, 1, 60), "n1", api.DeviceAssignment{UUID: gpuUUID(1, g), MemoryBytes: 1 << 30, CoresPercent: 60}), "1")
		x.State.UpsertPod(p, x.Class)
	}
	pod := withCPU(sharePod("big", 1, 1, 80), "4")
	pod.Spec.Priority = &high
	res := x.Preempt(&extenderv1.ExtenderPreemptionArgs{Pod: pod, NodeNameToMetaVictims: map[string]*extenderv1.MetaVictims{
		"n1": {Pods: []*extenderv1.MetaPod{{UID: string(cpuOnly.UID)}}}}})
	got := victimUIDs(t, res, "n1", "evicting cpu-only and one share frees 7 CPUs and a GPU")
	slices.Sort(got)
	if want := []string{"uid-cpu-only", "uid-share-0"}; !slices.Equal(got, want) {
		t.Fatalf("victims %v, want %v", got, want)
	}
}

// victimUIDs lists the victims the preemption result names on node (nil node entry: the test fails).
func victimUIDs(t *testing.T, res *extenderv1.ExtenderPreemptionResult, node, why string) []string {
	t.Helper()
	mv := res.NodeNameToMetaVictims[node]
	if mv == nil {
		t.Fatalf("%s dropped: %s", node, why)
	}
	var out []string
	for _, p := range mv.Pods {
		out = append(out, p.UID)
	}
	return out
}

// TestPreemptAvoidsBudgetViolations: GPU 0 holds one low-priority 60% share of app=db, GPU 1 two
// unlabelled 40% shares. Freeing GPU 0 evicts one pod, GPU 1 two. With a PodDisruptionBudget over
// app=db that allows no disruption, the two shares on GPU 1 are named (no violation: the budgets
// come before the count of pods, as in the scheduler's choice); once it allows one, or where the
// budget's pod is already disrupted, the single share; where every pod is covered and nothing
// allowed, the single share with its violation counted for the scheduler. A budget in another
// namespace or with an empty selector counts nothing.
func TestPreemptAvoidsBudgetViolations(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	x.State.UpsertNode(testNode(testInventory("n1", 1, 2, "T4"), nil))
	low, high := int32(100), int32(1000)
	pods := map[types.UID]*corev1.Pod{}
	uid := map[string]string{}
	for _, s := range []struct {
		name       string
		gpu, cores int
		app        string
	}{{"db", 0, 60, "db"}, {"b", 1, 40, ""}, {"c", 1, 40, ""}} {
		p := assigned(sharePod(s.name, 1, 2, s.cores), "n1", api.DeviceAssignment{UUID: gpuUUID(1, s.gpu), MemoryBytes: 2 << 30, CoresPercent: s.cores})
		p.Spec.Priority = &low
		if s.app != "" {
			p.Labels["app"] = s.app
		}
		x.State.UpsertPod(p, x.Class)
		pods[p.UID], uid[s.name] = p, string(p.UID)
	}
	x.PodByUID = func(u types.UID) *corev1.Pod { return pods[u] }
	budget := func(ns string, allowed int32, selector map[string]string, disrupted ...string) *policyv1.PodDisruptionBudget {
		b := &policyv1.PodDisruptionBudget{ObjectMeta: metav1.ObjectMeta{Name: "pdb", Namespace: ns},
			Spec:   policyv1.PodDisruptionBudgetSpec{Selector: &metav1.LabelSelector{MatchLabels: selector}},
			Status: policyv1.PodDisruptionBudgetStatus{DisruptionsAllowed: allowed, DisruptedPods: map[string]metav1.Time{}}}
		for _, d := range disrupted {
			b.Status.DisruptedPods[d] = metav1.Now()
		}
		return b
	}
	preempt := func(budgets ...*policyv1.PodDisruptionBudget) ([]string, int64) {
		t.Helper()
		x.PDBs = func() []*policyv1.PodDisruptionBudget { return budgets }
		pod := wholePod("big", 1)
		pod.Spec.Priority = &high
		res := x.Preempt(&extenderv1.ExtenderPreemptionArgs{Pod: pod, NodeNameToMetaVictims: map[string]*extenderv1.MetaVictims{
			"n1": {Pods: []*extenderv1.MetaPod{{UID: uid["b"]}}}}}) // by tokens; frees nothing whole
		return victimUIDs(t, res, "n1", "a GPU can be freed"), res.NodeNameToMetaVictims["n1"].NumPDBViolations
	}
	single, pair := []string{uid["db"]}, []string{uid["b"], uid["c"]}
	for _, c := range []struct {
		name       string
		budgets    []*policyv1.PodDisruptionBudget
		want       []string
		violations int64
	}{
		{"no budget", nil, single, 0},
		{"db protected", []*policyv1.PodDisruptionBudget{budget("default", 0, map[string]string{"app": "db"})}, pair, 0},
		{"one disruption allowed", []*policyv1.PodDisruptionBudget{budget("default", 1, map[string]string{"app": "db"})}, single, 0},
		{"db already disrupted", []*policyv1.PodDisruptionBudget{budget("default", 0, map[string]string{"app": "db"}, "db")}, single, 0},
		{"other namespace", []*policyv1.PodDisruptionBudget{budget("other", 0, map[string]string{"app": "db"})}, single, 0},
		{"empty selector", []*policyv1.PodDisruptionBudget{budget("default", 0, nil)}, single, 0},
		{"everything protected", []*policyv1.PodDisruptionBudget{budget("default", 0, map[string]string{"app": "db"}),
			{ObjectMeta: metav1.ObjectMeta{Name: "rest", Namespace: "default"},
				Spec: policyv1.PodDisruptionBudgetSpec{Selector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
					{Key: "app", Operator: metav1.LabelSelectorOpDoesNotExist}}}}}}, single, 1},
	} {
		got, v := preempt(c.budgets...)
		slices.Sort(got)
		want := slices.Clone(c.want)
		slices.Sort(want)
		if !slices.Equal(got, want) || v != c.violations {
			t.Errorf("%s: victims %v (%d violations), want %v (%d)", c.name, got, v, want, c.violations)
		}
	}
}
