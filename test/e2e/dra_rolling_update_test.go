package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// testDRARollingUpdate: the agent is updated the way the chart does it, its DRA plugin registered
// under sockets named for its pod (--dra-rolling-update-uid=$(POD_UID)): the old pod's agent
// stops, the new pod's registers under its own sockets with the real kubelet, the claim the old
// one prepared stays prepared (its pod keeps running), the new one prepares a new claim and
// unprepares the old one's. Two agents serving at once (maxSurge) is TestPluginRollingUpdate's
// (internal/dra), since the chart still keeps maxSurge at 0.
func testDRARollingUpdate(t *testing.T, c *Cluster) {
	withUID := func(uid string) func([]string) []string {
		return func(args []string) []string {
			out := args[:0]
			for _, a := range args {
				if !strings.HasPrefix(a, "--dra-rolling-update-uid=") {
					out = append(out, a)
				}
			}
			return append(out, "--dra-rolling-update-uid="+uid)
		}
	}
	registry := filepath.Join(c.Kubelet.RootDir, "plugins_registry")
	socket := func(uid string) string {
		return filepath.Join(registry, kubeletplugin.RollingUpdateRegistrarSocketFile(registry, api.DRADriverName, types.UID(uid)))
	}
	c.withAgent(t, withUID("pod-old"))
	if _, err := os.Stat(socket("pod-old")); err != nil {
		t.Fatalf("the old agent's registration socket: %v", err)
	}
	c.CreateClaimTemplate(t, "share-10g-30", classShare, map[string]string{"memory": "10Gi", "compute": "30"}, "")
	c.CreatePod(t, ClaimPod("ru-a", "share-10g-30"))
	before := c.WaitRunning(t, 3*time.Minute, "ru-a")[0]
	ledgerBefore := c.Ledger(t)

	// The update: the old pod's agent gets SIGTERM, the new pod's starts with its own UID.
	c.Agent.Stop(t)
	c.Agent.Args = withUID("pod-new")(c.Agent.Args)
	c.Agent.Start(t)
	c.WaitAgentReady(t)
	if _, err := os.Stat(socket("pod-new")); err != nil {
		t.Errorf("the new agent's registration socket: %v", err)
	}
	if _, err := os.Stat(socket("pod-old")); err == nil {
		t.Errorf("the old agent left its registration socket %s behind", socket("pod-old"))
	}
	if l := c.Ledger(t); l != ledgerBefore {
		t.Errorf("ledger changed across the update:\nbefore %s\nafter  %s", ledgerBefore, l)
	}
	c.CreatePod(t, ClaimPod("ru-b", "share-10g-30"))
	after := c.WaitRunning(t, 3*time.Minute, "ru-a", "ru-b")[0]
	if after.UID != before.UID || after.Status.ContainerStatuses[0].RestartCount != before.Status.ContainerStatuses[0].RestartCount {
		t.Errorf("the old claim's pod did not keep running across the update: %+v", after.Status.ContainerStatuses)
	}
	if n := len(claimEntries(t, c)); n != 2 {
		t.Errorf("%d prepared claims after the update, want 2:\n%s", n, c.Ledger(t))
	}
	c.DeletePods(t, "ru-a", "ru-b")
	c.WaitLedgerEmpty(t)
}
