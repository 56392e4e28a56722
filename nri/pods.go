package nri

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// APIPods reads pods from the API server.
type APIPods struct{ Client kubernetes.Interface }

// Pod gets one pod.
func (a APIPods) Pod(ctx context.Context, namespace, name string) (*corev1.Pod, error) {
	p, err := a.Client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("get pod %s/%s: %w", namespace, name, err)
	}
	return p, nil
}
