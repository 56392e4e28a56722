package main

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"

	api "github.com/tessera-gpu/tessera/api/v1"
)

func uuid(node, i int) string { return fmt.Sprintf("GPU-00000001-0000-4000-8000-%06x%06x", node, i) }

// gpuNode is a node whose agent publishes an inventory of gpus A100s (index 2 unhealthy) and,
// when holdings is not nil, its holdings.
func gpuNode(t *testing.T, name string, n, gpus int, holdings []api.PodHolding) *corev1.Node {
	t.Helper()
	inv := &api.NodeInventory{APIVersion: api.Version, Node: name, SharesPerGPU: 10}
	for i := 0; i < gpus; i++ {
		inv.GPUs = append(inv.GPUs, api.GPU{UUID: uuid(n, i), Index: i, Model: "A100", MemoryBytes: 40 << 30, SMCount: 108,
			NUMANode: i / 2, PCIBusID: fmt.Sprintf("0000:%02x:00.0", i+1), Minor: i, Healthy: i != 2})
	}
	raw, err := api.EncodeInventory(inv)
	if err != nil {
		t.Fatal(err)
	}
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{api.AnnotationInventory: string(raw)}}}
	if holdings != nil {
		raw, err := api.EncodeHoldings(&api.NodeHoldings{Node: name, Pods: holdings})
		if err != nil {
			t.Fatal(err)
		}
		node.Annotations[api.AnnotationHoldings] = string(raw)
	}
	return node
}

// assigned is a running pod on node with the extender's assignment of devs to its container main.
func assigned(t *testing.T, name, node string, devs ...api.DeviceAssignment) *corev1.Pod {
	t.Helper()
	raw, err := api.EncodeAssignment(&api.PodAssignment{Node: node, Containers: []api.ContainerAssignment{{Name: "main", Devices: devs}}})
	if err != nil {
		t.Fatal(err)
	}
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", UID: types.UID("uid-" + name), Annotations: map[string]string{api.AnnotationAssignment: string(raw)}},
		Spec: corev1.PodSpec{NodeName: node}, Status: corev1.PodStatus{Phase: corev1.PodRunning}}
}

func held(name string, local bool, container string, devs ...api.DeviceAssignment) api.PodHolding {
	return api.PodHolding{Namespace: "ns", Pod: name, UID: "uid-" + name, Local: local,
		Containers: []api.ContainerAssignment{{Name: container, Devices: devs}}}
}

// cluster is two GPU nodes and a CPU node. On n1: GPU 0 shared by two assigned pods, GPU 1 whole
// to an assigned pod the agent also lists (one holder, not two), GPU 2 held by a prepared DRA
// claim and GPU 3 by a pod the agent placed itself (both only in the holdings), GPU 4 free; a
// finished pod's assignment holds nothing; a MIG pod. On n2: one whole GPU assigned.
func cluster(t *testing.T) []runtime.Object {
	t.Helper()
	done := assigned(t, "done", "n1", api.DeviceAssignment{UUID: uuid(1, 4), Whole: true})
	done.Status.Phase = corev1.PodSucceeded
	mig := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "mig", Namespace: "ns", UID: "uid-mig"}, Spec: corev1.PodSpec{NodeName: "n1",
		Containers: []corev1.Container{{Name: "main", Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{
			corev1.ResourceName(api.MIGResourcePrefix + "1g.5gb"): resource.MustParse("2")}}}}}, Status: corev1.PodStatus{Phase: corev1.PodRunning}}
	return []runtime.Object{
		gpuNode(t, "n1", 1, 5, []api.PodHolding{
			held("w", false, "main", api.DeviceAssignment{UUID: uuid(1, 1), Whole: true}),
			held("trainer", false, claimContainer+"gpu-claim", api.DeviceAssignment{UUID: uuid(1, 2), Whole: true}),
			held("loner", true, "main", api.DeviceAssignment{UUID: uuid(1, 3), MemoryBytes: 8 << 30, CoresPercent: 25}),
		}),
		gpuNode(t, "n2", 2, 1, []api.PodHolding{}),
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "cpu-only"}},
		assigned(t, "a", "n1", api.DeviceAssignment{UUID: uuid(1, 0), MemoryBytes: 10 << 30, CoresPercent: 30}),
		assigned(t, "b", "n1", api.DeviceAssignment{UUID: uuid(1, 0), MemoryBytes: 4 << 30, CoresPercent: 20}),
		assigned(t, "w", "n1", api.DeviceAssignment{UUID: uuid(1, 1), Whole: true}),
		done, mig,
		assigned(t, "x", "n2", api.DeviceAssignment{UUID: uuid(2, 0), Whole: true}),
	}
}

// TestNodes: per GPU, the mode, the holders and what is free, holdings included: a GPU a DRA claim
// or a local placement holds is held, not free; a node's pods are listed by spec.nodeName.
func TestNodes(t *testing.T) {
	kc := kubeconfig(t)
	r := execute(t, []string{"nodes", "n1", "--kubeconfig", kc}, cluster(t)...)
	if r.err != nil {
		t.Fatal(r.err)
	}
	for _, want := range []string{
		`(?m)^NODE n1\s+5 GPUs, 10 shares per GPU$`,
		`(?m)^\s+0\s+` + uuid(1, 0) + `\s+A100\s+40Gi\s+shared\s+26Gi, 50% cores, 8 shares\s+ns/a/main share 10Gi 30% cores; ns/b/main share 4Gi 20% cores$`,
		`(?m)^\s+1\s+` + uuid(1, 1) + `\s+A100\s+40Gi\s+whole\s+-\s+ns/w/main whole$`,
		`(?m)^\s+2\s+` + uuid(1, 2) + `\s+A100\s+40Gi\s+whole \(unhealthy\)\s+-\s+ns/trainer/resourceclaim/gpu-claim whole \(DRA claim\)$`,
		`(?m)^\s+3\s+` + uuid(1, 3) + `\s+A100\s+40Gi\s+shared\s+32Gi, 75% cores, 9 shares\s+ns/loner/main share 8Gi 25% cores \(local placement\)$`,
		`(?m)^\s+4\s+` + uuid(1, 4) + `\s+A100\s+40Gi\s+free\s+whole or shares\s+-$`,
		`(?m)^\s+-\s+hardware\s+ns/mig/main 2 x MIG 1g.5gb$`,
	} {
		if !regexp.MustCompile(want).MatchString(r.out) {
			t.Errorf("output lacks %s:\n%s", want, r.out)
		}
	}
	if strings.Contains(r.out, "n2") || strings.Contains(r.out, "cpu-only") {
		t.Errorf("nodes not asked for are listed:\n%s", r.out)
	}
	// Only n1's live pods are listed: not every pod in the cluster.
	if got, want := r.lists("pods"), `ns="" fields="spec.nodeName=n1,status.phase!=Failed,status.phase!=Succeeded"`; len(got) != 1 || got[0] != want {
		t.Errorf("pods lists %v, want [%s]", got, want)
	}
}

// TestNodesAll: without names, every node with an inventory, each node's pods listed alone; a node
// without one is left out; with more GPU nodes than podListPerNode, one list of scheduled pods.
func TestNodesAll(t *testing.T) {
	kc := kubeconfig(t)
	r := execute(t, []string{"--kubeconfig", kc}, cluster(t)...) // no command: nodes
	if r.err != nil {
		t.Fatal(r.err)
	}
	if !regexp.MustCompile(`(?m)^\s+0\s+`+uuid(2, 0)+`\s+A100\s+40Gi\s+whole\s+-\s+ns/x/main whole$`).MatchString(r.out) || !strings.Contains(r.out, "NODE n1") {
		t.Errorf("n1 and n2 not shown:\n%s", r.out)
	}
	if strings.Contains(r.out, "cpu-only") {
		t.Errorf("a node without inventory is listed:\n%s", r.out)
	}
	if got := r.lists("pods"); len(got) != 2 || !strings.Contains(got[0], "spec.nodeName=n1,") || !strings.Contains(got[1], "spec.nodeName=n2,") {
		t.Errorf("pods lists %v, want one per GPU node", got)
	}
	var many []runtime.Object
	for i := range podListPerNode + 1 {
		many = append(many, gpuNode(t, fmt.Sprintf("m%02d", i), 10+i, 1, []api.PodHolding{}), assigned(t, fmt.Sprintf("p%02d", i), fmt.Sprintf("m%02d", i), api.DeviceAssignment{UUID: uuid(10+i, 0), Whole: true}))
	}
	r = execute(t, []string{"nodes", "--kubeconfig", kc}, many...)
	if r.err != nil {
		t.Fatal(r.err)
	}
	if got := r.lists("pods"); len(got) != 1 || !strings.Contains(got[0], "spec.nodeName!=,") {
		t.Errorf("pods lists %v, want one list of scheduled pods", got)
	}
	if n := strings.Count(r.out, " whole\n"); n != podListPerNode+1 {
		t.Errorf("%d whole holders shown, want %d:\n%s", n, podListPerNode+1, r.out)
	}
}

// TestNodesHoldingsUnknown: a node whose agent publishes no holdings, or unreadable ones, shows
// free capacity as unknown (a DRA claim or local placement may hold any GPU); a named node without
// an inventory says so; an unknown node is an error; no inventory anywhere points at the agent.
func TestNodesHoldingsUnknown(t *testing.T) {
	kc := kubeconfig(t)
	none := gpuNode(t, "none", 3, 1, nil)
	bad := gpuNode(t, "bad", 4, 1, nil)
	bad.Annotations[api.AnnotationHoldings] = `{"apiVersion":"tessera.dev/v1","node":"elsewhere","pods":[]}`
	r := execute(t, []string{"nodes", "none", "bad", "cpu-only", "--kubeconfig", kc}, none, bad, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "cpu-only"}})
	if r.err != nil {
		t.Fatal(r.err)
	}
	for _, want := range []string{
		`(?m)^  free capacity unknown: the node agent publishes no holdings \(annotation tessera.dev/holdings\)`,
		`(?m)^  free capacity unknown: holdings unreadable: they name node "elsewhere"$`,
		`(?m)^\s+0\s+` + uuid(3, 0) + `\s+A100\s+40Gi\s+free\s+unknown\s+-$`,
		`(?m)^\s+0\s+` + uuid(4, 0) + `\s+A100\s+40Gi\s+free\s+unknown\s+-$`,
		`(?m)^NODE cpu-only\s+no Tessera inventory`,
	} {
		if !regexp.MustCompile(want).MatchString(r.out) {
			t.Errorf("output lacks %s:\n%s", want, r.out)
		}
	}
	if r := execute(t, []string{"nodes", "gone", "--kubeconfig", kc}); r.err == nil || !strings.Contains(r.err.Error(), `node gone: nodes "gone" not found`) {
		t.Errorf("unknown node: %v", r.err)
	}
	if r := execute(t, []string{"nodes", "--kubeconfig", kc}, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "cpu-only"}}); r.err == nil || !strings.Contains(r.err.Error(), "node agent") {
		t.Errorf("no inventory anywhere: %v, want an error pointing at the node agent", r.err)
	}
}

// TestNodesOutput: -o json and yaml print a List of GPUNode items with the holders and their
// sources; -o wide adds PCI bus and NUMA node.
func TestNodesOutput(t *testing.T) {
	kc := kubeconfig(t)
	r := execute(t, []string{"nodes", "n1", "-o", "json", "--kubeconfig", kc}, cluster(t)...)
	if r.err != nil {
		t.Fatal(r.err)
	}
	var list struct {
		Kind  string `json:"kind"`
		Items []struct {
			APIVersion string            `json:"apiVersion"`
			Kind       string            `json:"kind"`
			Metadata   map[string]string `json:"metadata"`
			Status     nodeView          `json:"status"`
		} `json:"items"`
	}
	if err := json.Unmarshal([]byte(r.out), &list); err != nil {
		t.Fatalf("%v:\n%s", err, r.out)
	}
	if list.Kind != "List" || len(list.Items) != 1 || list.Items[0].Kind != "GPUNode" || list.Items[0].APIVersion != api.Version || list.Items[0].Metadata["name"] != "n1" {
		t.Fatalf("not a List of one GPUNode n1:\n%s", r.out)
	}
	gpus := list.Items[0].Status.GPUs
	if len(gpus) != 5 || gpus[2].Mode != "whole" || gpus[2].Free != "-" || len(gpus[2].Holders) != 1 || gpus[2].Holders[0].Source != "claim" ||
		gpus[3].Holders[0].Source != "local" || gpus[1].Holders[0].Source != "assignment" || gpus[4].Mode != "free" {
		t.Errorf("GPUs as printed: %+v", gpus)
	}
	r = execute(t, []string{"nodes", "n1", "-o", "yaml", "--kubeconfig", kc}, cluster(t)...)
	for _, want := range []string{"kind: List", "kind: GPUNode", "source: claim", "uuid: " + uuid(1, 2)} {
		if r.err != nil || !strings.Contains(r.out, want) {
			t.Errorf("-o yaml lacks %q (%v):\n%s", want, r.err, r.out)
		}
	}
	r = execute(t, []string{"nodes", "n1", "-o", "wide", "--kubeconfig", kc}, cluster(t)...)
	if want := `(?m)^\s+3\s+` + uuid(1, 3) + `\s+A100\s+40Gi\s+0000:04:00.0\s+1\s+shared\s+`; r.err != nil || !regexp.MustCompile(want).MatchString(r.out) {
		t.Errorf("-o wide lacks %s (%v):\n%s", want, r.err, r.out)
	}
}
