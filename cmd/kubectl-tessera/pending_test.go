package main

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"

	api "github.com/tessera-gpu/tessera/api/v1"
)

var t0 = time.Date(2026, 11, 27, 4, 0, 0, 0, time.UTC)

func warning(name, pod string, uid types.UID, reason, msg string, at time.Duration, count int32) *corev1.Event {
	return &corev1.Event{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns"}, Type: corev1.EventTypeWarning, Reason: reason, Message: msg, Count: count,
		InvolvedObject: corev1.ObjectReference{Kind: "Pod", Namespace: "ns", Name: pod, UID: uid},
		Source:         corev1.EventSource{Component: "tessera-extender"}, LastTimestamp: metav1.NewTime(t0.Add(at))}
}

// waiting is the cluster pending looks at: a GPU pod the scheduler cannot place, with Warning
// Events (one with line breaks, one repeated, two of the pod's predecessor under the same name,
// one Normal), a GPU pod whose container waits, a CPU pod, and a GPU pod in another namespace.
func waiting() []runtime.Object {
	limits := corev1.ResourceList{api.ResourceShare: resource.MustParse("1"), api.ResourceShareMemory: resource.MustParse("48Gi")}
	big := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "big", Namespace: "ns", UID: "uid-big"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "main", Resources: corev1.ResourceRequirements{Limits: limits}}}},
		Status: corev1.PodStatus{Phase: corev1.PodPending, Conditions: []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionFalse,
			Message: "0/3 nodes are available: 1 container \"main\" asks for 49152 MiB per share, the largest usable GPU here has 40960 MiB,\n2 node(s) had untolerated taint {gpu: reserved}. preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."}}}}
	stuck := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "stuck", Namespace: "ns", UID: "uid-stuck"},
		Spec: corev1.PodSpec{NodeName: "n1", InitContainers: []corev1.Container{{Name: "init", Resources: corev1.ResourceRequirements{Limits: limits}}}},
		Status: corev1.PodStatus{Phase: corev1.PodPending, ContainerStatuses: []corev1.ContainerStatus{{Name: "main",
			State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CreateContainerError", Message: "tessera: GPU\tassignment\nnot realised"}}}}}}
	running := big.DeepCopy()
	running.Name, running.UID, running.Status = "ok", "uid-ok", corev1.PodStatus{Phase: corev1.PodRunning}
	other := big.DeepCopy()
	other.Namespace, other.UID = "other", "uid-other"
	return []runtime.Object{big, stuck, running, other,
		&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "cpu", Namespace: "ns"}, Status: corev1.PodStatus{Phase: corev1.PodPending}},
		warning("e1", "big", "uid-big", "GPUPlacementRefused", "no GPU\nhas 48Gi:\n\tlargest 40Gi", 1*time.Minute, 1),
		warning("e2", "big", "uid-big", "GPUBindFailed", "bind lost a race", 2*time.Minute, 3),
		warning("e3", "big", "uid-big", "GPUBindFailed", "bind lost a race", 5*time.Minute, 2),
		warning("e4", "big", "uid-old", "GPUBindFailed", "the predecessor's", 6*time.Minute, 1),
		warning("e5", "big", "", "FailedScheduling", "an event without a UID still names the pod", 3*time.Minute, 1),
		&corev1.Event{ObjectMeta: metav1.ObjectMeta{Name: "e6", Namespace: "ns"}, Type: corev1.EventTypeNormal, Reason: "Scheduled", Message: "normal events are left out",
			InvolvedObject: corev1.ObjectReference{Kind: "Pod", Namespace: "ns", Name: "big", UID: "uid-big"}},
	}
}

// TestPending: each GPU pod that waits, with the scheduler's message and its latest distinct
// Warning Events (reason and message on one line, repeats counted, a predecessor's left out),
// wrapped to $COLUMNS; -o wide does not wrap; pods without GPUs, running pods and other
// namespaces are left out.
func TestPending(t *testing.T) {
	kc := kubeconfig(t)
	t.Setenv("COLUMNS", "72")
	r := execute(t, []string{"pending", "-n", "ns", "--kubeconfig", kc}, waiting()...)
	if r.err != nil {
		t.Fatal(r.err)
	}
	want := `ns/big	Pending	(not scheduled)
  scheduler: 0/3 nodes are available: 1 container "main" asks for 49152
    MiB per share, the largest usable GPU here has 40960 MiB, 2 node(s)
    had untolerated taint {gpu: reserved}. preemption: 0/3 nodes are
    available: 3 Preemption is not helpful for scheduling.
  GPUPlacementRefused (tessera-extender): no GPU has 48Gi: largest 40Gi
  FailedScheduling (tessera-extender): an event without a UID still
    names the pod
  GPUBindFailed (tessera-extender, x5): bind lost a race
ns/stuck	Pending	n1
  container main: CreateContainerError: tessera: GPU assignment not
    realised
`
	if r.out != want {
		t.Errorf("got:\n%s\nwant:\n%s", r.out, want)
	}
	for _, line := range strings.Split(r.out, "\n") {
		if len(line) > 72 {
			t.Errorf("line longer than $COLUMNS: %q", line)
		}
	}
	if got := r.lists("events"); len(got) != 1 || got[0] != `ns="ns" fields="involvedObject.kind=Pod"` {
		t.Errorf("events lists %v", got)
	}
	r = execute(t, []string{"pending", "-n", "ns", "-o", "wide", "--kubeconfig", kc}, waiting()...)
	if !strings.Contains(r.out, "\n  scheduler: 0/3 nodes are available: 1 container \"main\" asks for 49152 MiB per share, the largest usable GPU here has 40960 MiB, 2 node(s) had untolerated taint {gpu: reserved}. preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling.\n") {
		t.Errorf("-o wide wraps:\n%s", r.out)
	}
	r = execute(t, []string{"pending", "-A", "--kubeconfig", kc}, waiting()...)
	if !strings.Contains(r.out, "other/big\tPending") || !strings.Contains(r.out, "ns/big\tPending") {
		t.Errorf("-A lacks a namespace:\n%s", r.out)
	}
	r = execute(t, []string{"pending", "-n", "empty", "--kubeconfig", kc}, waiting()...)
	if r.err != nil || r.out != "no GPU pod is waiting\n" {
		t.Errorf("nothing waits: %v %q", r.err, r.out)
	}
}

// TestWhy: one pod by name, GPU or not, with its events only; -o json prints a PendingPod.
func TestWhy(t *testing.T) {
	kc := kubeconfig(t)
	r := execute(t, []string{"why", "stuck", "-n", "ns", "--kubeconfig", kc}, waiting()...)
	if r.err != nil || !strings.HasPrefix(r.out, "ns/stuck\tPending\tn1\n  container main: CreateContainerError") || strings.Contains(r.out, "race") {
		t.Errorf("why stuck: %v\n%s", r.err, r.out)
	}
	if got := r.lists("events"); len(got) != 1 || got[0] != `ns="ns" fields="involvedObject.kind=Pod,involvedObject.name=stuck"` {
		t.Errorf("events lists %v", got)
	}
	r = execute(t, []string{"why", "cpu", "-n", "ns", "--kubeconfig", kc}, waiting()...)
	if r.err != nil || !strings.Contains(r.out, "asks for none of Tessera's resources") {
		t.Errorf("why cpu: %v\n%s", r.err, r.out)
	}
	r = execute(t, []string{"why", "big", "-n", "ns", "-o", "json", "--kubeconfig", kc}, waiting()...)
	var list struct {
		Items []struct {
			Kind   string  `json:"kind"`
			Status podView `json:"status"`
		} `json:"items"`
	}
	if err := json.Unmarshal([]byte(r.out), &list); err != nil || len(list.Items) != 1 || list.Items[0].Kind != "PendingPod" {
		t.Fatalf("%v %v:\n%s", r.err, err, r.out)
	}
	if evs := list.Items[0].Status.Events; len(evs) != 3 || evs[2].Reason != "GPUBindFailed" || evs[2].Count != 5 || evs[0].Message != "no GPU has 48Gi: largest 40Gi" {
		t.Errorf("events: %+v", evs)
	}
	if r := execute(t, []string{"why", "gone", "-n", "ns", "--kubeconfig", kc}); r.err == nil || !strings.Contains(r.err.Error(), `pod ns/gone: pods "gone" not found`) {
		t.Errorf("why gone: %v", r.err)
	}
}
