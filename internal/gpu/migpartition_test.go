package gpu

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// dynamicNode is one H100 with MIG off, as dynamic MIG finds it.
const dynamicNode = "apiVersion: tessera.dev/v1\nkind: SimulatedNode\ngpus:\n- model: H100-SXM5-80GB\n  count: 1\n"

func placementOf(t *testing.T, places []MIGPlacement, profile string, start uint32) MIGPlacement {
	t.Helper()
	for _, p := range places {
		if p.Profile == profile && p.Start == start {
			return p
		}
	}
	t.Fatalf("no placement of %s at slice %d in %v", profile, start, places)
	return MIGPlacement{}
}

func migMode(t *testing.T, b *simBackend) int {
	t.Helper()
	mode, _, ret := b.srv.Devices[0].GetMigMode()
	if ret != nvml.SUCCESS {
		t.Fatal(nvml.ErrorString(ret))
	}
	return mode
}

// Create switches MIG mode on and makes the instance discoverable as a MIG device; Destroy of the
// last instance switches MIG mode off, so discovery sees a whole GPU again.
func TestPartitionerCreatesAndDestroys(t *testing.T) {
	b, n := openTestSim(t, dynamicNode)
	p := NewPartitioner(b.srv)
	uuid := n.GPUs[0].UUID
	places, slices, err := p.Placements(uuid)
	if err != nil {
		t.Fatal(err)
	}
	if slices != 8 {
		t.Errorf("an H100 has 8 memory slices, Placements says %d", slices)
	}
	one, err := p.Create(uuid, placementOf(t, places, "1g.10gb", 6))
	if err != nil {
		t.Fatal(err)
	}
	three, err := p.Create(uuid, placementOf(t, places, "3g.40gb", 0))
	if err != nil {
		t.Fatal(err)
	}
	n2, err := b.Discover(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if g := n2.GPUs[0]; g.MIG == nil || len(g.MIG.Instances) != 2 {
		t.Fatalf("after two creates discovery finds %+v, want two MIG instances", g.MIG)
	}
	if got := n2.GPUs[0].MIG.Instances; got[0].UUID != one.UUID || got[1].UUID != three.UUID || got[1].Profile != "3g.40gb" {
		t.Errorf("discovered %+v, created %+v and %+v", got, one, three)
	}
	for _, c := range []MIGCreated{one, three} {
		if err := p.Destroy(uuid, c.GPUInstance, c.ComputeInstance); err != nil {
			t.Fatal(err)
		}
	}
	if migMode(t, b) != nvml.DEVICE_MIG_DISABLE {
		t.Error("MIG mode stays on after the last instance is destroyed")
	}
	n3, _ := b.Discover(t.Context())
	if !n3.GPUs[0].Shareable() {
		t.Errorf("after destroying every instance the GPU is not whole again: %+v", n3.GPUs[0].MIG)
	}
	// A retried destroy of what is gone is not an error.
	if err := p.Destroy(uuid, one.GPUInstance, one.ComputeInstance); err != nil {
		t.Errorf("destroying a destroyed instance: %v", err)
	}
}

// NVML refuses a placement over an existing instance, and a failed Create leaves the GPU as it was:
// the instance already there stays, and MIG mode it switched on goes back off.
func TestPartitionerRefusesOverlapAndRollsBack(t *testing.T) {
	b, n := openTestSim(t, dynamicNode)
	p := NewPartitioner(b.srv)
	uuid := n.GPUs[0].UUID
	places, _, _ := p.Placements(uuid)
	if _, err := p.Create(uuid, MIGPlacement{Profile: "1g.10gb", ProfileID: 19, Start: 99, Size: 1, ComputeSlices: 1}); err == nil {
		t.Fatal("a placement the profile does not have was created")
	}
	if migMode(t, b) != nvml.DEVICE_MIG_DISABLE {
		t.Error("a failed Create left MIG mode on")
	}
	three, err := p.Create(uuid, placementOf(t, places, "3g.40gb", 0))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Create(uuid, placementOf(t, places, "1g.10gb", 2)); err == nil {
		t.Fatal("a 1g instance over the 3g instance's memory slices was created")
	}
	got, err := p.Instances(uuid)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].GPUInstance != three.GPUInstance || len(got[0].ComputeInstances) != 1 {
		t.Errorf("after the refused overlap the GPU holds %+v, want only the 3g instance %+v", got, three)
	}
}

// A process on the GPU keeps it out of MIG mode (NVML's activation status IN_USE): Create fails
// with ErrMIGInUse and leaves MIG mode off, and nothing resets the GPU.
func TestPartitionerRefusesInUse(t *testing.T) {
	b, n := openTestSim(t, dynamicNode)
	proc := t.TempDir()
	b.procs.procRoot = proc
	fakeProc(t, proc, 5001, 900, "5001\t1", 111)
	d := b.srv.Devices[0].(*server.Device)
	if err := os.WriteFile(filepath.Join(b.procs.dir, "900-1-111.proc"), simRecord(900, 1, 111, simProcDev{Minor: uint32(d.Minor), Ctxs: 1, Used: 1 << 20}), 0o644); err != nil {
		t.Fatal(err)
	}
	p := NewPartitioner(b.srv)
	places, _, _ := p.Placements(n.GPUs[0].UUID)
	_, err := p.Create(n.GPUs[0].UUID, placementOf(t, places, "1g.10gb", 0))
	if !errors.Is(err, ErrMIGInUse) {
		t.Fatalf("Create with a process on the GPU: %v, want ErrMIGInUse", err)
	}
	if migMode(t, b) != nvml.DEVICE_MIG_DISABLE {
		t.Error("MIG mode changed under a running process")
	}
}
