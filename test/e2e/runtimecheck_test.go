package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
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
// CDIUnavailable Event. The H100 node's containerd runs its stock configuration, and the agent
// there found NRI and the CRI socket at their default paths (checkStockContainerd). Then the A100
// node's containerd restarts reading another CDI directory and with NRI disabled, and its agent
// pod is replaced (misconfigureRuntime): its Node gets a CDIUnavailable Warning Event naming the
// directory and the setting and an NRIUnavailable one naming NRI's setting, recorded with the
// chart's RBAC for the agent, and once the configuration is back the agent serves as before.
func testMultiNodeRuntimeCheck(t *testing.T, m *MultiNode) {
	checkStockContainerd(t, m.Node(t, NodeH100), m.agentArgs(t, NodeH100))
	for _, node := range []string{NodeA100, NodeH100} {
		c := m.Node(t, node)
		// The NRI verdict comes NRIGrace after the agent's start.
		err := waitFor(runtimecheck.NRIGrace+15*time.Second, time.Second, func() (bool, error) {
			n := c.AgentLogCount(t, "NRI check: the plugin is synchronised")
			return n > 0, fmt.Errorf("no NRI verdict in %s's agent log", node)
		})
		if err != nil {
			t.Errorf("%v\n%s", err, c.AgentLogTail(t, 20))
		}
		if c.AgentLogCount(t, "CDI check: containerd has CDI on") == 0 {
			t.Errorf("%s's agent did not check CDI with containerd:\n%s", node, c.AgentLogTail(t, 20))
		}
		for _, reason := range []string{runtimecheck.EventNRIUnavailable, runtimecheck.EventCDIUnavailable} {
			if ev := c.Events(t, node, reason); len(ev) > 0 {
				t.Errorf("%s has %s Events on a containerd with NRI and CDI on: %v", node, reason, ev)
			}
		}
	}
	m.misconfigureRuntime(t, NodeA100)
}

// checkStockContainerd checks that the node's containerd runs containerd 2.x's defaults for NRI and
// CDI: its configuration file says nothing of either, its CRI status reports CDI on with the default
// spec directories, its NRI socket is at the default path, and tessera-node (run with args) was
// given no socket but at containerd's default path (its own defaults and the chart's are
// containerd's) and only a CDI directory among those defaults.
func checkStockContainerd(t *testing.T, c *Cluster, args []string) {
	t.Helper()
	if !c.Ctr.Stock {
		t.Fatalf("node %s's containerd is not the stock one", c.Node)
	}
	cfg, err := os.ReadFile(filepath.Join(c.Ctr.Base, "config.toml"))
	if err != nil {
		t.Fatal(err)
	}
	if l := strings.ToLower(string(cfg)); strings.Contains(l, "nri") || strings.Contains(l, "cdi") {
		t.Errorf("node %s's containerd configuration sets NRI or CDI:\n%s", c.Node, cfg)
	}
	info, err := runtimecheck.CRIStatusInfo(context.Background(), c.Ctr.Socket)
	if err != nil {
		t.Fatal(err)
	}
	var crCfg struct {
		EnableCDI   bool     `json:"enableCDI"`
		CDISpecDirs []string `json:"cdiSpecDirs"`
	}
	if err := json.Unmarshal([]byte(info["config"]), &crCfg); err != nil {
		t.Fatalf("node %s's CRI status config: %v", c.Node, err)
	}
	if !crCfg.EnableCDI || !slices.Equal(crCfg.CDISpecDirs, []string{"/etc/cdi", StockCDIDir}) {
		t.Errorf("node %s's containerd: enableCDI %v, cdiSpecDirs %v; want containerd 2.x's defaults, true and [/etc/cdi %s]", c.Node, crCfg.EnableCDI, crCfg.CDISpecDirs, StockCDIDir)
	}
	if _, err := os.Stat(c.Ctr.NRISocket); err != nil {
		t.Errorf("node %s: no NRI socket at the default /var/run/nri/nri.sock: %v", c.Node, err)
	}
	for _, a := range args {
		switch {
		case a == "--nri-socket="+chartDefaultNRI, a == "--cri-socket="+chartDefaultCRI, a == "--cdi-dir="+StockCDIDir:
		case strings.HasPrefix(a, "--nri-socket"), strings.HasPrefix(a, "--cri-socket"), strings.HasPrefix(a, "--cdi-dir"):
			t.Errorf("node %s's tessera-node was given %s; want containerd's defaults", c.Node, a)
		}
	}
}

// misconfigureRuntime restarts the node's containerd (the harness's configuration) reading its CDI
// specs from another directory than the chart's node.cdiDir and with NRI disabled, as a node set up
// without docs/install.md's containerd lines runs, and replaces the agent pod. Expectation: the
// new agent reports both on the Node, each a Warning Event naming the setting to change:
// CDIUnavailable at once (the directory to add to cdi_spec_dirs), NRIUnavailable after NRIGrace
// (disable = false and the socket path); no GPU container could start there meanwhile, so none is
// tried. With containerd's configuration back and the agent pod replaced again, the agent serves.
func (m *MultiNode) misconfigureRuntime(t *testing.T, node string) {
	t.Helper()
	c := m.Node(t, node)
	if c.Ctr.Stock {
		t.Fatalf("node %s runs containerd's stock configuration, which names no CDI directory to change", node)
	}
	unread := filepath.Join(c.Dir, "cdi-unread")
	// What a containerd that ran with NRI leaves behind is no part of this.
	os.Remove(c.Ctr.NRISocket)
	c.Ctr.Reconfigure(t, func(s string) string {
		s = strings.Replace(s, "cdi_spec_dirs = ['"+c.Ctr.SpecDir()+"']", "cdi_spec_dirs = ['"+unread+"']", 1)
		return strings.Replace(s, "[plugins.'io.containerd.nri.v1.nri']\n    disable = false", "[plugins.'io.containerd.nri.v1.nri']\n    disable = true", 1)
	})
	restored := false
	restore := func() {
		if restored {
			return
		}
		restored = true
		c.Ctr.RestoreConfig(t)
		m.RestartAgentPod(t, node)
	}
	defer restore()
	started := time.Now()
	m.replaceAgentPod(t, node)
	want := map[string]string{
		runtimecheck.EventCDIUnavailable: "add '" + chartCDIDir + "' to cdi_spec_dirs",
		runtimecheck.EventNRIUnavailable: "disable = false and socket_path = '" + chartDefaultNRI + "'",
	}
	for reason, text := range want {
		err := waitFor(runtimecheck.NRIGrace+time.Minute, time.Second, func() (bool, error) {
			for _, ev := range c.Events(t, node, reason) {
				if strings.Contains(ev, text) {
					t.Logf("%s %.0fs after the agent's replacement: %s", reason, time.Since(started).Seconds(), ev)
					return true, nil
				}
			}
			return false, fmt.Errorf("no %s Event on node %s naming %q", reason, node, text)
		})
		if err != nil {
			t.Errorf("%v\n%s", err, c.AgentLogTail(t, 20))
		}
	}
	restore()
}
