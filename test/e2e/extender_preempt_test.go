package e2e

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	schedulingv1 "k8s.io/api/scheduling/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestExtenderPreemption: the real kube-scheduler asks the extender before it evicts (the chart's
// preemptVerb). The scheduler counts share tokens, not which GPU its victims free:
//   - where the victims it picks free no GPU the preemptor fits on, the extender drops the node
//     and nothing is evicted (without the verb the scheduler evicts a pod for nothing, and the
//     preemptor still cannot run: TestExtenderPreemption fails when the verb is left out);
//   - where they do, the victim goes and the preemptor is bound to the GPU it freed.
func TestExtenderPreemption(t *testing.T) {
	if chartExtender(t, "http://unused").PreemptVerb == "" {
		t.Fatal("the chart's scheduler config has no preemptVerb: preemption would evict without asking the extender")
	}
	s := startExtenderStack(t, nil)
	ctx := context.Background()
	for name, value := range map[string]int32{"e2e-low": 100, "e2e-mid": 1000, "e2e-high": 10000} {
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

	// Victims that free nothing. Two GPUs with two share tokens each: two low-priority 30% shares
	// on one GPU, two mid-priority 50% shares on the other; all four tokens taken. An 80% share of
	// high priority needs one token: the scheduler would evict one low pod, which leaves its GPU
	// at 30% used, 70% free.
	const useless = "useless"
	s.addNode(t, gpuNode{name: "useless-a", pool: useless, gpus: 2, memory: 40 * gib, sharesPerGPU: 2})
	create(gpuPod{name: "low-a", pool: useless, shares: 1, memory: gib, cores: 30, priority: "e2e-low"})
	create(gpuPod{name: "low-b", pool: useless, shares: 1, memory: gib, cores: 30, priority: "e2e-low"})
	s.waitBound(t, useless, []string{"low-a", "low-b"}, time.Minute)
	create(gpuPod{name: "mid-c", pool: useless, shares: 1, memory: gib, cores: 50, priority: "e2e-mid"})
	create(gpuPod{name: "mid-d", pool: useless, shares: 1, memory: gib, cores: 50, priority: "e2e-mid"})
	before := s.waitBound(t, useless, []string{"low-a", "low-b", "mid-c", "mid-d"}, time.Minute)
	s.checkAssignments(t, before, specs)
	if g := gpusOf(t, before); g["low-a"] != g["low-b"] || g["mid-c"] != g["mid-d"] || g["low-a"] == g["mid-c"] {
		t.Fatalf("the case needs the low pods on one GPU and the mid pods on the other: %v", g)
	}
	create(gpuPod{name: "high-80", pool: useless, shares: 1, memory: gib, cores: 80, priority: "e2e-high"})
	msg := s.waitUnschedulable(t, "high-80", "preemption")
	t.Logf("high-80: %s", msg)
	// The scheduler deletes its victims after the attempt (asynchronously): give it time to.
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(250 * time.Millisecond) {
		for _, name := range []string{"low-a", "low-b", "mid-c", "mid-d"} {
			if p, err := s.Client.CoreV1().Pods(s.ns).Get(ctx, name, metav1.GetOptions{}); err != nil || p.DeletionTimestamp != nil {
				t.Fatalf("pod %s was evicted for a preemptor it could not make room for (%v)\nextender log:\n%s",
					name, err, s.Extender.LogTail(30))
			}
		}
	}
	if p, err := s.Client.CoreV1().Pods(s.ns).Get(ctx, "high-80", metav1.GetOptions{}); err != nil || p.Spec.NodeName != "" || p.Status.NominatedNodeName != "" {
		t.Fatalf("high-80 should stay unbound and unnominated: %v %+v", err, p.Status)
	}

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
	after := s.waitBound(t, frees, []string{"high-80b", "mid-60"}, time.Minute)
	if _, err := s.Client.CoreV1().Pods(s.ns).Get(ctx, "low-60", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Fatalf("low-60 should have been evicted for high-80b: %v", err)
	}
	delete(specs, "low-60")
	if got := gpusOf(t, after)["high-80b"]; got != freed {
		t.Fatalf("high-80b is on GPU %s, want %s, the one low-60 freed", got, freed)
	}
	s.checkAssignments(t, append(after, s.poolPods(t, useless)...), specs)
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
