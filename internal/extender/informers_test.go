package extender

import (
	"context"
	"testing"

	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
)

// TestPreemptionListers: the preemption verb's listers read the informers' caches: every budget,
// and a pod by its UID (the index the verb needs), nil for a UID no pod has.
func TestPreemptionListers(t *testing.T) {
	pod := wholePod("p", 1)
	pdb := &policyv1.PodDisruptionBudget{ObjectMeta: metav1.ObjectMeta{Name: "b", Namespace: "default"}}
	f := informers.NewSharedInformerFactory(fake.NewClientset(pod, pdb), 0)
	pdbs, podByUID, err := WirePreemptionListers(f)
	if err != nil {
		t.Fatal(err)
	}
	startSynced(t, f)
	if l := pdbs(); len(l) != 1 || l[0].Name != "b" {
		t.Fatalf("budgets %v, want b", l)
	}
	if p := podByUID(pod.UID); p == nil || p.Name != "p" {
		t.Fatalf("pod by UID %s: %v", pod.UID, p)
	}
	if p := podByUID(types.UID("nobody")); p != nil {
		t.Fatalf("pod for an unknown UID: %v", p)
	}
}

// startSynced starts the factory's informers until the test ends and waits for their caches.
func startSynced(t *testing.T, f informers.SharedInformerFactory) context.Context {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	f.Start(ctx.Done())
	for typ, ok := range f.WaitForCacheSync(ctx.Done()) {
		if !ok {
			t.Fatalf("%v not synced", typ)
		}
	}
	return ctx
}
