package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// testDRARollingUpdate: the agent is updated the way the chart does it with maxSurge, its DRA
// plugin registered under sockets named for its pod (--dra-rolling-update-uid=$(POD_UID)): the new
// pod's agent starts while the old one still runs, registers its device plugins and DRA plugin
// beside the old one's with the real kubelet and takes the NRI plugin and the metrics port over
// (internal/handover); a claim pod created while both run starts; then the old pod's agent stops.
// The claim the old one prepared stays prepared (its pod keeps running), and the new one
// unprepares both claims.
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
	ledgerBefore := c.LedgerEntries(t)

	// The update with maxSurge: the new pod's agent starts with its own UID beside the old one.
	old := c.Agent
	updated := &Process{Name: old.Name + "-new", Bin: old.Bin, Args: withUID("pod-new")(slices.Clone(old.Args)), Env: old.Env,
		Log: old.Log + ".new"}
	updated.Start(t)
	t.Cleanup(func() {
		if c.Agent == updated {
			return // the update went through: withAgent's cleanup restarts it with the original flags
		}
		// Failed midway: the old agent may have handed over; make it whole again for the cleanup.
		updated.Stop(t)
		old.Stop(t)
		old.Start(t)
		c.WaitAgentReady(t)
	})
	handedOver := func() bool {
		data, _ := os.ReadFile(old.Log)
		return strings.Contains(string(data), "handed the NRI plugin and the metrics port over to a newer agent")
	}
	if err := waitFor(2*time.Minute, 100*time.Millisecond, func() (bool, error) {
		if !updated.Running() || !old.Running() {
			return false, fmt.Errorf("an agent exited (old running %t, new running %t)", old.Running(), updated.Running())
		}
		return handedOver() && c.AgentHealthy(), nil
	}); err != nil {
		t.Fatalf("the old agent did not hand over to the new one: %v\nold:\n%s\nnew:\n%s", err, old.LogTail(30), updated.LogTail(30))
	}
	if _, err := os.Stat(socket("pod-new")); err != nil {
		t.Errorf("the new agent's registration socket: %v", err)
	}
	if _, err := os.Stat(socket("pod-old")); err != nil {
		t.Errorf("the old agent's registration socket, while it still runs: %v", err)
	}
	// Both agents run: a new claim pod gets its container realised by the new agent's NRI plugin
	// (two connected would refuse every container).
	c.CreatePod(t, ClaimPod("ru-b", "share-10g-30"))
	c.WaitRunning(t, 3*time.Minute, "ru-a", "ru-b")

	// The old pod is deleted.
	old.Stop(t)
	c.Agent = updated
	c.WaitAgentReady(t)
	if _, err := os.Stat(socket("pod-old")); err == nil {
		t.Errorf("the old agent left its registration socket %s behind", socket("pod-old"))
	}
	afterEntries := map[string]*ledger.Entry{}
	for _, e := range c.LedgerEntries(t) {
		afterEntries[e.ContainerID] = e
	}
	for _, e := range ledgerBefore {
		if !reflect.DeepEqual(afterEntries[e.ContainerID], e) {
			t.Errorf("ledger entry %s changed across the update:\nbefore %+v\nafter  %+v", e.ContainerID, e, afterEntries[e.ContainerID])
		}
	}
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
