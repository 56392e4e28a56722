package main

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/agent"
	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/gpu"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

func TestMetrics(t *testing.T) {
	dir := t.TempDir()
	b, err := gpu.OpenSim(gpu.Options{StateDir: filepath.Join(dir, "sim")})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	l, _ := ledger.Open(filepath.Join(dir, "ledger.json"))
	a := agent.New(agent.Config{NodeName: "n", SharesPerGPU: 4, CDIDir: filepath.Join(dir, "cdi"), Generator: &cdi.Generator{Vendor: "tessera.dev", VCUDALibrary: "/opt/libvcuda.so", Driver: &cdi.Driver{HookPath: "/usr/bin/nvidia-cdi-hook"}}}, b, l)
	if err := a.Refresh(context.Background()); err != nil {
		t.Fatal(err)
	}
	g := a.Inventory().GPUs[1]
	if err := l.Reserve(ledger.Entry{ContainerID: "c1", Namespace: "ns", Pod: "p", Container: "main",
		Devices: []api.DeviceAssignment{{UUID: g.UUID, MemoryBytes: 3 << 30, CoresPercent: 25}}}, a.Inventory()); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	writeMetrics(&out, a, func(id string) string { return filepath.Join(dir, "no-region", id) })
	for _, want := range []string{
		`tessera_gpu_memory_bytes{uuid="` + g.UUID + `",index="1",model="NVIDIA A100-SXM4-40GB"} 42949672960`,
		`tessera_gpu_shares{uuid="` + g.UUID + `"} 1`,
		`tessera_gpu_shared_memory_bytes{uuid="` + g.UUID + `"} 3221225472`,
		`tessera_gpu_healthy{uuid="` + g.UUID + `"} 1`,
		"tessera_ledger_entries 1",
		"# TYPE tessera_container_gpu_throttled_seconds_total counter",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("metrics lack %q:\n%s", want, out.String())
		}
	}
}
