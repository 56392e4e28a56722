package dra

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/gpu"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// twoH100s: GPU 0 with MIG off (dynamic MIG carves it), GPU 1 with an operator's MIG layout (left
// alone).
const twoH100s = "apiVersion: tessera.dev/v1\nkind: SimulatedNode\nseed: dra-dyn\ngpus:\n- model: H100-SXM5-80GB\n  count: 1\n" +
	"- model: H100-SXM5-80GB\n  count: 1\n  mig: [4g.40gb, 1g.10gb]\n"

// simAgent is the agent over the simulated node: its inventory is what discovery last found.
type simAgent struct {
	b   gpu.Backend
	l   *ledger.Ledger
	gen *cdi.Generator

	mu   sync.Mutex
	node *gpu.Node
}

func (a *simAgent) Refresh(ctx context.Context) error {
	n, err := a.b.Discover(ctx)
	if err != nil {
		return err
	}
	a.mu.Lock()
	a.node = n
	a.mu.Unlock()
	return nil
}
func (a *simAgent) Inventory() *api.NodeInventory {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.node.Inventory("node-a", 4)
}
func (a *simAgent) Unhealthy() map[string]string    { return map[string]string{} }
func (a *simAgent) WatchInventory() <-chan struct{} { return make(chan struct{}) }
func (a *simAgent) Ledger() *ledger.Ledger          { return a.l }
func (a *simAgent) Generator() *cdi.Generator       { return a.gen }

// countingPartitioner is the real Partitioner, counting the creates the driver asks of it.
type countingPartitioner struct {
	*gpu.Partitioner
	creates int
}

func (c *countingPartitioner) Create(uuid string, p gpu.MIGPlacement) (gpu.MIGCreated, error) {
	c.creates++
	return c.Partitioner.Create(uuid, p)
}

type dynEnv struct {
	d       *Driver
	a       *simAgent
	p       *countingPartitioner
	journal string
	gpu0    string
}

// newDynamic is the driver with dynamic MIG over a fresh simulated node; records, when set, is the
// journal a previous run left.
func newDynamic(t *testing.T, records []migRecord, prepared ...string) *dynEnv {
	t.Helper()
	dir := t.TempDir()
	desc := filepath.Join(dir, "node.yaml")
	if err := os.WriteFile(desc, []byte(twoH100s), 0o644); err != nil {
		t.Fatal(err)
	}
	b, err := gpu.Open(gpu.Options{Backend: "sim", NodeDescription: desc, StateDir: filepath.Join(dir, "sim")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	l, err := ledger.Open(filepath.Join(dir, "ledger.json"), nil)
	if err != nil {
		t.Fatal(err)
	}
	a := &simAgent{b: b, l: l, gen: &cdi.Generator{Vendor: "tessera.dev"}}
	if err := a.Refresh(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, uid := range prepared {
		if err := l.Reserve(ledger.Entry{ContainerID: ledger.ClaimID(uid), Claim: &ledger.Claim{UID: uid}}, a.Inventory()); err != nil {
			t.Fatal(err)
		}
	}
	env := &dynEnv{a: a, p: &countingPartitioner{Partitioner: gpu.NewPartitioner(b.NVML())}, journal: filepath.Join(dir, "dra-mig.json"), gpu0: a.Inventory().GPUs[0].UUID}
	if records != nil {
		raw, _ := json.Marshal(journalFile{APIVersion: journalVersion, Records: records})
		if err := os.WriteFile(env.journal, raw, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	capable := a.node.MIGCapable
	env.d, err = New(a, nil).WithDynamicMIG(DynamicMIG{Partitioner: env.p, Refresh: a.Refresh, JournalPath: env.journal,
		MIGCapable: func(uuid string) bool { return capable[uuid] }})
	if err != nil {
		t.Fatal(err)
	}
	return env
}

func (e *dynEnv) instances(t *testing.T) []gpu.Instance {
	t.Helper()
	in, err := e.p.Instances(e.gpu0)
	if err != nil {
		t.Fatal(err)
	}
	return in
}

func (e *dynEnv) unprepare(t *testing.T, c *resourceapi.ResourceClaim) error {
	t.Helper()
	res, err := e.d.UnprepareResourceClaims(context.Background(), []kubeletplugin.NamespacedObject{{UID: c.UID}})
	if err != nil {
		t.Fatal(err)
	}
	return res[c.UID]
}

func (e *dynEnv) records(t *testing.T) []migRecord {
	t.Helper()
	raw, err := os.ReadFile(e.journal)
	if os.IsNotExist(err) {
		return nil
	}
	var f journalFile
	if err := json.Unmarshal(raw, &f); err != nil {
		t.Fatal(err)
	}
	return f.Records
}

// The dynamic GPU is published as the GPU device plus every H100 profile at every placement, all
// consuming its counter set; the GPU with an operator's layout keeps its instances as devices.
func TestDynamicMIGPublishesPartitionableGPU(t *testing.T) {
	e := newDynamic(t, nil)
	dyn := e.d.partitionable()
	if len(dyn) != 1 || dyn[e.gpu0].Placements == nil {
		t.Fatalf("partitionable GPUs %v: want GPU 0 only (GPU 1 holds MIG instances Tessera did not create)", dyn)
	}
	res := Resources(e.a.Inventory(), nil, resourceapi.DeviceTaintEffectNoSchedule, dyn)
	byName := map[string]resourceapi.Device{}
	var sets []resourceapi.CounterSet
	for _, s := range res.Pools["node-a"].Slices {
		for _, d := range s.Devices {
			byName[d.Name] = d
		}
		sets = append(sets, s.SharedCounters...)
	}
	// 1g.10gb x7, 1g.10gb+me x7, 1g.20gb x4, 2g.20gb x3, 3g.40gb x2, 4g.40gb, 7g.80gb; the GPU; GPU 1's two instances.
	if len(byName) != 25+1+2 {
		t.Errorf("%d devices, want 28: %v", len(byName), slices.Sorted(func(yield func(string) bool) {
			for n := range byName {
				if !yield(n) {
					return
				}
			}
		}))
	}
	whole, one, three := byName["gpu-0"], byName["gpu-0-mig-1g-10gb-6"], byName["gpu-0-mig-3g-40gb-4"]
	if len(whole.ConsumesCounters) != 1 || len(whole.ConsumesCounters[0].Counters) != 9 {
		t.Errorf("the whole GPU consumes %+v, want all 8 memory slices and the compute slices", whole.ConsumesCounters)
	}
	if c := one.ConsumesCounters; len(c) != 1 || len(c[0].Counters) != 2 || counterValue(c[0].Counters, "memory-slice-6") != 1 || counterValue(c[0].Counters, counterComputeSlices) != 1 {
		t.Errorf("1g.10gb at slice 6 consumes %+v, want memory slice 6 and one compute slice", c)
	}
	if c := three.ConsumesCounters; len(c) != 1 || len(c[0].Counters) != 5 || counterValue(c[0].Counters, "memory-slice-7") != 1 || counterValue(c[0].Counters, counterComputeSlices) != 3 {
		t.Errorf("3g.40gb at slice 4 consumes %+v, want memory slices 4-7 and three compute slices", c)
	}
	if len(sets) != 2 || sets[0].Name != counterSetName(0) || counterValue(sets[0].Counters, counterComputeSlices) != 7 {
		t.Errorf("counter sets %+v: want GPU 0's, with 7 compute slices, and GPU 1's", sets)
	}
	if _, ok := byName["gpu-1"]; ok {
		t.Error("GPU 1, in the operator's MIG mode, is offered whole")
	}
}

// A 1g and a 3g claim create their instances at prepare; the GPU cannot be had whole meanwhile;
// unprepare destroys them and switches MIG mode off, and a whole-GPU claim then gets the GPU.
func TestDynamicMIGPrepareCreatesUnprepareDestroys(t *testing.T) {
	e := newDynamic(t, nil)
	one, three := claim("one", nil, "gpu-0-mig-1g-10gb-6"), claim("three", nil, "gpu-0-mig-3g-40gb-0")
	for _, c := range []*resourceapi.ResourceClaim{one, three} {
		r := prepare(t, e.d, c)
		if r.Err != nil {
			t.Fatalf("prepare %s: %v", c.Name, r.Err)
		}
		entry, _ := e.a.l.Get(ledger.ClaimID(string(c.UID)))
		if len(entry.MIG) != 1 || !slices.Equal(entry.Partitions, []string{e.gpu0}) {
			t.Fatalf("ledger entry of %s: %+v, want its MIG instance and a hold on GPU 0", c.Name, entry)
		}
		if names := cdiNames(r); len(names) != 1 || names[0] != "tessera.dev/mig="+entry.MIG[0] {
			t.Errorf("CDI devices of %s: %v, want the new instance's", c.Name, names)
		}
	}
	if in := e.instances(t); len(in) != 2 {
		t.Fatalf("GPU 0 holds %+v, want the 1g and 3g instances", in)
	}
	if inv := e.a.Inventory(); inv.GPUs[0].MIG == nil || len(inv.GPUs[0].MIG.Instances) != 2 {
		t.Errorf("rediscovery after prepare does not show the instances: %+v (the device plugins would not see them)", inv.GPUs[0].MIG)
	}
	whole := claim("whole", nil, "gpu-0")
	if r := prepare(t, e.d, whole); r.Err == nil || !strings.Contains(r.Err.Error(), "partitioned") {
		t.Errorf("whole GPU 0 while it holds MIG instances: %v, want refused", r.Err)
	}
	for _, c := range []*resourceapi.ResourceClaim{one, three} {
		if err := e.unprepare(t, c); err != nil {
			t.Fatal(err)
		}
	}
	if in := e.instances(t); len(in) != 0 {
		t.Errorf("after unprepare GPU 0 still holds %+v", in)
	}
	if len(e.records(t)) != 0 {
		t.Errorf("journal after unprepare: %+v", e.records(t))
	}
	if r := prepare(t, e.d, whole); r.Err != nil {
		t.Errorf("whole GPU 0 once its instances are gone: %v", r.Err)
	}
}

// A claim whose second instance NVML refuses (it overlaps the first: a stale allocation) keeps
// nothing: the first instance is destroyed, the journal is empty and the ledger holds no entry.
func TestDynamicMIGPartialFailureRollsBack(t *testing.T) {
	e := newDynamic(t, nil)
	c := claim("both", nil, "gpu-0-mig-3g-40gb-0", "gpu-0-mig-1g-10gb-2")
	r := prepare(t, e.d, c)
	if r.Err == nil {
		t.Fatal("overlapping instances prepared")
	}
	if in := e.instances(t); len(in) != 0 {
		t.Errorf("after the failed prepare GPU 0 holds %+v, want nothing", in)
	}
	if h, _ := e.a.b.NVML().DeviceGetHandleByIndex(0); h != nil {
		if m, _, _ := h.GetMigMode(); m != 0 {
			t.Error("MIG mode stays on after the rollback")
		}
	}
	if recs := e.records(t); len(recs) != 0 {
		t.Errorf("journal after the rollback: %+v", recs)
	}
	if _, held := e.a.l.Get(ledger.ClaimID(string(c.UID))); held {
		t.Error("the ledger keeps the failed claim's hold on GPU 0")
	}
}

// A GPU held in shares is not partitioned: the ledger refuses before any instance is created.
func TestDynamicMIGRefusedWhileShared(t *testing.T) {
	e := newDynamic(t, nil)
	share := claim("share", map[resourceapi.QualifiedName]string{CapacityMemory: "10Gi"}, "gpu-0")
	if r := prepare(t, e.d, share); r.Err != nil {
		t.Fatal(r.Err)
	}
	if r := prepare(t, e.d, claim("mig", nil, "gpu-0-mig-1g-10gb-0")); r.Err == nil || !strings.Contains(r.Err.Error(), "nothing holds it") {
		t.Errorf("MIG on a shared GPU: %v, want refused by the ledger", r.Err)
	}
	if e.p.creates != 0 {
		t.Errorf("%d MIG instances were created on a shared GPU before the refusal", e.p.creates)
	}
}

// Start-up cleanup destroys what the journal says Tessera created for a claim the ledger no longer
// holds, keeps a prepared claim's instance, and never touches an instance it did not create.
func TestDynamicMIGStartupCleanupOnlyOwn(t *testing.T) {
	seed := newDynamic(t, nil)
	places, _, _ := seed.p.Placements(seed.gpu0)
	at := func(profile string, start uint32) gpu.MIGPlacement {
		i := slices.IndexFunc(places, func(p gpu.MIGPlacement) bool { return p.Profile == profile && p.Start == start })
		return places[i]
	}
	// Instances made on the same simulated GPU through NVML, as a previous run (or someone else) did.
	gone, err := seed.p.Create(seed.gpu0, at("1g.10gb", 0))
	if err != nil {
		t.Fatal(err)
	}
	kept, _ := seed.p.Create(seed.gpu0, at("1g.10gb", 1))
	foreign, _ := seed.p.Create(seed.gpu0, at("2g.20gb", 2))
	crashed, _ := seed.p.Create(seed.gpu0, at("1g.10gb", 5)) // created, the crash came before the journal said so
	rec := func(claim string, start uint32, c gpu.MIGCreated) migRecord {
		return migRecord{Claim: claim, Device: "gpu-0-mig-1g-10gb-" + string(rune('0'+start)), Parent: seed.gpu0, Profile: "1g.10gb",
			ProfileID: at("1g.10gb", 0).ProfileID, Start: start, GPUInstance: c.GPUInstance, ComputeInstance: c.ComputeInstance, UUID: c.UUID}
	}
	intent := rec("uid-crashed", 5, gpu.MIGCreated{GPUInstance: -1})
	// Before a reboot Tessera had an instance with the GPU instance ID the foreign one has now.
	reused := migRecord{Claim: "uid-before-reboot", Device: "gpu-0-mig-2g-20gb-2", Parent: seed.gpu0, Profile: "2g.20gb", ProfileID: at("2g.20gb", 2).ProfileID,
		Start: 2, GPUInstance: foreign.GPUInstance, ComputeInstance: foreign.ComputeInstance, UUID: "MIG-00000000-0000-4000-8000-000000000000"}
	records := []migRecord{rec("uid-gone", 0, gone), rec("uid-kept", 1, kept), intent, reused}
	raw, _ := json.Marshal(journalFile{APIVersion: journalVersion, Records: records})
	if err := os.WriteFile(seed.journal, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := seed.a.l.Reserve(ledger.Entry{ContainerID: ledger.ClaimID("uid-kept"), Claim: &ledger.Claim{UID: "uid-kept"}, MIG: []string{kept.UUID},
		Partitions: []string{seed.gpu0}}, seed.a.Inventory()); err != nil {
		t.Fatal(err)
	}
	d, err := New(seed.a, nil).WithDynamicMIG(DynamicMIG{Partitioner: seed.p, Refresh: seed.a.Refresh, JournalPath: seed.journal,
		MIGCapable: func(string) bool { return true }})
	if err != nil {
		t.Fatal(err)
	}
	d.cleanupMIG(context.Background(), seed.a.l)
	left := map[int]bool{}
	for _, in := range seed.instances(t) {
		left[in.GPUInstance] = true
	}
	if left[gone.GPUInstance] || left[crashed.GPUInstance] {
		t.Errorf("instances left %v: the gone claim's (%d) and the crashed create's (%d) must be destroyed", left, gone.GPUInstance, crashed.GPUInstance)
	}
	if !left[kept.GPUInstance] || !left[foreign.GPUInstance] {
		t.Errorf("instances left %v: the prepared claim's (%d) and the one Tessera did not create (%d) must stay", left, kept.GPUInstance, foreign.GPUInstance)
	}
	if recs := seed.records(t); len(recs) != 1 || recs[0].Claim != "uid-kept" {
		t.Errorf("journal after cleanup %+v, want only the prepared claim's record", recs)
	}
}

func counterValue(c map[string]resourceapi.Counter, name string) int64 {
	v := c[name].Value
	return v.Value()
}
