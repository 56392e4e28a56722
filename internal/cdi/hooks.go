package cdi

import (
	specs "tags.cncf.io/container-device-interface/specs-go"
)

// HookCheckRealised is the tessera-node subcommand the runtime runs for every container that holds
// a Tessera GPU device. It is the fail-closed half of the NRI plugin: NRI drops a plugin that does
// not answer in time and creates the container anyway, but the runtime runs this hook from the
// container's own CDI edits, so a container our plugin did not realise does not start.
const HookCheckRealised = "check-realised"

// realisationHooks are the container edits every GPU-granting spec carries: a createRuntime hook
// (host namespaces, after the container is created, before its process runs) that fails unless the
// NRI plugin realised this very container. No hook binary configured: no hook (`cdi generate` used
// by hand); the agent always configures one.
func (g *Generator) realisationHooks() []*specs.Hook {
	if g.HookBinary == "" {
		return nil
	}
	return []*specs.Hook{{
		HookName: "createRuntime",
		Path:     g.HookBinary,
		Args:     []string{"tessera-node", "hook", HookCheckRealised, "--run-dir=" + g.RunDir},
		Timeout:  intPtr(10),
	}}
}

func intPtr(i int) *int { return &i }
