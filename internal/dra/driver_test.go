package dra

import (
	"context"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/utils/ptr"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

const gib = int64(1) << 30

type fakeAgent struct {
	inv *api.NodeInventory
	l   *ledger.Ledger
	gen *cdi.Generator

	mu        sync.Mutex
	unhealthy map[string]string
	changes   chan struct{}
}

func (f *fakeAgent) Inventory() *api.NodeInventory {
	f.mu.Lock()
	defer f.mu.Unlock()
	inv := *f.inv
	inv.GPUs = slices.Clone(inv.GPUs)
	for i := range inv.GPUs {
		_, bad := f.unhealthy[inv.GPUs[i].UUID]
		inv.GPUs[i].Healthy = !bad
	}
	return &inv
}
func (f *fakeAgent) Unhealthy() map[string]string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return maps.Clone(f.unhealthy)
}
func (f *fakeAgent) WatchInventory() <-chan struct{} { return f.changes }
func (f *fakeAgent) Ledger() *ledger.Ledger          { return f.l }
func (f *fakeAgent) Generator() *cdi.Generator       { return f.gen }

// setHealth marks a GPU or MIG instance unhealthy (why != "") or healthy, as the agent's health
// watch does, and tells the driver.
func (f *fakeAgent) setHealth(uuid, why string) {
	f.mu.Lock()
	if why == "" {
		delete(f.unhealthy, uuid)
	} else {
		f.unhealthy[uuid] = why
	}
	f.mu.Unlock()
	f.changes <- struct{}{}
}

// testInventory: GPUs 0 and 1 (40 GiB, NVLinked), GPU 2 in MIG mode with two instances, GPU 3
// unhealthy.
func testInventory() *api.NodeInventory {
	gpu := func(i int) api.GPU {
		return api.GPU{UUID: "GPU-" + string(rune('a'+i)), Index: i, Model: "NVIDIA A100-SXM4-40GB", MemoryBytes: 40 * gib, SMCount: 108,
			ComputeCapability: "8.0", NUMANode: i / 2, Minor: i, Healthy: true}
	}
	g2 := gpu(2)
	g2.MIG = &api.MIG{Instances: []api.MIGInstance{
		{UUID: "MIG-x", Profile: "3g.20gb", GPUInstanceID: 1, ComputeInstanceID: 0, MemoryBytes: 20 * gib, SMCount: 42},
		{UUID: "MIG-y", Profile: "1g.5gb", GPUInstanceID: 7, ComputeInstanceID: 0, MemoryBytes: 5 * gib, SMCount: 14},
	}}
	g3 := gpu(3)
	g3.Healthy = false
	return &api.NodeInventory{APIVersion: api.Version, Node: "node-a", SharesPerGPU: 3, GPUs: []api.GPU{gpu(0), gpu(1), g2, g3},
		Links: []api.Link{{A: 0, B: 1, Kind: api.LinkNVLink, NVLinks: 12}, {A: 1, B: 2, Kind: api.LinkPCIeSwitch}}}
}

func newDriver(t *testing.T) (*Driver, *fakeAgent, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "ledger.json")
	l, err := ledger.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	a := &fakeAgent{inv: testInventory(), l: l, gen: &cdi.Generator{Vendor: "tessera.dev"},
		unhealthy: map[string]string{"GPU-d": "XID 79"}, changes: make(chan struct{}, 1)}
	return New(a, nil), a, path
}

// claim is an allocated claim reserved for pod "p-<name>" with one result per device; capacity,
// when set, is the request's capacity and what the allocator recorded as consumed.
func claim(name string, capacity map[resourceapi.QualifiedName]string, devices ...string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name, UID: types.UID("uid-" + name)}}
	req := resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.tessera.dev"}}
	consumed := map[resourceapi.QualifiedName]resource.Quantity{}
	if capacity != nil {
		req.Exactly.Capacity = &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{}}
		for k, v := range capacity {
			req.Exactly.Capacity.Requests[k] = resource.MustParse(v)
			consumed[k] = resource.MustParse(v)
		}
	}
	c.Spec.Devices.Requests = []resourceapi.DeviceRequest{req}
	c.Status.Allocation = &resourceapi.AllocationResult{}
	for _, d := range devices {
		c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results, resourceapi.DeviceRequestAllocationResult{
			Request: "gpu", Driver: DriverName, Pool: "node-a", Device: d, ConsumedCapacity: consumed})
	}
	c.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: "p-" + name, UID: types.UID("pod-" + name)}}
	return c
}

func prepare(t *testing.T, d *Driver, c *resourceapi.ResourceClaim) kubeletplugin.PrepareResult {
	t.Helper()
	res, err := d.PrepareResourceClaims(context.Background(), []*resourceapi.ResourceClaim{c})
	if err != nil {
		t.Fatal(err)
	}
	r, ok := res[c.UID]
	if !ok || len(res) != 1 {
		t.Fatalf("prepare answered %v, want exactly one result for %s", res, c.UID)
	}
	return r
}

func cdiNames(r kubeletplugin.PrepareResult) []string {
	var out []string
	for _, d := range r.Devices {
		out = append(out, d.CDIDeviceIDs...)
	}
	return out
}

func TestResourcesModel(t *testing.T) {
	res := Resources(testInventory(), map[string]string{"GPU-d": "XID 79"}, resourceapi.DeviceTaintEffectNoSchedule, nil)
	pool, ok := res.Pools["node-a"]
	if !ok || len(res.Pools) != 1 {
		t.Fatalf("pools %v, want one named after the node", res.Pools)
	}
	if len(pool.Slices) != 2 || len(pool.Slices[0].SharedCounters) != 0 || len(pool.Slices[1].Devices) != 0 {
		t.Fatalf("want a devices slice and a separate counters slice, got %+v", pool.Slices)
	}
	var names []string
	byName := map[string]resourceapi.Device{}
	for _, d := range pool.Slices[0].Devices {
		names = append(names, d.Name)
		byName[d.Name] = d
	}
	if want := []string{"gpu-0", "gpu-1", "gpu-2-mig-1-0", "gpu-2-mig-7-0", "gpu-3"}; !slices.Equal(names, want) {
		t.Fatalf("devices %v, want %v (unhealthy GPU 3 tainted, MIG GPU 2 only as instances)", names, want)
	}
	g := byName["gpu-0"]
	if g.AllowMultipleAllocations == nil || !*g.AllowMultipleAllocations {
		t.Error("a GPU must allow multiple allocations (shares)")
	}
	mem := g.Capacity[CapacityMemory]
	if mem.Value.Value() != 40*gib || mem.RequestPolicy.Default.Value() != 40*gib || mem.RequestPolicy.ValidRange.Max.Value() != 40*gib {
		t.Errorf("memory capacity %+v: want 40 GiB, default all of it (a claim without capacity is whole)", mem)
	}
	comp := g.Capacity[CapacityCompute]
	if comp.Value.Value() != 100 || comp.RequestPolicy.Default.Value() != 0 || comp.RequestPolicy.ValidRange.Max.Value() != 100 || comp.RequestPolicy.ValidRange.Step.Value() != 1 {
		t.Errorf("compute capacity %+v: want 100%%, default 0 (no cores asked = none reserved), steps of 1", comp)
	}
	if sh := g.Capacity[CapacityShares]; sh.Value.Value() != 3 || sh.RequestPolicy.Default.Value() != 1 {
		t.Errorf("shares capacity %+v: want sharesPerGPU (3), one per allocation", sh)
	}
	attr := func(d resourceapi.Device, n resourceapi.QualifiedName) resourceapi.DeviceAttribute {
		return d.Attributes[n]
	}
	if *attr(g, AttrModel).StringValue != "NVIDIA A100-SXM4-40GB" || *attr(g, AttrComputeCapability).VersionValue != "8.0.0" ||
		*attr(g, AttrNUMANode).IntValue != 0 || *attr(g, AttrUUID).StringValue != "GPU-a" {
		t.Errorf("gpu-0 attributes %v", g.Attributes)
	}
	if *attr(byName["gpu-1"], AttrNVLinkDomain).IntValue != 0 || *attr(byName["gpu-2-mig-1-0"], AttrNVLinkDomain).IntValue != 2 {
		t.Error("NVLink domains: GPUs 0 and 1 share domain 0; GPU 2 (PCIe only) is its own")
	}
	m := byName["gpu-2-mig-1-0"]
	if m.AllowMultipleAllocations != nil || len(m.ConsumesCounters) != 1 || m.ConsumesCounters[0].CounterSet != "gpu-2-counters" ||
		!m.ConsumesCounters[0].Counters["memory"].Value.Equal(*resource.NewQuantity(20*gib, resource.BinarySI)) || *attr(m, AttrProfile).StringValue != "3g.20gb" {
		t.Errorf("MIG device %+v: want exclusive, consuming 20 GiB of its parent's counters", m)
	}
	cs := pool.Slices[1].SharedCounters
	if len(cs) != 1 || cs[0].Name != "gpu-2-counters" || !cs[0].Counters["memory"].Value.Equal(*resource.NewQuantity(40*gib, resource.BinarySI)) {
		t.Errorf("counter sets %+v: want GPU 2's memory", cs)
	}
}

func TestPrepareSharesRefusesOverCommit(t *testing.T) {
	d, a, _ := newDriver(t)
	share := map[resourceapi.QualifiedName]string{CapacityMemory: "10Gi", CapacityCompute: "30"}
	for _, n := range []string{"s1", "s2"} {
		r := prepare(t, d, claim(n, share, "gpu-0"))
		if r.Err != nil {
			t.Fatalf("%s: %v", n, r.Err)
		}
		if got, want := cdiNames(r), []string{"tessera.dev/vgpu=share", "tessera.dev/gpu=GPU-a"}; !slices.Equal(got, want) {
			t.Errorf("%s: CDI devices %v, want %v (the share token's spec: vcuda library; the GPU's node)", n, got, want)
		}
	}
	e, ok := a.l.Get(ledger.ClaimID("uid-s1"))
	if !ok || len(e.Devices) != 1 || e.Devices[0] != (api.DeviceAssignment{UUID: "GPU-a", MemoryBytes: 10 * gib, CoresPercent: 30}) ||
		e.PodUID != "pod-s1" || e.Claim == nil || e.Claim.Name != "s1" || !slices.Equal(e.Claim.PodUIDs, []string{"pod-s1"}) {
		t.Fatalf("ledger entry %+v: want the claim's 10 GiB / 30%% share, reserved for pod-s1", e)
	}
	// A device-plugin share of 15 GiB fits beside them (35 of 40 GiB)...
	if err := a.l.Reserve(ledger.Entry{ContainerID: "ctr-dp", PodUID: "pod-dp", Devices: []api.DeviceAssignment{{UUID: "GPU-a", MemoryBytes: 15 * gib, CoresPercent: 30}}}, a.inv); err != nil {
		t.Fatal(err)
	}
	// ...and then a DRA share of 10 GiB that the scheduler (which sees only DRA allocations) put there
	// does not: prepare refuses what the ledger cannot hold.
	r := prepare(t, d, claim("s3", share, "gpu-0"))
	if r.Err == nil || !strings.Contains(r.Err.Error(), "over-commit") {
		t.Fatalf("a third share over the GPU's memory was prepared: %v", r.Err)
	}
	if _, ok := a.l.Get(ledger.ClaimID("uid-s3")); ok {
		t.Error("a refused claim left a ledger entry")
	}
	// Nor may a whole GPU go where shares are.
	if r := prepare(t, d, claim("w", nil, "gpu-0")); r.Err == nil {
		t.Error("a whole-GPU claim was prepared on a GPU holding shares")
	}
	// Compute is counted across both front doors too: 30+30+30 used, 20 more fits, 11 does not.
	if r := prepare(t, d, claim("c", map[resourceapi.QualifiedName]string{CapacityMemory: "1Gi", CapacityCompute: "11"}, "gpu-0")); r.Err == nil {
		t.Error("a share over the GPU's compute was prepared")
	}
}

func TestPrepareWholeMIGAndRelease(t *testing.T) {
	d, a, path := newDriver(t)
	r := prepare(t, d, claim("w", nil, "gpu-1"))
	if r.Err != nil {
		t.Fatal(r.Err)
	}
	if got, want := cdiNames(r), []string{"tessera.dev/gpu=common", "tessera.dev/gpu=GPU-b"}; !slices.Equal(got, want) {
		t.Errorf("whole claim CDI devices %v, want %v", got, want)
	}
	if u := a.l.Usage()["GPU-b"]; !u.Whole {
		t.Fatalf("GPU-b usage %+v: want whole", u)
	}
	// The device-plugin path cannot share it now.
	if err := a.l.Reserve(ledger.Entry{ContainerID: "ctr", Devices: []api.DeviceAssignment{{UUID: "GPU-b", MemoryBytes: gib}}}, a.inv); err == nil {
		t.Error("a device-plugin share went onto a GPU a claim holds whole")
	}
	r = prepare(t, d, claim("m", nil, "gpu-2-mig-7-0"))
	if got := cdiNames(r); r.Err != nil || !slices.Equal(got, []string{"tessera.dev/mig=MIG-y"}) {
		t.Fatalf("MIG claim: %v %v", got, r.Err)
	}
	if r := prepare(t, d, claim("m2", nil, "gpu-2-mig-7-0")); r.Err == nil {
		t.Error("a MIG instance was prepared for two claims")
	}
	// Idempotent: the kubelet asks again after a restart.
	if r := prepare(t, d, claim("w", nil, "gpu-1")); r.Err != nil {
		t.Fatalf("preparing a prepared claim again: %v", r.Err)
	}
	// The ledger on disk is the checkpoint: an agent restart finds every claim.
	l2, err := ledger.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"uid-w", "uid-m"} {
		if _, ok := l2.Get(ledger.ClaimID(id)); !ok {
			t.Errorf("claim %s lost across a restart", id)
		}
	}
	a.l = l2
	var told []string
	d.OnUnprepared(func(uid string) { told = append(told, uid) })
	res, err := d.UnprepareResourceClaims(context.Background(), []kubeletplugin.NamespacedObject{
		{NamespacedName: types.NamespacedName{Namespace: "ns", Name: "w"}, UID: "uid-w"},
		{NamespacedName: types.NamespacedName{Namespace: "ns", Name: "gone"}, UID: "uid-gone"},
	})
	if err != nil || len(res) != 2 || res["uid-w"] != nil || res["uid-gone"] != nil {
		t.Fatalf("unprepare: %v %v (unknown claims are already released)", res, err)
	}
	if u := l2.Usage()["GPU-b"]; u.Whole {
		t.Error("unprepare did not release the whole GPU")
	}
	// The NRI plugin hears of each (it removes a claim's shared vcuda files), known or not.
	if !slices.Equal(told, []string{"uid-w", "uid-gone"}) {
		t.Errorf("OnUnprepared told of %v, want both claims", told)
	}
}

func TestPrepareRefusals(t *testing.T) {
	d, a, _ := newDriver(t)
	a.unhealthy["MIG-x"] = "XID 94"
	unreserved := claim("u", nil, "gpu-0")
	unreserved.Status.ReservedFor = nil
	otherPool := claim("o", nil, "gpu-0")
	otherPool.Status.Allocation.Devices.Results[0].Pool = "node-b"
	unallocated := claim("n", nil, "gpu-0")
	unallocated.Status.Allocation = nil
	for _, tc := range []struct {
		c    *resourceapi.ResourceClaim
		want string
	}{
		{unreserved, "reserved for no pod"},
		{otherPool, `pool "node-b"`},
		{unallocated, "not allocated"},
		{claim("x", nil, "gpu-9"), "not a device of this node"},
		{claim("sick", nil, "gpu-3"), "unhealthy"},
		{claim("sick-mig", nil, "gpu-2-mig-1-0"), "MIG instance MIG-x is unhealthy (XID 94)"},
		{claim("big", map[resourceapi.QualifiedName]string{CapacityMemory: "41Gi"}, "gpu-0"), "outside the GPU"},
	} {
		r := prepare(t, d, tc.c)
		if r.Err == nil || !strings.Contains(r.Err.Error(), tc.want) {
			t.Errorf("claim %s: error %v, want one saying %q", tc.c.Name, r.Err, tc.want)
		}
	}
}

// A GPU allows multiple allocations (shares), so a claim whose two requests have no
// distinctAttribute constraint may be allocated one GPU twice. Prepare refuses it, naming the
// claim, the device and the fix, and records nothing; the ledger itself refuses an entry that
// lists one GPU twice (such an entry would stop the node's holdings annotation from encoding).
func TestSecurityDRAClaimSameGPUTwice(t *testing.T) {
	d, a, _ := newDriver(t)
	share := map[resourceapi.QualifiedName]string{CapacityMemory: "10Gi"}
	twoRequests := claim("two", share, "gpu-0", "gpu-0")
	second := twoRequests.Spec.Devices.Requests[0]
	second.Name = "b"
	twoRequests.Spec.Devices.Requests = append(twoRequests.Spec.Devices.Requests, second)
	results := twoRequests.Status.Allocation.Devices.Results
	results[0].ShareID, results[1].ShareID = ptr.To(types.UID("s-1")), ptr.To(types.UID("s-2"))
	results[1].Request = "b"
	countTwo := claim("count", share, "gpu-0", "gpu-0")
	for _, tc := range []struct {
		c    *resourceapi.ResourceClaim
		want []string
	}{
		{twoRequests, []string{"ns/two", "gpu-0", `both request "gpu" and request "b"`, "distinctAttribute: gpu.tessera.dev/uuid", "requests: [gpu, b]"}},
		{countTwo, []string{"ns/count", "gpu-0", `request "gpu" twice`, "requests: [gpu]"}},
	} {
		r := prepare(t, d, tc.c)
		if r.Err == nil {
			t.Fatalf("claim %s holding gpu-0 twice was prepared", tc.c.Name)
		}
		for _, w := range tc.want {
			if !strings.Contains(r.Err.Error(), w) {
				t.Errorf("claim %s: error %q does not say %q", tc.c.Name, r.Err, w)
			}
		}
		if _, ok := a.l.Get(ledger.ClaimID(string(tc.c.UID))); ok {
			t.Errorf("claim %s: a refused claim left a ledger entry", tc.c.Name)
		}
	}
	// The same shares on two GPUs are fine.
	apart := claim("apart", share, "gpu-0", "gpu-1")
	if r := prepare(t, d, apart); r.Err != nil {
		t.Fatalf("two shares on two GPUs: %v", r.Err)
	}
	// Whichever front door: the ledger gives a holder a device once.
	for _, e := range []ledger.Entry{
		{ContainerID: "ctr-twice", Devices: []api.DeviceAssignment{{UUID: "GPU-b", MemoryBytes: gib}, {UUID: "GPU-b", MemoryBytes: gib}}},
		{ContainerID: "ctr-whole-twice", Devices: []api.DeviceAssignment{{UUID: "GPU-b", Whole: true}, {UUID: "GPU-b", Whole: true}}},
		{ContainerID: "ctr-mig-twice", MIG: []string{"MIG-x", "MIG-x"}},
	} {
		if err := a.l.Reserve(e, a.inv); err == nil || !strings.Contains(err.Error(), "listed twice") {
			t.Errorf("entry %s listing a device twice: %v, want a refusal", e.ContainerID, err)
		}
	}
}

// TestSecurityDRASmallCapRefused: a share below what vcuda charges one CUDA context on the GPU
// (api.ContextOverheadBytes: 384 MiB on the test's 8.0 GPUs) could create no context at all. The
// slices publish that as the least memory a share may take (the allocator rounds a smaller request
// up to it), and prepare refuses an allocation below it (slices of an older agent, a hand-made
// allocation), naming the overhead, and records nothing.
func TestSecurityDRASmallCapRefused(t *testing.T) {
	for _, dev := range Resources(testInventory(), nil, resourceapi.DeviceTaintEffectNoSchedule, nil).Pools["node-a"].Slices[0].Devices {
		if !strings.HasPrefix(dev.Name, "gpu-") || strings.Contains(dev.Name, "mig") {
			continue
		}
		if min := dev.Capacity[CapacityMemory].RequestPolicy.ValidRange.Min; min == nil || min.Value() != 384<<20 {
			t.Errorf("%s: a share's least memory is %v, want 384Mi", dev.Name, min)
		}
	}
	d, a, _ := newDriver(t)
	small := claim("small", map[resourceapi.QualifiedName]string{CapacityMemory: "256Mi"}, "gpu-0")
	r := prepare(t, d, small)
	if r.Err == nil {
		t.Fatal("a 256 MiB share on an 8.0 GPU was prepared")
	}
	for _, w := range []string{"ns/small", "gpu-0", "share memory 256Mi is below the 384 MiB a CUDA context takes", "at least 384Mi"} {
		if !strings.Contains(r.Err.Error(), w) {
			t.Errorf("error %q does not say %q", r.Err, w)
		}
	}
	if _, ok := a.l.Get(ledger.ClaimID(string(small.UID))); ok {
		t.Error("a refused claim left a ledger entry")
	}
	if r := prepare(t, d, claim("enough", map[resourceapi.QualifiedName]string{CapacityMemory: "384Mi"}, "gpu-0")); r.Err != nil {
		t.Fatalf("a 384 MiB share on an 8.0 GPU: %v", r.Err)
	}
}
