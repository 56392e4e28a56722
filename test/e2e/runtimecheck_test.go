package e2e

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/tessera-gpu/tessera/internal/runtimecheck"
)

// TestRuntimeCheckContainerd: tessera-node's runtime check (internal/runtimecheck) against the real
// containerd 2.2, as the agent runs it at start. The CDI verdict comes from containerd's own CRI
// Status (verbose), so each configuration is read as containerd resolved it: the harness's (CDI on,
// its CDI directory), containerd 2.x's defaults with no CDI line at all (on, /etc/cdi and
// /var/run/cdi: install.md's enable_cdi and cdi_spec_dirs lines change nothing on 2.x), enable_cdi =
// false (named, with the setting to change); NRI disabled leaves no socket, and the verdict names
// disable = false.
func TestRuntimeCheckContainerd(t *testing.T) {
	c := StartContainerd(t)
	ctx := context.Background()
	cdi := func(dir string) (string, bool) {
		t.Helper()
		info, err := runtimecheck.CRIStatusInfo(ctx, c.Socket)
		if err != nil {
			t.Fatal(err)
		}
		p, known, err := runtimecheck.CDIProblem(info, dir)
		if err != nil {
			t.Fatal(err)
		}
		return p, known
	}
	if p, known := cdi(c.CDIDir); !known || p != "" {
		t.Errorf("the harness's containerd (CDI on, %s): %q, known %v; want no problem", c.CDIDir, p, known)
	}

	cdiLines := regexp.MustCompile(`(?m)^\s*(enable_cdi|cdi_spec_dirs) = .*\n`)
	c.Reconfigure(t, func(s string) string { return cdiLines.ReplaceAllString(s, "") })
	if p, known := cdi("/etc/cdi"); !known || p != "" {
		t.Errorf("containerd 2.x's CDI defaults, specs in /etc/cdi: %q, known %v; want no problem", p, known)
	}
	if p, _ := cdi(c.CDIDir); !strings.Contains(p, "add '"+c.CDIDir+"' to cdi_spec_dirs") {
		t.Errorf("containerd 2.x's CDI defaults, specs in %s: %q, want the directory named", c.CDIDir, p)
	}

	c.Reconfigure(t, func(s string) string { return strings.Replace(s, "enable_cdi = true", "enable_cdi = false", 1) })
	p, known := cdi(c.CDIDir)
	if !known || !strings.Contains(p, "set enable_cdi = true") {
		t.Errorf("enable_cdi = false: %q, known %v; want the setting named", p, known)
	}
	t.Logf("enable_cdi = false: %s", p)

	os.Remove(c.NRISocket) // what a containerd that ran with NRI leaves behind is no part of this
	c.Reconfigure(t, func(s string) string {
		return strings.Replace(s, "[plugins.'io.containerd.nri.v1.nri']\n    disable = false", "[plugins.'io.containerd.nri.v1.nri']\n    disable = true", 1)
	})
	if _, err := os.Stat(c.NRISocket); !os.IsNotExist(err) {
		t.Errorf("containerd with NRI disabled: its socket %s: %v, want none", c.NRISocket, err)
	}
	if p := runtimecheck.NRIProblem(c.NRISocket, false, runtimecheck.NRIGrace); !strings.Contains(p, "no NRI socket") || !strings.Contains(p, "disable = false") {
		t.Errorf("NRI disabled: %q, want the missing socket and the setting named", p)
	}
}

// testMultiNodeRuntimeCheck: each GPU node's agent, on a containerd with NRI and CDI on, checked
// both at start and found nothing to report: its log says so and its Node has no NRIUnavailable or
// CDIUnavailable Event.
func testMultiNodeRuntimeCheck(t *testing.T, m *MultiNode) {
	for _, node := range []string{NodeA100, NodeH100} {
		c := m.Node(t, node)
		// The NRI verdict comes NRIGrace after the agent's start.
		err := waitFor(runtimecheck.NRIGrace+15*time.Second, time.Second, func() (bool, error) {
			n := c.AgentLogCount(t, "NRI check: the plugin is synchronised")
			return n > 0, fmt.Errorf("no NRI verdict in %s's agent log", node)
		})
		if err != nil {
			t.Errorf("%v\n%s", err, c.Agent.LogTail(20))
		}
		if c.AgentLogCount(t, "CDI check: containerd has CDI on") == 0 {
			t.Errorf("%s's agent did not check CDI with containerd:\n%s", node, c.Agent.LogTail(20))
		}
		for _, reason := range []string{runtimecheck.EventNRIUnavailable, runtimecheck.EventCDIUnavailable} {
			if ev := c.Events(t, node, reason); len(ev) > 0 {
				t.Errorf("%s has %s Events on a containerd with NRI and CDI on: %v", node, reason, ev)
			}
		}
	}
}
