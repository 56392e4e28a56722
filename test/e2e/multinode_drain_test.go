package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// cordon marks the node unschedulable (or schedulable again), as kubectl cordon/uncordon do.
func (m *MultiNode) cordon(t testing.TB, node string, unschedulable bool) {
	t.Helper()
	patch := fmt.Sprintf(`{"spec":{"unschedulable":%v}}`, unschedulable)
	if _, err := m.CP.Client.CoreV1().Nodes().Patch(context.Background(), node, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatalf("cordon %s=%v: %v", node, unschedulable, err)
	}
}

// evict asks the eviction API to evict the pod, as kubectl drain does.
func (m *MultiNode) evict(pod string) error {
	return m.CP.Client.PolicyV1().Evictions(metav1.NamespaceDefault).Evict(context.Background(),
		&policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: pod, Namespace: metav1.NamespaceDefault}})
}

// testMultiNodeDrain: the A100 node, running both replicas of a Deployment's shares under a
// PodDisruptionBudget (minAvailable 1), is drained. Expectation: the first eviction is granted, the
// second refused (429, the budget) while the first one's replacement is not yet Ready; `kubectl
// drain` then evicts the rest as the budget allows; every replacement runs on the H100 node with its
// cap, the drained node's agent holds nothing and the cordoned node gets no new placement.
func testMultiNodeDrain(t *testing.T, m *MultiNode) {
	c := m.Node(t, NodeCPU)
	ctx := context.Background()
	two := int32(2)
	tmpl := shareTemplate("train", "8Gi")
	dep := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: "train", Namespace: metav1.NamespaceDefault},
		Spec: appsv1.DeploymentSpec{Replicas: &two, Selector: &metav1.LabelSelector{MatchLabels: tmpl.Labels}, Template: tmpl}}
	minAvailable := intstr.FromInt32(1)
	pdb := &policyv1.PodDisruptionBudget{ObjectMeta: metav1.ObjectMeta{Name: "train", Namespace: metav1.NamespaceDefault},
		Spec: policyv1.PodDisruptionBudgetSpec{MinAvailable: &minAvailable, Selector: dep.Spec.Selector}}

	// Both replicas on the A100 node: the H100 node is cordoned while they are placed.
	m.cordon(t, NodeH100, true)
	// Cleanups run last-registered first: the Deployment goes before the Reset deletes its pods.
	t.Cleanup(func() {
		m.cordon(t, NodeH100, false)
		m.cordon(t, NodeA100, false)
	})
	if _, err := m.CP.Client.PolicyV1().PodDisruptionBudgets(metav1.NamespaceDefault).Create(ctx, pdb, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		m.CP.Client.PolicyV1().PodDisruptionBudgets(metav1.NamespaceDefault).Delete(ctx, "train", metav1.DeleteOptions{})
	})
	if _, err := m.CP.Client.AppsV1().Deployments(metav1.NamespaceDefault).Create(ctx, dep, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		m.CP.Client.AppsV1().Deployments(metav1.NamespaceDefault).Delete(ctx, "train", metav1.DeleteOptions{})
	})
	first := m.boundPods(t, "app=train", 2)
	m.placedOn(t, map[string]string{first[0].Name: NodeA100, first[1].Name: NodeA100})
	// The disruption controller has seen both Ready.
	err := waitFor(time.Minute, 300*time.Millisecond, func() (bool, error) {
		p, err := m.CP.Client.PolicyV1().PodDisruptionBudgets(metav1.NamespaceDefault).Get(ctx, "train", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return p.Status.DisruptionsAllowed == 1, fmt.Errorf("PDB status %+v", p.Status)
	})
	if err != nil {
		t.Fatal(err)
	}

	m.cordon(t, NodeH100, false)
	m.cordon(t, NodeA100, true)
	drained := time.Now()
	if err := m.evict(first[0].Name); err != nil {
		t.Fatalf("evict %s with one disruption allowed: %v", first[0].Name, err)
	}
	// The eviction API took the one allowed disruption; the budget is back only when the
	// replacement is Ready, which takes the scheduler, the kubelet and the agent seconds.
	if err := m.evict(first[1].Name); !apierrors.IsTooManyRequests(err) || !strings.Contains(err.Error(), "disruption budget") {
		t.Errorf("evict %s while its sibling's replacement is not Ready: %v, want 429 naming the disruption budget", first[1].Name, err)
	}
	out, err := c.Kubectl(t, "drain", NodeA100, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=150s")
	if err != nil {
		t.Fatalf("kubectl drain %s: %v\n%s", NodeA100, err, out)
	}
	t.Logf("kubectl drain %s (%.1fs after the first eviction):\n%s", NodeA100, time.Since(drained).Seconds(), out)

	repl := m.boundPods(t, "app=train", 2)
	want := map[string]string{}
	for _, p := range repl {
		if p.Name == first[0].Name || p.Name == first[1].Name {
			t.Fatalf("%s is still bound after the drain", p.Name)
		}
		want[p.Name] = NodeH100
	}
	m.placedOn(t, want)
	t.Logf("both replacements run on %s %.1fs after the first eviction", NodeH100, time.Since(drained).Seconds())
	checkShareCUDA(t, m.Node(t, NodeH100), repl[0].Name, 8<<30)
	m.Node(t, NodeA100).WaitLedgerEmpty(t)
	// The cordoned node takes nothing new, even a pod only it fits.
	c.CreatePod(t, TestPod("drain-a100", map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "8Gi"},
		map[string]string{api.AnnotationGPUModel: m.model(t, NodeA100)}))
	t.Logf("drain-a100 on the cordoned node: %s", c.WaitUnschedulable(t, "drain-a100", "unschedulable"))
}
