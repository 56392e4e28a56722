package nri

import (
	"context"
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
