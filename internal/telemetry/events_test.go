package telemetry_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/tessera-gpu/tessera/internal/telemetry"
)

// TestEventRecorderStopDelivers: the events recorded before stop are in the API server when stop
// returns, though the first write is still under way when stop is called; stop's own marker never
// reaches the API server.
func TestEventRecorderStopDelivers(t *testing.T) { synctest.Test(t, eventRecorderStopDelivers) }

func eventRecorderStopDelivers(t *testing.T) {
	client := fake.NewClientset()
	stopping := make(chan struct{})
	var first sync.Once
	client.PrependReactor("create", "events", func(k8stesting.Action) (bool, runtime.Object, error) {
		first.Do(func() { <-stopping }) // the API server answers the first write only once stop is called
		return false, nil, nil
	})
	rec, stop := telemetry.NewEventRecorder(client, corev1.EventSource{Component: "tessera-test", Host: "node-a"})
	const n = 10
	for i := range n {
		// One node each: an event's name is its object's and the time, which the bubble holds still.
		rec.Eventf(nodeRef(fmt.Sprintf("node-%d", i)), corev1.EventTypeWarning, "Recorded", "event %d", i)
	}
	close(stopping)
	stop()

	list, err := client.CoreV1().Events(metav1.NamespaceDefault).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]bool{}
	for _, e := range list.Items {
		if e.InvolvedObject.Kind != "Node" {
			t.Errorf("event about %+v reached the API server", e.InvolvedObject)
		}
		got[e.InvolvedObject.Name] = true
	}
	for i := range n {
		if !got[fmt.Sprintf("node-%d", i)] {
			t.Errorf("event %d recorded before stop is not in the API server when stop returns (have %d of %d)", i, len(got), n)
		}
	}
}

// TestEventRecorderStopBounded: with an API server that never takes an event, stop gives up after
// its bound rather than wait out the library's retries.
func TestEventRecorderStopBounded(t *testing.T) { synctest.Test(t, eventRecorderStopBounded) }

func eventRecorderStopBounded(t *testing.T) {
	client := fake.NewClientset()
	client.PrependReactor("create", "events", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("connection refused") // a transport error: the library retries it
	})
	rec, stop := telemetry.NewEventRecorder(client, corev1.EventSource{Component: "tessera-test", Host: "node-a"})
	rec.Event(nodeRef("node-a"), corev1.EventTypeWarning, "Unwritable", "never written")
	start := time.Now()
	stop() // one that waited for the write would wait out the library's retries, near two minutes
	if took := time.Since(start); took > time.Minute {
		t.Errorf("stop took %v on the bubble's clock, want it bounded by its flush timeout", took)
	}
}

func nodeRef(name string) *corev1.ObjectReference {
	return &corev1.ObjectReference{Kind: "Node", Name: name, UID: types.UID(name)}
}
