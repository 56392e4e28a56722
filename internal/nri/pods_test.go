package nri

import (
	"context"
	"errors"
	"testing"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/tessera-gpu/tessera/internal/agent"
)

// TestWarnRecordsPodEvent: the plugin's Warning goes through the node agent's EventRecorder to the
// API server as an Event in the pod's namespace, on the pod (kind, name, UID), with the reason.
func TestWarnRecordsPodEvent(t *testing.T) {
	client := fake.NewClientset()
	rec, stop := agent.NewEventRecorder(client, "node-a")
	defer stop()
	p := New(Config{Events: rec}, nil, nil, nil)
	p.warn(&nriapi.PodSandbox{Name: "rogue", Namespace: "ns", Uid: "uid-rogue"}, "TesseraUnrealisedGPU", "holds /dev/nvidia2")

	var list *corev1.EventList
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var err error
		if list, err = client.CoreV1().Events("ns").List(context.Background(), metav1.ListOptions{}); err != nil {
			t.Fatal(err)
		}
		if len(list.Items) > 0 || time.Now().After(deadline) {
			break
		}
	}
	if len(list.Items) != 1 {
		t.Fatalf("events in ns: %d, want 1", len(list.Items))
	}
	ev := list.Items[0]
	want := corev1.ObjectReference{APIVersion: "v1", Kind: "Pod", Namespace: "ns", Name: "rogue", UID: "uid-rogue"}
	if ev.InvolvedObject != want || ev.Type != corev1.EventTypeWarning || ev.Reason != "TesseraUnrealisedGPU" || ev.Message != "holds /dev/nvidia2" || ev.Source.Component != "tessera-node" {
		t.Errorf("event: involved %+v, type %s, reason %s, message %q, source %+v", ev.InvolvedObject, ev.Type, ev.Reason, ev.Message, ev.Source)
	}
}

// TestAPIPodsReplaced: a pod whose name the API server now gives a pod of another UID is
// ErrPodReplaced (and ErrPodGone); no pod of the name, or a mirror pod of another static-pod version,
// is ErrPodGone only, which leaves the kubelet's list to decide (ReleaseUnlisted).
func TestAPIPodsReplaced(t *testing.T) {
	client := fake.NewClientset(
		&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web-0", Namespace: "ns", UID: "uid-web-0-b"}, Spec: corev1.PodSpec{NodeName: "node-a"}},
		&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "etcd-node-a", Namespace: "kube-system", UID: "mirror-etcd",
			Annotations: map[string]string{corev1.MirrorPodAnnotationKey: "hash-2"}}, Spec: corev1.PodSpec{NodeName: "node-a"}},
	)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pods := NewAPIPods(ctx, client, "node-a")
	for _, tc := range []struct {
		ns, name, uid string
		replaced      bool
	}{
		{"ns", "web-0", "uid-web-0-a", true},
		{"ns", "web-1", "uid-web-1", false},
		{"kube-system", "etcd-node-a", "hash-1", false},
	} {
		_, err := pods.Pod(ctx, tc.ns, tc.name, tc.uid)
		if !errors.Is(err, ErrPodGone) || errors.Is(err, ErrPodReplaced) != tc.replaced {
			t.Errorf("%s/%s UID %s: %v; want ErrPodGone, ErrPodReplaced %v", tc.ns, tc.name, tc.uid, err, tc.replaced)
		}
	}
	if p, err := pods.Pod(ctx, "ns", "web-0", "uid-web-0-b"); err != nil || p.UID != "uid-web-0-b" {
		t.Errorf("the pod itself: %v, %v", p, err)
	}
}
