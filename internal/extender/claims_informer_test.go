package extender

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestClaimInformersCountTheLiveAllocation: through the informers the extender's main wires
// (WireInformers, then WireClaimInformers), a claim-only pod's share claim, with the objects shaped
// as the live API server and the agent have them (TestMultiNode/Policy's policy-claim: a template
// of the share class; the allocation's device gpu-0 of the pool named after the node, a ShareID and
// consumedCapacity memory, compute and shares; the agent's holdings listing the prepared claim as
// "resourceclaim/<claim>" on the pod), counts once on its GPU: from its allocation, not from the
// holdings. Without the claim informer's handler the GPU reads free; without the holdings leaving
// the claim out it reads two shares.
func TestClaimInformersCountTheLiveAllocation(t *testing.T) {
	const node, claimName = "gpu-h100", "policy-claim-gpu-4fv2p"
	inv := testInventory(node, 1, 2, "T4")
	n := testNode(inv, nil)
	pod := claimPod("policy-claim", "policy-claim")
	pod.Spec.NodeName = node
	pod.Status.Phase = corev1.PodRunning
	generated := claimName
	pod.Status.ResourceClaimStatuses = []corev1.PodResourceClaimStatus{{Name: "gpu", ResourceClaimName: &generated}}
	raw, err := api.EncodeHoldings(&api.NodeHoldings{Node: node, Pods: []api.PodHolding{{Namespace: "default", Pod: pod.Name, UID: string(pod.UID),
		Containers: []api.ContainerAssignment{{Name: "resourceclaim/" + claimName,
			Devices: []api.DeviceAssignment{{UUID: gpuUUID(1, 0), MemoryBytes: 8 << 30, CoresPercent: 20}}}}}}})
	if err != nil {
		t.Fatal(err)
	}
	n.Annotations[api.AnnotationHoldings] = string(raw)
	spec := claimSpec(exact("gpu", api.DRAClassShareGPU, 1, "memory=8Gi", "compute=20"))
	tmpl := &resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: "policy-claim", Namespace: "default"},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: spec}}
	shareID := types.UID("8a1c6f0e-2f3b-4c55-9d1e-4b6a7c8d9e0f")
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: claimName, Namespace: "default", UID: "a07fd1fa-578c-4066-bd19-7e3c33d657f4"},
		Spec: spec,
		Status: resourceapi.ResourceClaimStatus{
			Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
				Request: "gpu", Driver: api.DRADriverName, Pool: node, Device: "gpu-0", ShareID: &shareID,
				ConsumedCapacity: map[resourceapi.QualifiedName]resource.Quantity{
					"memory": *resource.NewQuantity(8<<30, resource.BinarySI), "compute": resource.MustParse("20"), "shares": resource.MustParse("1")},
			}}}},
			ReservedFor: []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: pod.Name, UID: pod.UID}},
		}}
	f := informers.NewSharedInformerFactory(fake.NewClientset(n, pod, tmpl, claim), 0)
	s := NewState(0, nil)
	if _, err := WireInformers(f, s, ClassOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := WireClaimInformers(f, s); err != nil {
		t.Fatal(err)
	}
	ctx := startSynced(t, f)
	// The handlers may still be delivering the initial lists: wait for the node and the claim.
	want := "whole=false shares=1 milli=200; whole=false shares=0 milli=0"
	got := ""
	err = wait.PollUntilContextTimeout(ctx, 5*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		s.mu.RLock()
		ready := s.nodes[node] != nil && s.claims[claim.UID] != nil
		s.mu.RUnlock()
		if ready {
			got = gpuUse(t, s, node)
		}
		return ready, nil
	})
	if err != nil {
		t.Fatalf("the node or the claim's allocated devices never reached the State through the informers: %v", err)
	}
	if got != want {
		t.Fatalf("%s, want %s (the claim's share once, from its allocation)", got, want)
	}
}
