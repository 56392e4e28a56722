package e2e

import (
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/dra"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// DeviceClasses of deploy/helm/tessera/templates/deviceclasses.yaml (applied from the chart).
const (
	classWhole = "whole.gpu.tessera.dev"
	classShare = "share.gpu.tessera.dev"
	classMIG   = "mig.gpu.tessera.dev"
)

// TestDRA runs the DRA front door end to end on the one-node cluster: the real kube-scheduler
// allocates from tessera-node's ResourceSlices, the resourceclaim controller makes claims from
// templates, the real kubelet calls NodePrepareResources over the kubeletplugin helper's gRPC,
// containerd resolves the CDI names and tessera-node's NRI plugin realises the container with vcuda.
func TestDRA(t *testing.T) {
	c := StartCluster(t, ClusterOptions{DRA: true})
	want := 0
	for _, g := range c.Inventory.GPUs {
		switch {
		case g.Shareable():
			want++
		case g.MIG != nil:
			want += len(g.MIG.Instances)
		}
	}
	devices := c.WaitResourceSlices(t, want)
	t.Logf("ResourceSlices list %d devices", len(devices))
	steps := []struct {
		name string
		fn   func(*testing.T, *Cluster)
	}{
		{"Shares", testDRAShares},
		{"Whole", testDRAWhole},
		{"MIG", testDRAMIG},
		{"Unfit", testDRAUnfit},
		{"BothFrontDoors", testDRABothFrontDoors},
		{"AgentRestart", testDRAAgentRestart},
		{"KubeletRestart", testDRAKubeletRestart},
		{"Health", testDRAHealth},
		{"AdminAccess", testDRAAdminAccess},
		{"RollingUpdate", testDRARollingUpdate},
		{"DynamicMIG", testDRADynamicMIG},
	}
	for _, s := range steps {
		t.Run(s.name, func(t *testing.T) {
			t.Cleanup(func() { c.Reset(t); c.WaitClaimsGone(t) })
			s.fn(t, c)
		})
	}
}

// claimEntries are the prepared claims in the agent's ledger.
func claimEntries(t *testing.T, c *Cluster) []*ledger.Entry {
	var out []*ledger.Entry
	for _, e := range c.LedgerEntries(t) {
		if ledger.IsClaim(e.ContainerID) {
			out = append(out, e)
		}
	}
	return out
}

// testDRAShares: a template asking 10Gi and 30% of a GPU; two pods get one claim each, on one GPU
// (the allocator's first fit), each capped at 10 GiB inside (CUDA reports and enforces the cap) and
// at 30% compute (its limits file); deleting the pods unprepares the claims.
func testDRAShares(t *testing.T, c *Cluster) {
	c.CreateClaimTemplate(t, "share-10g-30", classShare, map[string]string{"memory": "10Gi", "compute": "30"}, "")
	c.CreatePod(t, ClaimPod("dra-a", "share-10g-30"))
	c.CreatePod(t, ClaimPod("dra-b", "share-10g-30"))
	c.WaitRunning(t, 3*time.Minute, "dra-a", "dra-b")
	a, b := allocatedDevice(t, c.PodClaim(t, "dra-a")), allocatedDevice(t, c.PodClaim(t, "dra-b"))
	if a.Device != b.Device || a.ShareID == nil || b.ShareID == nil || *a.ShareID == *b.ShareID {
		t.Errorf("claims on %s (share %v) and %s (share %v): want two shares of one GPU", a.Device, a.ShareID, b.Device, b.ShareID)
	}
	if q := a.ConsumedCapacity[dra.CapacityMemory]; q.Value() != 10<<30 {
		t.Errorf("consumed memory %s, want 10Gi", q.String())
	}
	entries := claimEntries(t, c)
	if len(entries) != 2 {
		t.Fatalf("%d prepared claims in the ledger, want 2:\n%s", len(entries), c.Ledger(t))
	}
	uuid := entries[0].Devices[0].UUID
	for _, e := range entries {
		if len(e.Devices) != 1 || e.Devices[0] != (api.DeviceAssignment{UUID: uuid, MemoryBytes: 10 << 30, CoresPercent: 30}) {
			t.Errorf("claim entry %+v: want a 10 GiB / 30%% share of %s", e, uuid)
		}
	}
	for _, pod := range []string{"dra-a", "dra-b"} {
		if out := c.MustExec(t, pod, "cat "+api.LimitsPathInContainer); !strings.Contains(out, "gpu "+uuid+" 10737418240 30") {
			t.Errorf("%s: limits file %q, want %s capped at 10 GiB and 30%%", pod, out, uuid)
		}
		checkShareCUDA(t, c, pod, 10<<30)
	}
	// One ledger: the device plugins stop offering that GPU whole, and the two claims take two of its
	// share tokens (the kubelet does not count claims).
	c.WaitAllocatable(t, map[string]int64{api.ResourceGPU: SimWholeGPUs - 1, api.ResourceShare: SimShares - 2})
	c.DeletePods(t, "dra-a", "dra-b")
	c.WaitLedgerEmpty(t)
	c.WaitClaimsGone(t)
}

// testDRAWhole: a claim with no capacity takes the GPU whole: one GPU device node, no preload, and
// the device plugins offer neither that GPU whole nor its shares.
func testDRAWhole(t *testing.T, c *Cluster) {
	c.CreateClaimTemplate(t, "whole", classWhole, nil, "")
	c.CreatePod(t, ClaimPod("dra-whole", "whole"))
	c.WaitRunning(t, 3*time.Minute, "dra-whole")
	entries := claimEntries(t, c)
	if len(entries) != 1 || len(entries[0].Devices) != 1 || !entries[0].Devices[0].Whole {
		t.Fatalf("ledger: want one claim holding a GPU whole:\n%s", c.Ledger(t))
	}
	out := c.MustExec(t, "dra-whole", "ls /dev; test -e /etc/ld.so.preload && echo PRELOAD; cudaprobe info")
	if n := deviceNodes(out); len(n) != 1 || strings.Contains(out, "PRELOAD") {
		t.Errorf("whole claim: GPU nodes %v, preload present=%v, want one GPU and no vcuda:\n%s", n, strings.Contains(out, "PRELOAD"), out)
	}
	if info := probeValues(t, out, "device"); info["total_mem"] != uint64(c.GPU(entries[0].Devices[0].UUID).MemoryBytes) {
		t.Errorf("whole claim: CUDA sees %d bytes, want the GPU's %d", info["total_mem"], c.GPU(entries[0].Devices[0].UUID).MemoryBytes)
	}
	c.WaitAllocatable(t, map[string]int64{api.ResourceGPU: SimWholeGPUs - 1, api.ResourceShare: SimShares - 10})
	checkTesseraHolds(t, c, entries[0].Devices[0].UUID, "claim") // the claim shows in kubectl tessera, not as free
}

// testDRAMIG: a MIG claim gets one instance: its caps device nodes, recorded in the ledger.
func testDRAMIG(t *testing.T, c *Cluster) {
	c.CreateClaimTemplate(t, "mig", classMIG, nil, "")
	c.CreatePod(t, ClaimPod("dra-mig", "mig"))
	c.WaitRunning(t, 3*time.Minute, "dra-mig")
	d := allocatedDevice(t, c.PodClaim(t, "dra-mig"))
	entries := claimEntries(t, c)
	if len(entries) != 1 || len(entries[0].MIG) != 1 {
		t.Fatalf("ledger: want one claim holding a MIG instance:\n%s", c.Ledger(t))
	}
	if !regexp.MustCompile(`^gpu-\d+-mig-\d+-\d+$`).MatchString(d.Device) {
		t.Errorf("allocated %s, want a MIG device", d.Device)
	}
	out := c.MustExec(t, "dra-mig", "ls /dev/nvidia-caps")
	if !strings.Contains(out, "nvidia-cap") {
		t.Errorf("MIG claim: no nvidia-caps nodes in the container:\n%s", out)
	}
}

// testDRAUnfit: a claim no GPU can hold (more memory than any has) stays Pending with the
// scheduler's reason.
func testDRAUnfit(t *testing.T, c *Cluster) {
	c.CreateClaimTemplate(t, "too-big", classShare, map[string]string{"memory": "48Gi"}, "")
	c.CreatePod(t, ClaimPod("dra-big", "too-big"))
	msg := c.WaitUnschedulable(t, "dra-big", "cannot allocate all claims")
	t.Logf("dra-big: %s", msg)
	checkTesseraWhy(t, c, "dra-big", "cannot allocate all claims")
	if n := len(claimEntries(t, c)); n != 0 {
		t.Errorf("%d claims prepared for an unschedulable pod", n)
	}
}

// testDRABothFrontDoors: the scheduler's DRA allocator does not see device-plugin shares, so it may
// put a claim on a GPU they fill; the agent refuses to prepare what the ledger cannot hold, and the
// pod waits with the reason, while the device-plugin pod keeps its GPU.
func testDRABothFrontDoors(t *testing.T, c *Cluster) {
	c.CreatePod(t, TestPod("dp-share", map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "30Gi", api.ResourceShareCores: "50"}, nil))
	p := c.WaitRunning(t, 3*time.Minute, "dp-share")[0]
	uuid := c.Assignment(t, p).Containers[0].Devices[0].UUID
	c.CreateClaimTemplate(t, "pinned", classShare, map[string]string{"memory": "15Gi", "compute": "30"},
		fmt.Sprintf(`device.attributes["gpu.tessera.dev"].uuid == %q`, uuid))
	c.CreatePod(t, ClaimPod("dra-pinned", "pinned"))
	err := waitFor(2*time.Minute, time.Second, func() (bool, error) {
		for _, e := range c.Events(t, "dra-pinned", "FailedPrepareDynamicResources") {
			if strings.Contains(e, "over-commit") {
				return true, nil
			}
		}
		return false, fmt.Errorf("no FailedPrepareDynamicResources event naming the over-commit")
	})
	if err != nil {
		t.Fatalf("%v\n%s\n%s", err, c.Describe(t, "dra-pinned"), c.Agent.LogTail(20))
	}
	if p := c.Pod(t, "dra-pinned"); p.Status.Phase == "Running" {
		t.Error("the over-committing pod runs")
	}
	var mem int64
	for _, e := range c.LedgerEntries(t) {
		for _, d := range e.Devices {
			if d.UUID == uuid {
				mem += d.MemoryBytes
			}
		}
	}
	if mem != 30<<30 {
		t.Errorf("ledger holds %d bytes of %s, want the device-plugin share's 30 GiB alone:\n%s", mem, uuid, c.Ledger(t))
	}
	// A claim that fits beside it (10 GiB) is prepared on the same GPU: both doors, one ledger.
	c.CreateClaimTemplate(t, "pinned-fit", classShare, map[string]string{"memory": "10Gi", "compute": "30"},
		fmt.Sprintf(`device.attributes["gpu.tessera.dev"].uuid == %q`, uuid))
	c.CreatePod(t, ClaimPod("dra-fit", "pinned-fit"))
	c.WaitRunning(t, 3*time.Minute, "dra-fit")
	checkShareCUDA(t, c, "dra-fit", 10<<30)
}

// testDRAAgentRestart: tessera-node killed with -9 under a running claim pod: the prepared claim is
// still in its ledger when it comes back (the checkpoint), the pod keeps running, a new claim pod
// gets its share beside it, and deletion releases both.
func testDRAAgentRestart(t *testing.T, c *Cluster) {
	c.CreateClaimTemplate(t, "share-10g-30", classShare, map[string]string{"memory": "10Gi", "compute": "30"}, "")
	c.CreatePod(t, ClaimPod("ar-a", "share-10g-30"))
	c.WaitRunning(t, 3*time.Minute, "ar-a")
	before := c.Ledger(t)
	c.Agent.Kill(t)
	c.Agent.Start(t)
	c.WaitAgentReady(t)
	if after := c.Ledger(t); after != before {
		t.Errorf("ledger changed across an agent kill -9:\nbefore %s\nafter  %s", before, after)
	}
	c.CreatePod(t, ClaimPod("ar-b", "share-10g-30"))
	c.WaitRunning(t, 3*time.Minute, "ar-a", "ar-b")
	if n := len(claimEntries(t, c)); n != 2 {
		t.Errorf("%d prepared claims after the restart, want 2:\n%s", n, c.Ledger(t))
	}
	checkShareCUDA(t, c, "ar-b", 10<<30)
	c.DeletePods(t, "ar-a", "ar-b")
	c.WaitLedgerEmpty(t)
}

// testDRAKubeletRestart: the kubelet restarts under a running claim pod: the pod keeps running with
// its claim prepared once (a repeated NodePrepareResources finds the ledger entry), the plugin
// registers again, and a new claim pod runs.
func testDRAKubeletRestart(t *testing.T, c *Cluster) {
	c.CreateClaimTemplate(t, "share-10g-30", classShare, map[string]string{"memory": "10Gi", "compute": "30"}, "")
	c.CreatePod(t, ClaimPod("kr-a", "share-10g-30"))
	before := c.WaitRunning(t, 3*time.Minute, "kr-a")[0]
	ledgerBefore := c.Ledger(t)
	c.Kubelet.Restart(t)
	c.WaitAgentReady(t)
	after := c.WaitRunning(t, 3*time.Minute, "kr-a")[0]
	if after.UID != before.UID || after.Status.ContainerStatuses[0].RestartCount != before.Status.ContainerStatuses[0].RestartCount {
		t.Errorf("the claim pod did not keep running across the kubelet restart: %+v", after.Status.ContainerStatuses)
	}
	if l := c.Ledger(t); l != ledgerBefore {
		t.Errorf("ledger changed across a kubelet restart:\nbefore %s\nafter  %s", ledgerBefore, l)
	}
	c.CreatePod(t, ClaimPod("kr-b", "share-10g-30"))
	c.WaitRunning(t, 3*time.Minute, "kr-b")
	if n := len(claimEntries(t, c)); n != 2 {
		t.Errorf("%d prepared claims, want 2:\n%s", n, c.Ledger(t))
	}
	c.DeletePods(t, "kr-a", "kr-b")
	c.WaitLedgerEmpty(t)
}
