package agent_test

import (
	"slices"
	"testing"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// DRA claims hold GPUs the kubelet does not count against the device plugins' tokens: a GPU a claim
// holds whole is not offered whole (nor in shares), and each claim share takes one share token of
// its GPU; device-plugin holdings stay counted by the kubelet (only the mode lock applies).
func TestDRAClaimsTakeTokens(t *testing.T) {
	a, _ := newAgent(t)
	inv := a.Inventory()
	var usable []string
	for _, g := range inv.GPUs {
		if g.Shareable() {
			usable = append(usable, g.UUID)
		}
	}
	n := len(usable)
	claim := func(id string, d api.DeviceAssignment) {
		t.Helper()
		err := a.Ledger().Reserve(ledger.Entry{ContainerID: ledger.ClaimID(id), PodUID: "p-" + id, Namespace: "ns", Pod: "p", Container: "resourceclaim/" + id,
			Devices: []api.DeviceAssignment{d}, Claim: &ledger.Claim{UID: id, Namespace: "ns", Name: id, PodUIDs: []string{"p-" + id}}}, inv)
		if err != nil {
			t.Fatal(err)
		}
	}
	claim("w", api.DeviceAssignment{UUID: usable[0], Whole: true})
	claim("s1", api.DeviceAssignment{UUID: usable[1], MemoryBytes: 1 << 30})
	claim("s2", api.DeviceAssignment{UUID: usable[1], MemoryBytes: 1 << 30})
	// A device-plugin share: the kubelet counts its token itself.
	if err := a.Ledger().Reserve(ledger.Entry{ContainerID: "c", PodUID: "p", Devices: []api.DeviceAssignment{{UUID: usable[2], MemoryBytes: 1 << 30}}}, inv); err != nil {
		t.Fatal(err)
	}
	if got, want := len(healthy(a.Devices(api.ResourceGPU))), n-3; got != want {
		t.Errorf("%d whole tokens healthy, want %d (a claim's whole GPU and two GPUs holding shares are out)", got, want)
	}
	if got, want := len(healthy(a.Devices(api.ResourceShare))), (n-1)*10-2; got != want {
		t.Errorf("%d share tokens healthy, want %d (the whole-claimed GPU offers none; the two claim shares take two)", got, want)
	}
}

// Claims and device-plugin offers agree for MIG too: an instance a DRA claim holds is reported
// unhealthy to the kubelet (which does not count claims) until the claim is unprepared; an
// instance a device-plugin container holds stays offered (the kubelet counts that one itself).
func TestSecurityMIGHeldByClaimNotOffered(t *testing.T) {
	a, _ := newAgent(t)
	inv := a.Inventory()
	var mig []api.MIGInstance
	for _, g := range inv.GPUs {
		if g.MIG != nil {
			mig = g.MIG.Instances
		}
	}
	if len(mig) < 2 {
		t.Fatalf("the simulated node has %d MIG instances, want two or more", len(mig))
	}
	held, other := mig[0], mig[1]
	offered := func(m api.MIGInstance) bool {
		return slices.Contains(healthy(a.Devices(api.MIGResource(m.Profile))), m.UUID)
	}
	if !offered(held) || !offered(other) {
		t.Fatal("free MIG instances are not offered")
	}
	claim := ledger.Entry{ContainerID: ledger.ClaimID("m"), PodUID: "p-m", Namespace: "ns", Pod: "p", Container: "resourceclaim/m",
		MIG: []string{held.UUID}, Claim: &ledger.Claim{UID: "m", Namespace: "ns", Name: "m", PodUIDs: []string{"p-m"}}}
	if err := a.Ledger().Reserve(claim, inv); err != nil {
		t.Fatal(err)
	}
	if err := a.Ledger().Reserve(ledger.Entry{ContainerID: "c", PodUID: "p", MIG: []string{other.UUID}}, inv); err != nil {
		t.Fatal(err)
	}
	if offered(held) {
		t.Errorf("MIG instance %s held by a DRA claim is still offered to the kubelet", held.UUID)
	}
	if !offered(other) {
		t.Errorf("MIG instance %s held by a device-plugin container is no longer offered (the kubelet counts it)", other.UUID)
	}
	if _, _, err := a.Ledger().Release(claim.ContainerID); err != nil {
		t.Fatal(err)
	}
	if !offered(held) {
		t.Errorf("MIG instance %s is not offered again after its claim was unprepared", held.UUID)
	}
}
