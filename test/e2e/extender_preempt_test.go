package e2e

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	schedulingv1 "k8s.io/api/scheduling/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestExtenderPreemption: the real kube-scheduler asks the extender before it evicts (the chart's
// preemptVerb). The scheduler counts share tokens, not which GPU its victims free:
//   - where nothing the preemptor may evict frees a GPU it fits on, the extender drops the node and
//     nothing is evicted (without the verb the scheduler evicts a pod for nothing, and the
//     preemptor still cannot run);
//   - where the scheduler's victims free too little but other pods of lower priority would, the
//     extender names the fewest such pods, and the preemptor is bound to the GPU they free;
//   - where the scheduler's victims suffice, they go and the preemptor gets their GPU;
//   - where two sets free a GPU, the one that violates no PodDisruptionBudget is named.
func TestExtenderPreemption(t *testing.T) {
	if chartExtender(t, "http://unused").PreemptVerb == "" {
		t.Fatal("the chart's scheduler config has no preemptVerb: preemption would evict without asking the extender")
	}
	s := startExtenderStack(t, nil)
	ctx := context.Background()
	for name, value := range map[string]int32{"e2e-low": 100, "e2e-lowmid": 500, "e2e-mid": 1000, "e2e-high": 10000} {
		pc := &schedulingv1.PriorityClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Value: value}
		if _, err := s.Client.SchedulingV1().PriorityClasses().Create(ctx, pc, metav1.CreateOptions{}); err != nil {
			t.Fatalf("priority class %s: %v", name, err)
		}
	}
	specs := map[string]gpuPod{}
	create := func(p gpuPod) {
		specs[p.name] = p
		s.createPod(t, p)
	}
	gone := func(name string) bool {
		p, err := s.Client.CoreV1().Pods(s.ns).Get(ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err) || (err == nil && p.DeletionTimestamp != nil)
	}
	// evictedFor checks that the victims are gone (and forgets them) and that the preemptor, bound,
	// holds the GPU they freed.
	evictedFor := func(preemptor string, bound []corev1.Pod, gpu string, victims ...string) {
		t.Helper()
		for _, name := range victims {
			if !gone(name) {
				t.Fatalf("pod %s should have been evicted for %s", name, preemptor)
			}
			delete(specs, name)
		}
		if got := gpusOf(t, bound)[preemptor]; got != gpu {
			t.Fatalf("%s is on GPU %s, want %s, the one %v freed", preemptor, got, gpu, victims)
		}
	}

	// Two GPUs with two share tokens each: a low- and a mid-priority 30% share on one GPU, two
	// mid-priority 50% shares on the other; all four tokens taken. An 80% share needs one token, so
	// the scheduler picks the low share as its victim, which leaves that GPU 70% free.
	const pool = "tokens"
	s.addNode(t, gpuNode{name: "tokens-a", pool: pool, gpus: 2, memory: 40 * gib, sharesPerGPU: 2})
	create(gpuPod{name: "low-a", pool: pool, shares: 1, memory: gib, cores: 30, priority: "e2e-low"})
	s.waitBound(t, pool, []string{"low-a"}, time.Minute)
	create(gpuPod{name: "mid-b", pool: pool, shares: 1, memory: gib, cores: 30, priority: "e2e-mid"})
	s.waitBound(t, pool, []string{"low-a", "mid-b"}, time.Minute)
	create(gpuPod{name: "mid-c", pool: pool, shares: 1, memory: gib, cores: 50, priority: "e2e-mid"})
	create(gpuPod{name: "mid-d", pool: pool, shares: 1, memory: gib, cores: 50, priority: "e2e-mid"})
	before := s.waitBound(t, pool, []string{"low-a", "mid-b", "mid-c", "mid-d"}, time.Minute)
	s.checkAssignments(t, before, specs)
	layout := gpusOf(t, before)
	if layout["low-a"] != layout["mid-b"] || layout["mid-c"] != layout["mid-d"] || layout["low-a"] == layout["mid-c"] {
		t.Fatalf("the case needs low-a and mid-b on one GPU, mid-c and mid-d on the other: %v", layout)
	}

	// Priority 500 may evict only low-a, which frees too little: nothing is evicted.
	create(gpuPod{name: "lowmid-80", pool: pool, shares: 1, memory: gib, cores: 80, priority: "e2e-lowmid"})
	msg := s.waitUnschedulable(t, "lowmid-80", "preemption")
	t.Logf("lowmid-80: %s", msg)
	// The scheduler deletes its victims after the attempt (asynchronously): give it time to.
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(250 * time.Millisecond) {
		for _, name := range []string{"low-a", "mid-b", "mid-c", "mid-d"} {
			if gone(name) {
				t.Fatalf("pod %s was evicted for a preemptor it could not make room for\nextender log:\n%s", name, s.Extender.LogTail(30))
			}
		}
	}
	if p, err := s.Client.CoreV1().Pods(s.ns).Get(ctx, "lowmid-80", metav1.GetOptions{}); err != nil || p.Spec.NodeName != "" || p.Status.NominatedNodeName != "" {
		t.Fatalf("lowmid-80 should stay unbound and unnominated: %v %+v", err, p.Status)
	}
	if err := s.Client.CoreV1().Pods(s.ns).Delete(ctx, "lowmid-80", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	delete(specs, "lowmid-80")

	// Priority 10000 may evict all four: the fewest that free a GPU, the cheapest of those, are
	// low-a and mid-b (mid-c and mid-d would free the other GPU at a higher priority).
	create(gpuPod{name: "high-80", pool: pool, shares: 1, memory: gib, cores: 80, priority: "e2e-high"})
	after := s.waitBound(t, pool, []string{"high-80", "mid-c", "mid-d"}, time.Minute)
	evictedFor("high-80", after, layout["low-a"], "low-a", "mid-b")

	// Victims that free a GPU. One share token per GPU: a low-priority 60% share on one GPU, a
	// mid-priority 60% share on the other. The 80% share evicts the low pod and takes its GPU.
	const frees = "frees"
	s.addNode(t, gpuNode{name: "frees-a", pool: frees, gpus: 2, memory: 40 * gib, sharesPerGPU: 1})
	create(gpuPod{name: "low-60", pool: frees, shares: 1, memory: gib, cores: 60, priority: "e2e-low"})
	s.waitBound(t, frees, []string{"low-60"}, time.Minute)
	create(gpuPod{name: "mid-60", pool: frees, shares: 1, memory: gib, cores: 60, priority: "e2e-mid"})
	before = s.waitBound(t, frees, []string{"low-60", "mid-60"}, time.Minute)
	freed := gpusOf(t, before)["low-60"]
	create(gpuPod{name: "high-80b", pool: frees, shares: 1, memory: gib, cores: 80, priority: "e2e-high"})
	after = s.waitBound(t, frees, []string{"high-80b", "mid-60"}, time.Minute)
	evictedFor("high-80b", after, freed, "low-60")

	// A PodDisruptionBudget decides between two sets that free a GPU. db-60 (low, app=db) and x-30
	// (low) share one GPU, b-40 and c-40 (mid) the other; all four tokens taken. By tokens the
	// scheduler's victim is x-30 alone (it spares the budget's pod first), which frees too little;
	// the cheaper set that frees a GPU is db-60 and x-30, but db-60's budget allows no disruption,
	// so the extender names b-40 and c-40, and high-80c gets their GPU.
	const budget = "budget"
	one := intstr.FromInt32(1)
	pdb := &policyv1.PodDisruptionBudget{ObjectMeta: metav1.ObjectMeta{Name: "db", Namespace: s.ns},
		Spec: policyv1.PodDisruptionBudgetSpec{MinAvailable: &one, Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "db"}}}}
	if _, err := s.Client.PolicyV1().PodDisruptionBudgets(s.ns).Create(ctx, pdb, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	s.addNode(t, gpuNode{name: "budget-a", pool: budget, gpus: 2, memory: 40 * gib, sharesPerGPU: 2})
	create(gpuPod{name: "db-60", pool: budget, shares: 1, memory: gib, cores: 60, priority: "e2e-low", app: "db"})
	s.waitBound(t, budget, []string{"db-60"}, time.Minute)
	create(gpuPod{name: "x-30", pool: budget, shares: 1, memory: gib, cores: 30, priority: "e2e-low"})
	s.waitBound(t, budget, []string{"db-60", "x-30"}, time.Minute)
	create(gpuPod{name: "b-40", pool: budget, shares: 1, memory: gib, cores: 40, priority: "e2e-mid"})
	create(gpuPod{name: "c-40", pool: budget, shares: 1, memory: gib, cores: 40, priority: "e2e-mid"})
	before = s.waitBound(t, budget, []string{"db-60", "x-30", "b-40", "c-40"}, time.Minute)
	layout = gpusOf(t, before)
	if layout["db-60"] != layout["x-30"] || layout["b-40"] != layout["c-40"] || layout["db-60"] == layout["b-40"] {
		t.Fatalf("the case needs db-60 and x-30 on one GPU, b-40 and c-40 on the other: %v", layout)
	}
	create(gpuPod{name: "high-80c", pool: budget, shares: 1, memory: gib, cores: 80, priority: "e2e-high"})
	after = s.waitBound(t, budget, []string{"high-80c", "db-60", "x-30"}, time.Minute)
	evictedFor("high-80c", after, layout["b-40"], "b-40", "c-40") // not db-60: its budget allows no disruption
	s.checkAssignments(t, append(append(after, s.poolPods(t, pool)...), s.poolPods(t, frees)...), specs)
}

// gpusOf maps each bound one-share pod to the UUID of its GPU, from its assignment annotation.
func gpusOf(t *testing.T, pods []corev1.Pod) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, p := range pods {
		raw, ok := p.Annotations[api.AnnotationAssignment]
		if p.Spec.NodeName == "" || !ok {
			continue
		}
		a, err := api.DecodeAssignment([]byte(raw))
		if err != nil {
			t.Fatalf("pod %s: %v", p.Name, err)
		}
		if c := a.Container("main"); c != nil && len(c.Devices) == 1 {
			out[p.Name] = c.Devices[0].UUID
		}
	}
	return out
}
