package nri

import (
	"context"
	"errors"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
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
	node   string
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
	return &APIPods{client: client, lister: lister, node: nodeName}
}

// ErrPodGone is wrapped by a Pods source's error when the API server answered and has no pod of
// that name and UID (deleted, or replaced by another pod of the same name); any other error means the
// spec could not be read (API server unreachable, cold cache) and says nothing about the pod.
var ErrPodGone = errors.New("the pod is no longer in the API server")

// ErrPodReplaced is ErrPodGone for a name the API server now gives another pod (a StatefulSet's or
// a user's pod recreated under the same name): the sandbox's pod runs no container again, and the
// kubelet's listing of that name (PodResources lists names, not UIDs) is the other pod's.
var ErrPodReplaced = fmt.Errorf("%w: another pod of that name has replaced it", ErrPodGone)

// ErrNoAPIServer is wrapped by a Pods source that has no API server at all (tessera-node started
// without credentials): no pod can be verified, and the kubelet's word alone decides when a pod is
// gone (podFate counts it as gone; ReleaseUnlisted still waits for two kubelet lists without it).
var ErrNoAPIServer = errors.New("no API server access to read the pod")

// Pod returns the pod with this UID, from the cache when it is there; otherwise (not seen yet, or
// the cache still holds a deleted pod of the same name) from the API server. A static pod's sandbox
// carries the kubelet's UID for it (its config hash), which the API server's mirror pod names in its
// kubernetes.io/config.mirror annotation instead of its own UID (sandboxOf).
func (a *APIPods) Pod(ctx context.Context, namespace, name, uid string) (*corev1.Pod, error) {
	if p, err := a.lister.Pods(namespace).Get(name); err == nil && sandboxOf(p, uid, a.node) {
		return p, nil
	}
	p, err := a.client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, fmt.Errorf("get pod %s/%s: %w (%w)", namespace, name, ErrPodGone, err)
	}
	if err != nil {
		return nil, fmt.Errorf("get pod %s/%s: %w", namespace, name, err)
	}
	if !sandboxOf(p, uid, a.node) {
		// A mirror pod names a static pod the kubelet may be moving to another version of; the kubelet's
		// list decides then (ErrPodGone), as when no pod of the name is left.
		gone := ErrPodReplaced
		if _, mirror := p.Annotations[corev1.MirrorPodAnnotationKey]; mirror {
			gone = ErrPodGone
		}
		return nil, fmt.Errorf("pod %s/%s in the API server has UID %s, the sandbox %s: %w", namespace, name, p.UID, uid, gone)
	}
	return p, nil
}

// sandboxOf reports whether the API server's pod p is the one a sandbox with this pod UID runs on
// node: p itself, or p is this node's mirror pod of a static pod whose kubelet UID (config hash) is
// uid. The kubelet writes the annotation when it creates the mirror pod (a node may create no other
// pods: NodeRestriction), and the kubelet itself runs no API pod that carries it.
func sandboxOf(p *corev1.Pod, uid, node string) bool {
	if string(p.UID) == uid {
		return true
	}
	hash, mirror := p.Annotations[corev1.MirrorPodAnnotationKey]
	return mirror && hash != "" && hash == uid && p.Spec.NodeName == node
}
