package telemetry

import (
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"
)

// eventFlushTimeout bounds how long stopping the recorder waits for the events recorded before it
// to be written: the library retries a failed write for about two minutes, longer than a stopping
// process has (the pod's termination grace period).
const eventFlushTimeout = 5 * time.Second

// flushMarker is the object of the event the recorder's stop records last: the sink answers it
// itself, never the API server.
var flushMarker = corev1.ObjectReference{Kind: "TesseraEventFlush", Name: "flush", UID: types.UID("tessera-event-flush")}

// NewEventRecorder records events through the API server as source (every binary's one way to
// record events). stop delivers what was recorded before it, waiting up to eventFlushTimeout, then
// ends the recorder. The broadcaster's Shutdown alone does not: it hands the queued events to the
// sink's goroutine and cancels that goroutine at once, so events recorded just before a binary
// stops were lost.
func NewEventRecorder(client kubernetes.Interface, source corev1.EventSource) (rec record.EventRecorder, stop func()) {
	b := record.NewBroadcaster()
	sink := &flushSink{EventSink: &typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")}, flushed: make(chan struct{})}
	b.StartRecordingToSink(sink)
	rec = b.NewRecorder(scheme.Scheme, source)
	var once sync.Once
	return rec, func() {
		once.Do(func() {
			// The broadcaster passes events to the sink one at a time in the order recorded, so
			// the marker reaching it means everything before it was written or given up on.
			rec.Event(&flushMarker, corev1.EventTypeNormal, "Flush", "events recorded before the process stopped are written")
			t := time.NewTimer(eventFlushTimeout)
			defer t.Stop()
			select {
			case <-sink.flushed:
			case <-t.C:
			}
			b.Shutdown()
		})
	}
}

// flushSink writes events through the API server, except the flush marker, which it takes as the
// sign that the events before it are through.
type flushSink struct {
	record.EventSink
	flushed chan struct{}
}

func (s *flushSink) Create(e *corev1.Event) (*corev1.Event, error) {
	if e.InvolvedObject.UID != flushMarker.UID || e.InvolvedObject.Kind != flushMarker.Kind {
		return s.EventSink.Create(e)
	}
	select {
	case <-s.flushed:
	default:
		close(s.flushed)
	}
	return e, nil
}
