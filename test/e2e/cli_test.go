package e2e

import (
	"strings"
	"testing"
	"time"
)

// TestCLIHelpAndVersion: every binary answers --help with its usage and exit status 0, and
// --version with its version.
func TestCLIHelpAndVersion(t *testing.T) {
	for _, c := range []struct {
		bin  string
		args []string
	}{
		{"tessera-node", []string{"--help"}},
		{"tessera-node", []string{"run", "--help"}},
		{"tessera-node", []string{"cdi", "generate", "--help"}},
		{"tessera-extender", []string{"--help"}},
		{"tessera-sim", []string{"--help"}},
		{"kubectl-tessera", []string{"--help"}},
	} {
		out, err := runCmd(t, time.Minute, tesseraBinary(t, c.bin), c.args...)
		if err != nil || !strings.Contains(strings.ToLower(out), "usage") {
			t.Errorf("%s %v: %v (want exit 0 and a usage)\n%s", c.bin, c.args, err, out)
		}
	}
	for _, bin := range []string{"tessera-node", "tessera-extender", "tessera-sim", "kubectl-tessera"} {
		out, err := runCmd(t, time.Minute, tesseraBinary(t, bin), "--version")
		if err != nil || !strings.HasPrefix(out, bin+", version ") {
			t.Errorf("%s --version: %v\n%s", bin, err, out)
		}
	}
}
