package extender

import (
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// exact is a claim request of class with count devices and the capacity given as name=quantity.
func exact(name, class string, count int64, capacity ...string) resourceapi.DeviceRequest {
	e := &resourceapi.ExactDeviceRequest{DeviceClassName: class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: count}
	if len(capacity) > 0 {
		e.Capacity = &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{}}
		for _, c := range capacity {
			k, v, _ := strings.Cut(c, "=")
			e.Capacity.Requests[resourceapi.QualifiedName(k)] = resource.MustParse(v)
		}
	}
	return resourceapi.DeviceRequest{Name: name, Exactly: e}
}

func claimSpec(reqs ...resourceapi.DeviceRequest) resourceapi.ResourceClaimSpec {
	return resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: reqs}}
}

// TestClaimShapes: a claim's requests of Tessera's whole and share classes, as placement shapes.
func TestClaimShapes(t *testing.T) {
	admin := true
	for _, tc := range []struct {
		name string
		req  resourceapi.DeviceRequest
		want string // fmt of the shapes, or "error"
	}{
		{"two whole GPUs", exact("g", api.DRAClassWholeGPU, 2), "[{resourceclaim/gpu/g 2 0 0 0 0 map[] map[]}]"},
		{"count left out is one", exact("g", api.DRAClassWholeGPU, 0), "[{resourceclaim/gpu/g 1 0 0 0 0 map[] map[]}]"},
		{"a 10Gi 30% share", exact("s", api.DRAClassShareGPU, 1, "memory=10Gi", "compute=30"), fmt.Sprintf("[{resourceclaim/gpu/s 0 1 %d 0 300 map[] map[]}]", int64(10)<<30)},
		{"a share with no compute reserves none", exact("s", api.DRAClassShareGPU, 2, "memory=4Gi"), fmt.Sprintf("[{resourceclaim/gpu/s 0 2 %d 0 0 map[] map[]}]", int64(4)<<30)},
		{"a share naming no memory takes the GPU", exact("s", api.DRAClassShareGPU, 1, "compute=30"), "[{resourceclaim/gpu/s 1 0 0 0 0 map[] map[]}]"},
		{"compute past 100 is refused", exact("s", api.DRAClassShareGPU, 1, "memory=1Gi", "compute=150"), "error"},
		{"a MIG instance is the allocator's", exact("m", "mig.gpu.tessera.dev", 1), "[]"},
		{"another driver's class", exact("x", "gpu.nvidia.com", 1), "[]"},
		{"allocation mode All", resourceapi.DeviceRequest{Name: "a", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: api.DRAClassWholeGPU, AllocationMode: resourceapi.DeviceAllocationModeAll}}, "[]"},
		{"admin access takes nothing", resourceapi.DeviceRequest{Name: "a", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: api.DRAClassWholeGPU, AdminAccess: &admin}}, "[]"},
		{"firstAvailable", resourceapi.DeviceRequest{Name: "f", FirstAvailable: []resourceapi.DeviceSubRequest{{Name: "w", DeviceClassName: api.DRAClassWholeGPU}}}, "[]"},
	} {
		spec := claimSpec(tc.req)
		got, err := claimShapes("gpu", &spec)
		s := fmt.Sprint(got)
		if got == nil {
			s = "[]"
		}
		if err != nil {
			s = "error"
		}
		if s != tc.want {
			t.Errorf("%s: %s (err %v), want %s", tc.name, s, err, tc.want)
		}
	}
}

// fakeClaims is a ClaimSource over maps (namespace/name keys).
type fakeClaims struct {
	claims    map[string]*resourceapi.ResourceClaim
	templates map[string]*resourceapi.ResourceClaimTemplate
}

func (f *fakeClaims) source() *ClaimSource {
	return &ClaimSource{
		Claim:    func(ns, name string) *resourceapi.ResourceClaim { return f.claims[ns+"/"+name] },
		Template: func(ns, name string) *resourceapi.ResourceClaimTemplate { return f.templates[ns+"/"+name] },
	}
}

func (f *fakeClaims) template(name string, spec resourceapi.ResourceClaimSpec) {
	f.templates["default/"+name] = &resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: spec}}
}

// claimPod is a pod (no device-plugin GPUs) whose container uses a claim made from template.
func claimPod(name, template string) *corev1.Pod {
	p := withRequests(testPod(name, corev1.ResourceList{}), 1000, 1024)
	p.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: &template}}
	p.Spec.Containers[0].Resources.Claims = []corev1.ResourceClaim{{Name: "gpu"}}
	return p
}

// allocatedClaim is a claim allocated the devices on node (device=memory/compute; "" capacity:
// none consumed, a whole GPU) and reserved for pod.
func allocatedClaim(uid, node string, pod types.UID, devices ...string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "c-" + uid, Namespace: "default", UID: types.UID(uid)},
		Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{}}}
	for _, d := range devices {
		dev, capacity, _ := strings.Cut(d, "=")
		r := resourceapi.DeviceRequestAllocationResult{Request: "gpu", Driver: api.DRADriverName, Pool: node, Device: dev}
		if capacity != "" {
			mem, compute, _ := strings.Cut(capacity, "/")
			r.ConsumedCapacity = map[resourceapi.QualifiedName]resource.Quantity{"memory": resource.MustParse(mem), "compute": resource.MustParse(compute), "shares": resource.MustParse("1")}
		}
		c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results, r)
	}
	if pod != "" {
		c.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: string(pod), UID: pod}}
	}
	return c
}

func gpuUse(t *testing.T, s *State, node string) string {
	t.Helper()
	var out []string
	s.View([]string{node}, func(_ string, n *placement.NodeState, missing string) {
		if n == nil {
			t.Fatalf("node %s: %s", node, missing)
		}
		for _, g := range n.GPUs {
			out = append(out, fmt.Sprintf("whole=%v shares=%d milli=%d", g.Whole, g.Shares, g.UsedMilli))
		}
	})
	return strings.Join(out, "; ")
}

// TestStateCountsAllocatedClaims: a claim the scheduler allocated Tessera's devices is occupied
// capacity on its node (whole: no capacity consumed, or all the memory; a share: its memory and
// compute), kept across a node re-build, and freed when deallocated or deleted; another driver's
// devices and admin access count nothing.
func TestStateCountsAllocatedClaims(t *testing.T) {
	s := NewState(0, nil)
	s.UpsertNode(testNode(testInventory("n1", 1, 3, "T4"), nil))
	s.UpsertClaim(allocatedClaim("c1", "n1", "", "gpu-0"))
	s.UpsertClaim(allocatedClaim("c2", "n1", "", "gpu-1=4Gi/30"))
	s.UpsertClaim(allocatedClaim("c3", "n1", "", "gpu-2=16Gi/0"))
	other := allocatedClaim("c4", "n1", "", "gpu-1=4Gi/30")
	other.Status.Allocation.Devices.Results[0].Driver = "gpu.nvidia.com"
	s.UpsertClaim(other)
	want := "whole=true shares=0 milli=0; whole=false shares=1 milli=300; whole=true shares=0 milli=0"
	if got := gpuUse(t, s, "n1"); got != want {
		t.Fatalf("allocated claims: %s, want %s", got, want)
	}
	s.UpsertNode(withAllocatable(testNode(testInventory("n1", 1, 3, "T4"), nil), 8000, 1024)) // re-built
	if got := gpuUse(t, s, "n1"); got != want {
		t.Fatalf("after the node's re-build: %s, want %s", got, want)
	}
	deallocated := allocatedClaim("c1", "n1", "")
	deallocated.Status.Allocation = nil
	s.UpsertClaim(deallocated)
	s.DeleteClaim("c2")
	if got, want := gpuUse(t, s, "n1"), "whole=false shares=0 milli=0; whole=false shares=0 milli=0; whole=true shares=0 milli=0"; got != want {
		t.Fatalf("after deallocation and deletion: %s, want %s", got, want)
	}
}

// TestFilterPlacesClaimPods: Filter chooses the node of a pod whose GPUs are claims as it does for a
// device-plugin pod, from the claim's requests and the claims allocated on each node, and holds the
// choice until the claim is seen allocated. n1's two GPUs are held by allocated claims, n2 and n3
// are free: a 1-GPU claim pod gets n2, and a 2-GPU claim pod then n3,
// as n2 has one GPU left while the first pod's choice is held. Without the claims read, both pods
// are CPU-only to the extender and get n1 (the smallest name); without the allocated claims
// counted, the first gets n1; without the hold, the second gets n2.
func TestFilterPlacesClaimPods(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	x.PickOne = true
	f := &fakeClaims{claims: map[string]*resourceapi.ResourceClaim{}, templates: map[string]*resourceapi.ResourceClaimTemplate{}}
	f.template("whole-1", claimSpec(exact("gpu", api.DRAClassWholeGPU, 1)))
	f.template("whole-2", claimSpec(exact("gpu", api.DRAClassWholeGPU, 2)))
	x.Claims = f.source()
	x.State.readClaims(x.Claims)
	names := []string{"n1", "n2", "n3"}
	for i, n := range names {
		x.State.UpsertNode(withAllocatable(testNode(testInventory(n, i+1, 2, "T4"), nil), 32000, 128<<10))
	}
	x.State.UpsertClaim(allocatedClaim("c0", "n1", "", "gpu-0"))
	x.State.UpsertClaim(allocatedClaim("c1", "n1", "", "gpu-1=16Gi/0"))
	choose := func(pod *corev1.Pod) string {
		t.Helper()
		x.State.UpsertPod(pod, x.Class) // pending, as the informer shows it
		res := x.Filter(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names})
		if res.NodeNames == nil || len(*res.NodeNames) != 1 {
			t.Fatalf("%s: filter kept %v (failed %v)", pod.Name, res.NodeNames, res.FailedNodes)
		}
		return (*res.NodeNames)[0]
	}
	one := claimPod("one", "whole-1")
	if got := choose(one); got != "n2" {
		t.Fatalf("1-GPU claim pod placed on %s, want n2", got)
	}
	if got := gpuUse(t, x.State, "n2"); !strings.Contains(got, "whole=true") {
		t.Fatalf("choice not held on n2: %s", got)
	}
	if got := choose(claimPod("two", "whole-2")); got != "n3" {
		t.Fatalf("2-GPU claim pod placed on %s, want n3 (n2's other GPU is held)", got)
	}
	// The allocator's claim for the first pod replaces its hold: GPU 1 (the allocator's pick)
	// counts, the hold on the GPU the policy chose does not.
	x.State.UpsertClaim(allocatedClaim("c2", "n2", one.UID, "gpu-1"))
	if got, want := gpuUse(t, x.State, "n2"), "whole=false shares=0 milli=0; whole=true shares=0 milli=0"; got != want {
		t.Fatalf("claim allocated: n2 %s, want %s", got, want)
	}
	// A template not seen yet: nothing to place (the scheduler waits for the claim), so the pod
	// is CPU-only here and not refused.
	if got := choose(claimPod("later", "missing")); got == "" {
		t.Fatal("pod with a template not seen yet refused")
	}
}

// TestFilterRefusesBadClaim: a claim request that cannot be a share (compute past 100) refuses
// every node with the reason.
func TestFilterRefusesBadClaim(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	f := &fakeClaims{claims: map[string]*resourceapi.ResourceClaim{}, templates: map[string]*resourceapi.ResourceClaimTemplate{}}
	f.template("bad", claimSpec(exact("gpu", api.DRAClassShareGPU, 1, "memory=4Gi", "compute=150")))
	x.Claims = f.source()
	x.State.UpsertNode(testNode(testInventory("n1", 1, 2, "T4"), nil))
	names := []string{"n1"}
	res := x.Filter(&extenderv1.ExtenderArgs{Pod: claimPod("bad", "bad"), NodeNames: &names})
	if len(*res.NodeNames) != 0 || !strings.Contains(res.FailedAndUnresolvableNodes["n1"], "compute 150") {
		t.Fatalf("kept %v, refused %v", *res.NodeNames, res.FailedAndUnresolvableNodes)
	}
}

// TestClaimSourceReadsTheAPIObjects: a pod's claims are read from its generated claim once the
// pod's status names it (an allocated one left out: counted on its node), else from its template,
// or from the claim it names.
func TestClaimSourceReadsTheAPIObjects(t *testing.T) {
	f := &fakeClaims{claims: map[string]*resourceapi.ResourceClaim{}, templates: map[string]*resourceapi.ResourceClaimTemplate{}}
	f.template("t", claimSpec(exact("gpu", api.DRAClassWholeGPU, 1)))
	pod := claimPod("p", "t")
	count := func(unallocated bool) int {
		t.Helper()
		shapes, err := f.source().shapes(pod, unallocated)
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, s := range shapes {
			n += s.Whole
		}
		return n
	}
	if got := count(true); got != 1 {
		t.Fatalf("from the template: %d whole GPUs, want 1", got)
	}
	gen := "p-gpu-x"
	pod.Status.ResourceClaimStatuses = []corev1.PodResourceClaimStatus{{Name: "gpu", ResourceClaimName: &gen}}
	claim := allocatedClaim("g", "n1", pod.UID, "gpu-0")
	claim.Spec = claimSpec(exact("gpu", api.DRAClassWholeGPU, 3))
	f.claims["default/"+gen] = claim
	if got := count(false); got != 3 {
		t.Fatalf("from the generated claim: %d whole GPUs, want 3 (its spec, not the template's)", got)
	}
	if got := count(true); got != 0 {
		t.Fatalf("allocated claim: %d whole GPUs to place, want 0", got)
	}
	named := "shared"
	f.claims["default/shared"] = &resourceapi.ResourceClaim{Spec: claimSpec(exact("gpu", api.DRAClassWholeGPU, 2))}
	pod.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &named}}
	if got := count(true); got != 2 {
		t.Fatalf("a named claim: %d whole GPUs, want 2", got)
	}
}

// TestHoldingsLeaveClaimsToTheirAllocation: with claims read, a prepared claim in the node agent's
// holdings ("resourceclaim/<name>") is not counted a second time beside its allocation.
func TestHoldingsLeaveClaimsToTheirAllocation(t *testing.T) {
	s := NewState(0, nil)
	s.readClaims((&fakeClaims{}).source())
	inv := testInventory("n1", 1, 2, "T4")
	node := testNode(inv, nil)
	raw, err := api.EncodeHoldings(&api.NodeHoldings{Node: "n1", Pods: []api.PodHolding{
		{Namespace: "default", Pod: "p", UID: "uid-p", Containers: []api.ContainerAssignment{
			{Name: "resourceclaim/c-c1", Devices: []api.DeviceAssignment{{UUID: gpuUUID(1, 0), MemoryBytes: 4 << 30, CoresPercent: 30}}},
			{Name: "main", Devices: []api.DeviceAssignment{{UUID: gpuUUID(1, 1), Whole: true}}}}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	node.Annotations[api.AnnotationHoldings] = string(raw)
	s.UpsertNode(node)
	s.UpsertClaim(allocatedClaim("c1", "n1", "uid-p", "gpu-0=4Gi/30"))
	if got, want := gpuUse(t, s, "n1"), "whole=false shares=1 milli=300; whole=true shares=0 milli=0"; got != want {
		t.Fatalf("%s, want %s (the claim once, the pod's own GPU from the holdings)", got, want)
	}
}
