package cdi

import (
	"slices"
	"testing"

	"tags.cncf.io/container-device-interface/pkg/parser"
)

// TestSecurityRealisationHookInEverySpec: every device of every class that grants GPU devices (whole
// GPUs, MIG instances, the share token) brings the createRuntime check-realised hook into the
// container, resolved through a CDI cache as containerd does. Without it a container the NRI plugin
// did not realise (plugin timed out or disconnected: NRI then creates it anyway) would run with its
// GPU unchecked, and only the e2e tests would notice.
func TestSecurityRealisationHookInEverySpec(t *testing.T) {
	n := simNode(t)
	testGen.HookBinary, testGen.RunDir = "/usr/local/lib/tessera/tessera-node", "/run/tessera"
	dir := t.TempDir()
	all, err := testGen.Specs(n)
	if err != nil {
		t.Fatal(err)
	}
	if err := (&Writer{Dir: dir}).Sync(all); err != nil {
		t.Fatal(err)
	}
	want := []string{"tessera-node", "hook", HookCheckRealised, "--run-dir=/run/tessera"}
	granting := []string{ClassGPU, ClassMIG, ClassShare}
	seen := map[string]int{}
	for _, s := range all {
		vendor, class := parser.ParseQualifier(s.Kind)
		if !slices.Contains(granting, class) {
			continue
		}
		for _, d := range s.Devices {
			name := parser.QualifiedName(vendor, class, d.Name)
			oci := inject(t, dir, name)
			found := false
			if oci.Hooks != nil {
				for _, h := range oci.Hooks.CreateRuntime {
					if h.Path == testGen.HookBinary && slices.Equal(h.Args, want) && h.Timeout != nil && *h.Timeout > 0 {
						found = true
					}
				}
			}
			if !found {
				t.Errorf("%s: no createRuntime hook %s %v in the container (a container the NRI plugin did not realise would run)", name, testGen.HookBinary, want)
			}
			seen[class]++
		}
	}
	for _, class := range granting {
		if seen[class] == 0 {
			t.Errorf("no %s device generated on the simulated node: the check covers nothing of that class", class)
		}
	}
}
