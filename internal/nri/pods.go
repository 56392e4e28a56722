package nri

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	listersv1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
)

// APIPods reads pods from the API server through a watch of this node's pods, so CreateContainer
// needs no round trip; a pod not in the cache yet (the watch lags the kubelet) is fetched directly.
type APIPods struct {
	client kubernetes.Interface
	lister listersv1.PodLister
}

// NewAPIPods starts a pod informer for one node; it stops with ctx.
func NewAPIPods(ctx context.Context, client kubernetes.Interface, nodeName string) *APIPods {
	factory := informers.NewSharedInformerFactoryWithOptions(client, 10*time.Minute,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", nodeName).String()
		}))
	lister := factory.Core().V1().Pods().Lister()
	factory.Start(ctx.Done())
	go cache.WaitForCacheSync(ctx.Done(), factory.Core().V1().Pods().Informer().HasSynced)
	return &APIPods{client: client, lister: lister}
}

// Pod returns the pod with this UID, from the cache when it is there; otherwise (not seen yet, or
// the cache still holds a deleted pod of the same name) from the API server.
func (a *APIPods) Pod(ctx context.Context, namespace, name, uid string) (*corev1.Pod, error) {
	if p, err := a.lister.Pods(namespace).Get(name); err == nil && string(p.UID) == uid {
		return p, nil
	}
	p, err := a.client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("get pod %s/%s: %w", namespace, name, err)
	}
	if string(p.UID) != uid {
		return nil, fmt.Errorf("pod %s/%s in the API server has UID %s, the sandbox %s", namespace, name, p.UID, uid)
	}
	return p, nil
}
