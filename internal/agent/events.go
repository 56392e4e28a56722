package agent

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/record"

	"github.com/tessera-gpu/tessera/internal/telemetry"
)

// NewEventRecorder records the node agent's events (component tessera-node, the node as their
// host); stop delivers what was recorded before it (telemetry.NewEventRecorder).
func NewEventRecorder(client kubernetes.Interface, nodeName string) (rec record.EventRecorder, stop func()) {
	return telemetry.NewEventRecorder(client, corev1.EventSource{Component: "tessera-node", Host: nodeName})
}
