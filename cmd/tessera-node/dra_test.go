package main

import (
	"testing"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// A prepared DRA claim is published in the holdings (the extender counts it as occupied), once:
// the containers that use it hold no devices of their own.
func TestDRAClaimsInHoldings(t *testing.T) {
	g0 := "GPU-00000000-0000-4000-8000-000000000000"
	h := holdingsOf("n", []ledger.Entry{
		{ContainerID: ledger.ClaimID("cu"), PodUID: "u1", Namespace: "ns", Pod: "dra", Container: "resourceclaim/dra-gpu-x",
			Devices: []api.DeviceAssignment{{UUID: g0, MemoryBytes: 10 << 30, CoresPercent: 30}}, Claim: &ledger.Claim{UID: "cu", Namespace: "ns", Name: "dra-gpu-x", PodUIDs: []string{"u1"}}},
		{ContainerID: "c1", PodUID: "u1", Namespace: "ns", Pod: "dra", Container: "main", Claims: []string{"cu"}},
	})
	if _, err := api.EncodeHoldings(h); err != nil {
		t.Fatal(err)
	}
	if len(h.Pods) != 1 || len(h.Pods[0].Containers) != 1 || h.Pods[0].Containers[0].Devices[0].MemoryBytes != 10<<30 {
		t.Errorf("holdings %+v: want the claim's share once, under its pod", h)
	}
}
