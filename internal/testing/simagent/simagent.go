// Package simagent builds the node agent on the simulated GPU node for tests: the sim backend
// (internal/gpu's built-in 8-GPU node, no hardware), a ledger and an agent that has discovered the
// GPUs, all under one directory. The agent, NRI and tessera-node tests share it.
package simagent

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/tessera-gpu/tessera/internal/agent"
	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/gpu"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// Backend opens the simulated node with its state under dir/sim; it is closed when the test ends.
func Backend(t testing.TB, dir string) gpu.Backend {
	t.Helper()
	b, err := gpu.OpenSim(gpu.Options{StateDir: filepath.Join(dir, "sim")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// Generator is the CDI generator of the tests' agents (a stand-in vcuda library and CDI hook path).
func Generator() *cdi.Generator {
	return &cdi.Generator{Vendor: "tessera.dev", VCUDALibrary: "/opt/libvcuda.so", Driver: &cdi.Driver{HookPath: "/usr/bin/nvidia-cdi-hook"}}
}

// Agent builds an agent on b with its ledger at dir/ledger.json and its CDI specs under dir/cdi,
// and runs its first Refresh. In cfg, an empty NodeName, SharesPerGPU, CDIDir or Generator becomes
// "node-a", 10, dir/cdi or Generator(); the rest is used as given. Building it again on the same dir
// and backend is an agent restart.
func Agent(t testing.TB, dir string, b gpu.Backend, cfg agent.Config) *agent.Agent {
	t.Helper()
	l, err := ledger.Open(filepath.Join(dir, "ledger.json"), cfg.Log)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.NodeName == "" {
		cfg.NodeName = "node-a"
	}
	if cfg.SharesPerGPU == 0 {
		cfg.SharesPerGPU = 10
	}
	if cfg.CDIDir == "" {
		cfg.CDIDir = filepath.Join(dir, "cdi")
	}
	if cfg.Generator == nil {
		cfg.Generator = Generator()
	}
	a := agent.New(cfg, b, l)
	if err := a.Refresh(context.Background()); err != nil {
		t.Fatal(err)
	}
	return a
}

// New is Agent on a fresh Backend, both under dir.
func New(t testing.TB, dir string, cfg agent.Config) (*agent.Agent, gpu.Backend) {
	t.Helper()
	b := Backend(t, dir)
	return Agent(t, dir, b, cfg), b
}
