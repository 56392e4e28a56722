package main

import (
	"testing"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// Everything the ledger holds in whole GPUs or shares is published per pod: local placements and
// holds of stopped containers included; MIG and mdev (the kubelet counts them) are not.
func TestSecurityHoldingsPublished(t *testing.T) {
	g0, g1 := "GPU-00000000-0000-4000-8000-000000000000", "GPU-00000000-0000-4000-8000-000000000001"
	h := holdingsOf("n", []ledger.Entry{
		{ContainerID: "c1", PodUID: "u1", Namespace: "ns", Pod: "local", Container: "a", Local: true, Devices: []api.DeviceAssignment{{UUID: g0, MemoryBytes: 1 << 30}}},
		{ContainerID: "hold:u1/b", PodUID: "u1", Namespace: "ns", Pod: "local", Container: "b", Devices: []api.DeviceAssignment{{UUID: g1, MemoryBytes: 1 << 30}}},
		{ContainerID: "c3", PodUID: "u3", Namespace: "ns", Pod: "mig", Container: "a", MIG: []string{"MIG-x"}},
	})
	if _, err := api.EncodeHoldings(h); err != nil {
		t.Fatal(err)
	}
	if len(h.Pods) != 1 || !h.Pods[0].Local || len(h.Pods[0].Containers) != 2 || h.Pods[0].Containers[1].Devices[0].UUID != g1 {
		t.Errorf("holdings %+v", h)
	}
}
