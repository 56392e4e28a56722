package main

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/ledger"
	"github.com/tessera-gpu/tessera/internal/nri"
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

// A DRA share claim used by containers of several pods has one region (internal/nri keeps it by
// the claim) and its usage is reported once, on the claim (container="resourceclaim/<name>", pod =
// the first pod it is reserved for), with the claim's one cap: the containers using it hold no
// devices of their own, so they carry no usage series that would count it again.
func TestDRASharedClaimUsageOnce(t *testing.T) {
	a, _ := metricsAgent(t)
	g0 := a.Inventory().GPUs[0]
	claim := ledger.Entry{ContainerID: ledger.ClaimID("cu"), PodUID: "u1", Namespace: "ns", Pod: "a", Container: "resourceclaim/shared",
		Devices: []api.DeviceAssignment{{UUID: g0.UUID, MemoryBytes: 10 << 30, CoresPercent: 30}},
		Claim:   &ledger.Claim{UID: "cu", Namespace: "ns", Name: "shared", PodUIDs: []string{"u1", "u2"}}}
	for _, e := range []ledger.Entry{claim,
		{ContainerID: "ca", PodUID: "u1", Namespace: "ns", Pod: "a", Container: "main", Claims: []string{"cu"}},
		{ContainerID: "cb", PodUID: "u2", Namespace: "ns", Pod: "b", Container: "main", Claims: []string{"cu"}}} {
		if err := a.Ledger().Reserve(e, a.Inventory()); err != nil {
			t.Fatal(err)
		}
	}
	run := t.TempDir()
	plugin := nri.New(nri.Config{StateDir: run}, a, nil, nil)
	path := filepath.Join(run, "claims", "cu", "vcuda", "region") // where the NRI plugin makes it
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, regionFile(g0.UUID, 10<<30, 7<<30, 256), 0o666); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	m := newNodeMetrics(reg)
	bad := &badRegions{total: m.badRegions, log: slog.New(slog.DiscardHandler)}
	state := &nodeState{node: "n", agent: a, regions: func() []containerUsage { return readContainerRegions(a, plugin.ReadRegion, bad) }}
	reg.MustRegister(&stateCollector{state})
	out := scrape(t, reg)
	labels := `{UUID="` + g0.UUID + `",container="resourceclaim/shared",gpu="0",hostname="n",namespace="ns",pod="a"}`
	for _, want := range []string{"tessera_container_gpu_memory_used_bytes" + labels + " 7.516192768e+09",
		"tessera_container_gpu_memory_limit_bytes" + labels + " 1.073741824e+10"} {
		if !strings.Contains(out, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	if n := strings.Count(out, "\ntessera_container_gpu_memory_limit_bytes{"); n != 1 {
		t.Errorf("%d memory-limit series, want the claim's one:\n%s", n, out)
	}
}
