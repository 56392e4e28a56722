package extender

import (
	"fmt"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"

	"github.com/tessera-gpu/tessera/internal/informer"
)

// WireInformers feeds a State from node and pod informers and returns a ResourceQuota lister
// function; the caller starts the factory and waits for sync.
func WireInformers(f informers.SharedInformerFactory, s *State, opts ClassOptions) (func(ns string) []*corev1.ResourceQuota, error) {
	nodes := f.Core().V1().Nodes().Informer()
	if _, err := nodes.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { s.UpsertNode(o.(*corev1.Node)) },
		UpdateFunc: func(_, o any) { s.UpsertNode(o.(*corev1.Node)) },
		DeleteFunc: informer.OnDelete(func(n *corev1.Node) { s.DeleteNode(n.Name) }),
	}); err != nil {
		return nil, err
	}
	pods := f.Core().V1().Pods().Informer()
	if _, err := pods.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { s.UpsertPod(o.(*corev1.Pod), opts) },
		UpdateFunc: func(_, o any) { s.UpsertPod(o.(*corev1.Pod), opts) },
		DeleteFunc: informer.OnDelete(func(p *corev1.Pod) { s.DeletePod(p.UID) }),
	}); err != nil {
		return nil, err
	}
	quotas := f.Core().V1().ResourceQuotas().Lister()
	return func(ns string) []*corev1.ResourceQuota {
		l, err := quotas.ResourceQuotas(ns).List(labelsEverything)
		if err != nil {
			return nil
		}
		return l
	}, nil
}

var labelsEverything = labelsEverythingSelector()

// podUIDIndex indexes the pod informer's cache by UID (the preemption verb names pods by UID).
const podUIDIndex = "uid"

// WirePreemptionListers returns what Preempt reads besides the State (Extender.PDBs, PodByUID):
// every PodDisruptionBudget, and pods by UID from the pod informer (given an index for it). The
// caller starts the factory and waits for sync.
func WirePreemptionListers(f informers.SharedInformerFactory) (func() []*policyv1.PodDisruptionBudget, func(types.UID) *corev1.Pod, error) {
	pods := f.Core().V1().Pods().Informer()
	if err := pods.AddIndexers(cache.Indexers{podUIDIndex: func(o any) ([]string, error) {
		if p, ok := o.(*corev1.Pod); ok {
			return []string{string(p.UID)}, nil
		}
		return nil, nil
	}}); err != nil {
		return nil, nil, fmt.Errorf("pod UID index: %w", err)
	}
	pdbs := f.Policy().V1().PodDisruptionBudgets().Lister()
	return func() []*policyv1.PodDisruptionBudget {
			l, err := pdbs.List(labelsEverything)
			if err != nil {
				return nil
			}
			return l
		}, func(uid types.UID) *corev1.Pod {
			objs, err := pods.GetIndexer().ByIndex(podUIDIndex, string(uid))
			if err != nil || len(objs) == 0 {
				return nil
			}
			p, _ := objs[0].(*corev1.Pod)
			return p
		}, nil
}

// WireLeaseObserver feeds the node locker every bind Lease an informer of the Lease namespace sees
// (NodeLocker.Observe); f must be limited to that namespace (informers.WithNamespace), or it would
// watch every node's heartbeat Lease. The caller starts the factory; no sync is needed, as an
// unobserved Lease is only observed later.
func WireLeaseObserver(f informers.SharedInformerFactory, l *NodeLocker) error {
	observe := func(obj any) {
		if lease, ok := obj.(*coordinationv1.Lease); ok {
			l.Observe(lease)
		}
	}
	_, err := f.Coordination().V1().Leases().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    observe,
		UpdateFunc: func(_, obj any) { observe(obj) },
	})
	if err != nil {
		return fmt.Errorf("watch bind leases: %w", err)
	}
	return nil
}
