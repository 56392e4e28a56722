package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// previousRelease is the commit whose chart and images TestHelmUpgrade installs first and upgrades
// from: the release operators run before this tree (move it forward when a release is cut).
const previousRelease = "52e400e"

// TestHelmUpgrade upgrades a running install in place, as docs/upgrade.md tells an operator to:
// the previous release's chart and images (built by `make images` at previousRelease) installed
// the way TestHelmInstall installs the current ones, shares holding GPU memory, a whole GPU and a
// DRA claim running; then `helm upgrade` to this tree's chart and images. Every running container
// keeps its GPU, its caps and the memory it holds (same assignment, same container, not
// restarted), the ledger and the claim survive, the agent and extender pods run the new images,
// and a share placed afterwards gets its cap. `helm uninstall` then leaves the node clean.
func TestHelmUpgrade(t *testing.T) {
	prevImages, prevChart := buildPreviousRelease(t, previousRelease)
	images := buildImages(t)
	c := StartCluster(t, ClusterOptions{Bare: true})
	t0 := time.Now()
	step := func(what string) { t.Logf("helm upgrade: %s (%.1fs)", what, time.Since(t0).Seconds()) }
	const ns, release = "tessera-system", "tessera"
	c.CP.CreateNamespace(t, ns)
	for _, img := range append(prevImages, images...) {
		mustRun(t, 2*time.Minute, tool(t, "ctr"), "-a", c.Ctr.Socket, "-n", "k8s.io", "images", "import", img)
	}
	if out, err := c.Kubectl(t, "label", "node", c.Node, "nvidia.com/gpu.present=true"); err != nil {
		t.Fatalf("label the GPU node: %v\n%s", err, out)
	}
	h := newHelmHost(t, c)
	// The DRA kubelet plugin registers with this cluster's kubelet (its own --root-dir).
	h.set["dra.kubeletDir"] = c.Kubelet.RootDir
	h.set["image.node.tag"], h.set["image.extender.tag"], h.chart = "prev", "prev", prevChart
	h.preloadTLS(t, c, ns, release)
	h.startScheduler(t, c, ns, release)
	h.run(t, ns, "install", release, h.chart, "--wait", "--timeout", "100s")
	h.waitAgent(t, c)
	c.Inventory = h.inventory(t, c)
	h.checkImages(t, c, ns, "prev")
	h.waitAllocatable(t, c, c.ExpectedAllocatable(t))
	step("previous release installed")

	// The load: two shares holding a quarter of their 10Gi cap (30% compute) in a running CUDA
	// process, a whole GPU, and a pod with a DRA share claim.
	const capBytes, held = int64(10 << 30), int64(10<<30) / 4
	shareLimits := map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "10Gi", api.ResourceShareCores: "30"}
	shares := []string{"share-a", "share-b"}
	for _, name := range shares {
		p := TestPod(name, shareLimits, nil)
		p.Spec.Containers[0].Command = []string{"sh", "-c", fmt.Sprintf("trap 'exit 0' TERM; cudaprobe hold %d 3600 & wait", held)}
		c.CreatePod(t, p)
	}
	c.CreatePod(t, TestPod("whole", map[string]string{api.ResourceGPU: "1"}, nil))
	c.CreateClaimTemplate(t, "share-10g-30", classShare, map[string]string{"memory": "10Gi", "compute": "30"}, "")
	c.CreatePod(t, ClaimPod("dra", "share-10g-30"))
	names := append(slices.Clone(shares), "whole", "dra")
	c.WaitRunning(t, 3*time.Minute, names...)
	freeBefore := map[string]uint64{}
	for _, name := range shares {
		freeBefore[name] = waitHeld(t, c, name, capBytes, held)
	}
	before := podStates(t, c, names)
	claim := c.PodClaim(t, "dra")
	claimBefore, _ := json.Marshal(claim.Status)
	ledgerBefore := ledgerLines(t, c)
	t.Logf("before the upgrade: ledger\n  %s\nclaim %s status %s", strings.Join(ledgerBefore, "\n  "), claim.Name, claimBefore)
	if !slices.ContainsFunc(ledgerBefore, func(l string) bool { return strings.Contains(l, `"claim":`) }) || len(ledgerBefore) < len(names) {
		t.Fatalf("the previous agent's ledger lacks the running containers or the claim:\n%s", c.Ledger(t))
	}
	h.waitAllocatable(t, c, ledgerAllocatable(t, c))
	oldAgent := h.agentPod(t, c, ns)
	step("load running")

	// The upgrade, as docs/upgrade.md says: this tree's chart, its images, the same values.
	h.set["image.node.tag"], h.set["image.extender.tag"], h.chart = "e2e", "e2e", helmChart()
	h.run(t, ns, "upgrade", release, h.chart, "--wait", "--timeout", "100s")
	h.waitNewAgent(t, c, ns, oldAgent)
	h.waitAgent(t, c)
	h.checkImages(t, c, ns, "e2e")
	h.waitAllocatable(t, c, ledgerAllocatable(t, c))
	step("helm upgrade done, new agent serving")

	after := podStates(t, c, names)
	for _, name := range names {
		if b, a := before[name], after[name]; a != b {
			t.Errorf("%s changed across the upgrade (re-placed or restarted):\n  before %+v\n  after  %+v", name, b, a)
		}
	}
	if got := ledgerLines(t, c); !slices.Equal(got, ledgerBefore) {
		t.Errorf("the ledger changed across the upgrade:\n  before %s\n  after  %s", strings.Join(ledgerBefore, "\n         "), strings.Join(got, "\n         "))
	}
	if got, _ := json.Marshal(c.PodClaim(t, "dra").Status); string(got) != string(claimBefore) {
		t.Errorf("claim %s's status changed across the upgrade:\n  before %s\n  after  %s", claim.Name, claimBefore, got)
	}
	// The caps still hold: the memory held since before the upgrade still counts against the cap.
	for _, name := range shares {
		checkFillBesideHeld(t, c, name, capBytes, held, freeBefore[name])
	}
	if out := c.MustExec(t, "dra", "cat /etc/tessera/vcuda/limits"); !strings.Contains(out, fmt.Sprintf(" %d 30", capBytes)) {
		t.Errorf("dra: limits file %q after the upgrade, want one GPU capped at 10 GiB and 30%%", out)
	}
	c.CreatePod(t, TestPod("after-upgrade", map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "2Gi", api.ResourceShareCores: "20"}, nil))
	p := c.WaitRunning(t, time.Minute, "after-upgrade")[0]
	if a := c.Assignment(t, p); a == nil || len(a.Container("main").Devices) != 1 || a.Container("main").Devices[0].CoresPercent != 20 {
		t.Errorf("after-upgrade: assignment %+v, want one share at 20%% compute", a)
	}
	checkShareCUDA(t, c, "after-upgrade", 2<<30)
	step("running load kept, new share placed")

	// Uninstall once the workloads are gone, as docs/upgrade.md's rollback does before reinstalling.
	c.DeletePods(t, append(names, "after-upgrade")...)
	c.WaitClaimsGone(t)
	h.run(t, ns, "uninstall", release, "--wait", "--timeout", "100s")
	h.waitNoAgent(t, c, ns)
	if left := h.leftovers(t, c); len(left) > 0 {
		t.Errorf("helm uninstall left on the node:\n  %s\n%s", strings.Join(left, "\n  "), h.diagnose(t, ns))
	}
	step("node clean")
}

// upgradePodState is what must not change for a running pod across an upgrade.
type upgradePodState struct {
	assignment, container string
	restarts              int32
}

func podStates(t *testing.T, c *Cluster, names []string) map[string]upgradePodState {
	t.Helper()
	out := map[string]upgradePodState{}
	for _, name := range names {
		p := c.Pod(t, name)
		if len(p.Status.ContainerStatuses) != 1 || p.Status.ContainerStatuses[0].State.Running == nil {
			t.Fatalf("%s: container not running: %+v", name, p.Status.ContainerStatuses)
		}
		cs := p.Status.ContainerStatuses[0]
		out[name] = upgradePodState{assignment: p.Annotations[api.AnnotationAssignment], container: cs.ContainerID, restarts: cs.RestartCount}
		if name != "dra" && out[name].assignment == "" {
			t.Fatalf("%s has no assignment annotation", name)
		}
	}
	return out
}

// ledgerAllocatable is ExpectedAllocatable counting the DRA claims too (the pods' assignments do
// not show them): from the ledger's devices, a GPU holding shares is not offered whole, a GPU held
// whole offers no shares, and a claim's share takes one share token (the kubelet does not count
// claims against the device plugin's tokens, so the agent withdraws one).
func ledgerAllocatable(t *testing.T, c *Cluster) map[string]int64 {
	t.Helper()
	shared, whole := map[string]bool{}, map[string]bool{}
	claimShares := 0
	for _, e := range c.LedgerEntries(t) {
		for _, d := range e.Devices {
			switch {
			case d.Whole:
				whole[d.UUID] = true
			case e.Claim != nil:
				shared[d.UUID] = true
				claimShares++
			default:
				shared[d.UUID] = true
			}
		}
	}
	return map[string]int64{api.ResourceGPU: int64(SimWholeGPUs - len(shared)),
		api.ResourceShare: int64(SimShares - len(whole)*c.Inventory.SharesPerGPU - claimShares)}
}

// ledgerLines are the agent's ledger entries, each as JSON, sorted.
func ledgerLines(t *testing.T, c *Cluster) []string {
	t.Helper()
	var out []string
	for _, e := range c.LedgerEntries(t) {
		b, err := json.Marshal(e)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, string(b))
	}
	slices.Sort(out)
	return out
}

// waitHeld waits until the share's holding process has its memory (with its context's, which
// vcuda charges too) and returns the free memory a second process then sees.
func waitHeld(t *testing.T, c *Cluster, pod string, capBytes, held int64) uint64 {
	t.Helper()
	var out string
	var free uint64
	err := waitFor(time.Minute, 500*time.Millisecond, func() (bool, error) {
		out = c.MustExec(t, pod, "cudaprobe info")
		free = probeValues(t, out, "device")["meminfo_free"]
		return free <= uint64(capBytes-held), nil
	})
	if err != nil {
		t.Fatalf("%s: the holding process does not hold %d of %d bytes: %v\n%s", pod, held, capBytes, err, out)
	}
	return free
}

// checkFillBesideHeld: after the upgrade, a second process sees the cap and the free memory it saw
// before (the accounting region kept what the holder holds), and fills up to that and no further.
func checkFillBesideHeld(t *testing.T, c *Cluster, pod string, capBytes, held int64, freeBefore uint64) {
	t.Helper()
	out := c.MustExec(t, pod, fmt.Sprintf("cudaprobe info; cudaprobe fill %d", cudaGranule))
	if info := probeValues(t, out, "device"); info["total_mem"] != uint64(capBytes) || info["meminfo_free"] != freeBefore {
		t.Errorf("%s: CUDA reports %d bytes, %d free after the upgrade; want the %d cap, %d free as before:\n%s",
			pod, info["total_mem"], info["meminfo_free"], capBytes, freeBefore, out)
	}
	fill := probeValues(t, out, "allocated")
	if fill["stopped_by"] != 2 || fill["allocated"]+uint64(held) > uint64(capBytes) || fill["allocated"] > fill["meminfo_free"] ||
		fill["meminfo_free"]-fill["allocated"] >= cudaGranule {
		t.Errorf("%s: filled %d bytes of %d free beside %d held under a %d cap (stopped by CUDA error %d); want out of memory (2) within one %d-byte allocation of the free memory:\n%s",
			pod, fill["allocated"], fill["meminfo_free"], held, capBytes, fill["stopped_by"], cudaGranule, out)
	}
}

// checkImages: every agent and extender pod runs the images of this tag, and is ready.
func (h *helmHost) checkImages(t *testing.T, c *Cluster, ns, tag string) {
	t.Helper()
	err := waitFor(90*time.Second, 300*time.Millisecond, func() (bool, error) {
		l, err := c.CP.Client.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		n := 0
		for _, p := range l.Items {
			for _, cs := range p.Status.ContainerStatuses {
				if !strings.HasSuffix(cs.Image, ":"+tag) || !cs.Ready {
					return false, fmt.Errorf("pod %s container %s runs %s (ready %t), want tag %s", p.Name, cs.Name, cs.Image, cs.Ready, tag)
				}
			}
			if p.Status.Phase == corev1.PodRunning {
				n++
			}
		}
		if n != 3 {
			return false, fmt.Errorf("%d pods running in %s, want the agent and 2 extender replicas", n, ns)
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("images: %v\n%s", err, h.diagnose(t, ns))
	}
}

// buildPreviousRelease builds the images (`make images`, tagged "prev") and extracts the chart of
// commit, in a temporary git worktree of this repository, and keeps both under the test cache by
// the commit's hash: a second run builds nothing. A missing git or commit fails the test (a
// shallow clone lacks it: fetch with --unshallow).
func buildPreviousRelease(t *testing.T, commit string) (images []string, chart string) {
	t.Helper()
	root := repoRoot()
	full, err := runCmd(t, time.Minute, "git", "-C", root, "rev-parse", "--verify", commit+"^{commit}")
	if err != nil {
		t.Fatalf("the previous release %s is not in this clone (a shallow clone? git fetch --unshallow): %v\n%s", commit, err, full)
	}
	cache := filepath.Dir(toolsDir())
	dir := filepath.Join(cache, "previous-release", full)
	images = []string{filepath.Join(dir, "tessera-node.tar"), filepath.Join(dir, "tessera-extender.tar")}
	chart = filepath.Join(dir, "chart", "tessera")
	if _, err := os.Stat(dir); err == nil {
		t.Logf("previous release %s: cached in %s", commit, dir)
		return images, chart
	}
	t0 := time.Now()
	// The worktree and the staging folder sit beside dir, so what they build is renamed into place
	// on one filesystem.
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		t.Fatal(err)
	}
	src, err := os.MkdirTemp(filepath.Dir(dir), "src-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(src)
	mustRun(t, time.Minute, "git", "-C", root, "worktree", "add", "--detach", src, full)
	defer func() {
		if out, err := runCmd(t, time.Minute, "git", "-C", root, "worktree", "remove", "--force", src); err != nil {
			t.Errorf("git worktree remove %s: %v\n%s", src, err, out)
		}
	}()
	// Built into a staging folder renamed into place only when complete: a cut-short build is not
	// taken for a cached one.
	stage, err := os.MkdirTemp(filepath.Dir(dir), "staging-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(stage)
	bin := filepath.Join(src, "bin")
	if out, err := runCmd(t, 10*time.Minute, "make", "-C", src, "images", "BIN="+bin, "CACHE="+cache, "IMAGE_TAG=prev"); err != nil {
		t.Fatalf("make images at %s: %v\n%s", commit, err, out)
	}
	for _, img := range images {
		if err := os.Rename(filepath.Join(bin, "images", filepath.Base(img)), filepath.Join(stage, filepath.Base(img))); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(filepath.Join(stage, "chart"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(src, "deploy", "helm", "tessera"), filepath.Join(stage, "chart", "tessera")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(stage, dir); err != nil {
		t.Fatal(err)
	}
	t.Logf("previous release %s: built in %.0fs into %s", commit, time.Since(t0).Seconds(), dir)
	return images, chart
}
