package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// h100DynamicDevices is what the dgx-h100 node publishes with dynamic MIG: GPUs 0-5 each as the
// GPU and 25 MIG placements (1g.10gb x7, 1g.10gb+me x7, 1g.20gb x4, 2g.20gb x3, 3g.40gb x2,
// 4g.40gb, 7g.80gb), and the operator's instances of GPUs 6 (four) and 7 (three).
const h100DynamicDevices = 6*26 + 4 + 3

// withAgent restarts tessera-node with its flags changed by edit, and puts the original back when
// the test ends (after deleting the test's pods: their claims are on the changed node).
func (c *Cluster) withAgent(t *testing.T, edit func([]string) []string) {
	t.Helper()
	orig := slices.Clone(c.Agent.Args)
	c.Agent.Stop(t)
	c.Agent.Args = edit(slices.Clone(orig))
	c.Agent.Start(t)
	c.WaitAgentReady(t)
	t.Cleanup(func() {
		c.DeleteAllPods(t)
		c.WaitLedgerEmpty(t)
		c.Agent.Stop(t)
		c.Agent.Args = orig
		c.Agent.Start(t)
		c.WaitAgentReady(t)
	})
}

// waitInventory waits until the Node's inventory annotation satisfies ok.
func (c *Cluster) waitInventory(t *testing.T, what string, ok func(*api.NodeInventory) bool) *api.NodeInventory {
	t.Helper()
	var inv *api.NodeInventory
	err := waitFor(time.Minute, 200*time.Millisecond, func() (bool, error) {
		n, err := c.CP.Client.CoreV1().Nodes().Get(context.Background(), c.Node, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if inv, err = api.DecodeInventory([]byte(n.Annotations[api.AnnotationInventory])); err != nil {
			return false, err
		}
		if !ok(inv) {
			return false, fmt.Errorf("the Node's inventory does not show %s", what)
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("%v\n%s", err, c.Agent.LogTail(30))
	}
	return inv
}

// testDRADynamicMIG: on the simulated H100 node with dynamic MIG, a 1g and a 3g claim pinned to
// GPU 0 get instances created for them (the container sees its MIG caps, the node's inventory
// shows the instances, the device plugins stop offering GPU 0); deleting the pods destroys them
// and switches MIG mode off; a whole-GPU claim on GPU 0 then gets the GPU.
func testDRADynamicMIG(t *testing.T, c *Cluster) {
	c.withAgent(t, func(args []string) []string {
		for i, a := range args {
			if strings.HasPrefix(a, "--node-description=") {
				args[i] = "--node-description=dgx-h100"
			}
			if strings.HasPrefix(a, "--state-dir=") {
				args[i] = "--state-dir=" + filepath.Join(c.Dir, "sim-h100")
			}
		}
		return append(args, "--dra-dynamic-mig")
	})
	gpu0 := c.Inventory.GPUs[0].UUID
	devices := c.WaitResourceSlices(t, h100DynamicDevices)
	for _, name := range []string{"gpu-0", "gpu-0-mig-1g-10gb-6", "gpu-0-mig-3g-40gb-0", "gpu-5-mig-7g-80gb-0"} {
		if _, ok := devices[name]; !ok {
			t.Fatalf("the slices lack the partitionable device %s", name)
		}
	}
	onGPU0 := `device.attributes["gpu.tessera.dev"].index == 0`
	c.CreateClaimTemplate(t, "dyn-1g", classMIG, nil, onGPU0+` && device.attributes["gpu.tessera.dev"].profile == "1g.10gb"`)
	c.CreateClaimTemplate(t, "dyn-3g", classMIG, nil, onGPU0+` && device.attributes["gpu.tessera.dev"].profile == "3g.40gb"`)
	c.CreatePod(t, ClaimPod("dyn-1g", "dyn-1g"))
	c.CreatePod(t, ClaimPod("dyn-3g", "dyn-3g"))
	c.WaitRunning(t, 3*time.Minute, "dyn-1g", "dyn-3g")
	for pod, re := range map[string]string{"dyn-1g": `^gpu-0-mig-1g-10gb-\d$`, "dyn-3g": `^gpu-0-mig-3g-40gb-[04]$`} {
		if d := allocatedDevice(t, c.PodClaim(t, pod)); !regexp.MustCompile(re).MatchString(d.Device) {
			t.Errorf("%s allocated %s, want %s", pod, d.Device, re)
		}
		if out := c.MustExec(t, pod, "ls /dev/nvidia-caps"); !strings.Contains(out, "nvidia-cap") {
			t.Errorf("%s: no nvidia-caps nodes for its MIG instance:\n%s", pod, out)
		}
	}
	entries := claimEntries(t, c)
	var created []string
	for _, e := range entries {
		if len(e.MIG) != 1 || !slices.Equal(e.Partitions, []string{gpu0}) {
			t.Errorf("claim entry %+v: want one MIG instance and a hold on GPU 0", e)
		}
		created = append(created, e.MIG...)
	}
	inv := c.waitInventory(t, "GPU 0's two new MIG instances", func(inv *api.NodeInventory) bool {
		g := inv.GPUByUUID(gpu0)
		return g != nil && g.MIG != nil && len(g.MIG.Instances) == 2
	})
	for _, m := range inv.GPUByUUID(gpu0).MIG.Instances {
		if !slices.Contains(created, m.UUID) {
			t.Errorf("GPU 0 holds MIG instance %s (%s), which no claim created (claims hold %v)", m.UUID, m.Profile, created)
		}
	}
	c.WaitAllocatable(t, map[string]int64{api.ResourceGPU: SimWholeGPUs - 1, api.ResourceShare: SimShares - 10})

	c.DeletePods(t, "dyn-1g", "dyn-3g")
	c.WaitLedgerEmpty(t)
	c.waitInventory(t, "GPU 0 whole again (its instances destroyed, MIG mode off)", func(inv *api.NodeInventory) bool {
		g := inv.GPUByUUID(gpu0)
		return g != nil && g.Shareable()
	})
	if raw, err := os.ReadFile(filepath.Join(c.AgentDataDir, "dra-mig.json")); err != nil || strings.Contains(string(raw), gpu0) {
		t.Errorf("the dynamic MIG journal after the deletions (%v): %s", err, raw)
	}

	c.CreateClaimTemplate(t, "dyn-whole", classWhole, nil, onGPU0)
	c.CreatePod(t, ClaimPod("dyn-whole", "dyn-whole"))
	c.WaitRunning(t, 3*time.Minute, "dyn-whole")
	entries = claimEntries(t, c)
	if len(entries) != 1 || len(entries[0].Devices) != 1 || !entries[0].Devices[0].Whole || entries[0].Devices[0].UUID != gpu0 {
		t.Fatalf("ledger: want one claim holding GPU 0 whole:\n%s", c.Ledger(t))
	}
}
