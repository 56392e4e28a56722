package main

import (
	"context"
	"path/filepath"
	"slices"
	"testing"

	"tags.cncf.io/container-device-interface/pkg/parser"
	specs "tags.cncf.io/container-device-interface/specs-go"

	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/gpu"
)

// TestSecurityAgentSpecsCarryRealisationHook: the generator the agent runs with (cdiGenerator with
// realise) puts the check-realised hook in every spec that grants GPU devices (internal/cdi's
// TestSecurityRealisationHookInEverySpec checks the generator itself); `cdi generate` by hand has none.
func TestSecurityAgentSpecsCarryRealisationHook(t *testing.T) {
	tmp := t.TempDir()
	cfg, err := loadRunFlags(t, "--backend=sim", "--state-dir="+filepath.Join(tmp, "sim"), "--data-dir="+filepath.Join(tmp, "data"),
		"--run-dir=/run/tessera", "--hook-binary=/usr/local/lib/tessera/tessera-node", "--cdi-hook-path=/usr/local/lib/tessera/nvidia-cdi-hook")
	if err != nil {
		t.Fatal(err)
	}
	backend, err := gpu.Open(gpuOptions(cfg))
	if err != nil {
		t.Fatal(err)
	}
	defer backend.Close()
	node, err := backend.Discover(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, realise := range []bool{true, false} {
		gen, err := cdiGenerator(cfg, backend, realise)
		if err != nil {
			t.Fatal(err)
		}
		all, err := gen.Specs(node)
		if err != nil {
			t.Fatal(err)
		}
		classes := 0
		for _, s := range all {
			if _, class := parser.ParseQualifier(s.Kind); !slices.Contains([]string{cdi.ClassGPU, cdi.ClassMIG, cdi.ClassShare}, class) {
				continue
			}
			classes++
			has := slices.ContainsFunc(s.ContainerEdits.Hooks, func(h *specs.Hook) bool {
				return h.HookName == "createRuntime" && h.Path == cfg.HookBinary && slices.Contains(h.Args, cdi.HookCheckRealised) && slices.Contains(h.Args, "--run-dir=/run/tessera")
			})
			if has != realise {
				t.Errorf("realise %t: spec %s carries the check-realised hook: %t", realise, s.Kind, has)
			}
		}
		if classes != 3 {
			t.Errorf("realise %t: %d GPU-granting specs on the simulated node, want 3 (gpu, mig, vgpu)", realise, classes)
		}
	}
}
