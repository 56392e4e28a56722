package main

import (
	"bytes"
	"fmt"
	"regexp"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

func uuid(i int) string { return fmt.Sprintf("GPU-00000001-0000-4000-8000-%012x", i) }

func node(t *testing.T) corev1.Node {
	inv := &api.NodeInventory{APIVersion: api.Version, Node: "n1", SharesPerGPU: 10}
	for i := 0; i < 3; i++ {
		inv.GPUs = append(inv.GPUs, api.GPU{UUID: uuid(i), Index: i, Model: "A100", MemoryBytes: 40 << 30, SMCount: 108,
			NUMANode: 0, PCIBusID: fmt.Sprintf("0000:%02x:00.0", i+1), Minor: i, Healthy: i != 2})
	}
	raw, err := api.EncodeInventory(inv)
	if err != nil {
		t.Fatal(err)
	}
	return corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1", Annotations: map[string]string{api.AnnotationInventory: string(raw)}}}
}

func pod(t *testing.T, name string, devs ...api.DeviceAssignment) corev1.Pod {
	a := &api.PodAssignment{APIVersion: api.Version, Node: "n1", Containers: []api.ContainerAssignment{{Name: "main", Devices: devs}}}
	raw, err := api.EncodeAssignment(a)
	if err != nil {
		t.Fatal(err)
	}
	return corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", Annotations: map[string]string{api.AnnotationAssignment: string(raw)}},
		Spec: corev1.PodSpec{NodeName: "n1"}, Status: corev1.PodStatus{Phase: corev1.PodRunning}}
}

// TestNodes: each GPU's mode, holders and free capacity, as the assignments say.
func TestNodes(t *testing.T) {
	pods := []corev1.Pod{
		pod(t, "a", api.DeviceAssignment{UUID: uuid(0), MemoryBytes: 10 << 30, CoresPercent: 30}),
		pod(t, "b", api.DeviceAssignment{UUID: uuid(0), MemoryBytes: 4 << 30, CoresPercent: 20}),
		pod(t, "w", api.DeviceAssignment{UUID: uuid(1), Whole: true}),
	}
	done := pod(t, "done", api.DeviceAssignment{UUID: uuid(2), Whole: true})
	done.Status.Phase = corev1.PodSucceeded
	pods = append(pods, done)
	var out bytes.Buffer
	if err := writeNodes(&out, []corev1.Node{node(t), {ObjectMeta: metav1.ObjectMeta{Name: "cpu-only"}}}, pods, nil); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`(?m)^NODE n1\s+3 GPUs, 10 shares per GPU$`,
		`(?m)^\s+0\s+` + uuid(0) + `\s+A100\s+40Gi\s+shared\s+26Gi, 50% cores, 8 shares\s+ns/a/main share 10Gi 30% cores; ns/b/main share 4Gi 20% cores$`,
		`(?m)^\s+1\s+` + uuid(1) + `\s+A100\s+40Gi\s+whole\s+-\s+ns/w/main whole$`,
		`(?m)^\s+2\s+` + uuid(2) + `\s+A100\s+40Gi\s+free \(unhealthy\)\s+whole or shares\s+-$`,
	} {
		if !regexp.MustCompile(want).MatchString(out.String()) {
			t.Errorf("output lacks %s:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "cpu-only") {
		t.Errorf("a node without inventory is listed:\n%s", out.String())
	}
	if err := writeNodes(&bytes.Buffer{}, []corev1.Node{{ObjectMeta: metav1.ObjectMeta{Name: "cpu-only"}}}, nil, nil); err == nil || !strings.Contains(err.Error(), "node agent") {
		t.Errorf("no inventory anywhere: %v, want an error pointing at the node agent", err)
	}
}

// TestPending: a GPU pod that waits shows the scheduler's message and Tessera's Warning Events; a
// pod without GPUs is left out.
func TestPending(t *testing.T) {
	gpu := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "big", Namespace: "ns"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "main", Resources: corev1.ResourceRequirements{
			Limits: corev1.ResourceList{api.ResourceShare: resource.MustParse("1"), api.ResourceShareMemory: resource.MustParse("48Gi")}}}}},
		Status: corev1.PodStatus{Phase: corev1.PodPending, Conditions: []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionFalse,
			Message: "0/1 nodes are available: 1 container \"main\" asks for 49152 MiB per share"}}}}
	cpu := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "cpu", Namespace: "ns"}, Status: corev1.PodStatus{Phase: corev1.PodPending}}
	ev := corev1.Event{InvolvedObject: corev1.ObjectReference{Kind: "Pod", Namespace: "ns", Name: "big"}, Type: corev1.EventTypeWarning,
		Reason: "GPUPlacementRefused", Message: "no GPU has 48Gi", Source: corev1.EventSource{Component: "tessera-extender"}}
	var out bytes.Buffer
	if err := writePending(&out, []corev1.Pod{gpu, cpu}, []corev1.Event{ev}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"ns/big\tPending\t(not scheduled)", "scheduler: 0/1 nodes are available: 1 container \"main\" asks for 49152 MiB per share",
		"GPUPlacementRefused (tessera-extender): no GPU has 48Gi"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "ns/cpu") {
		t.Errorf("a pod without GPUs is listed:\n%s", out.String())
	}
}
