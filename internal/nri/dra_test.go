package nri

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	nriapi "github.com/containerd/nri/pkg/api"
	corev1 "k8s.io/api/core/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/ledger"
	"github.com/tessera-gpu/tessera/internal/podresources"
)

// prepareClaim records a claim as the DRA plugin's NodePrepareResources does.
func prepareClaim(t *testing.T, e *env, name string, podUIDs []string, devs ...api.DeviceAssignment) {
	t.Helper()
	err := e.agent.Ledger().Reserve(ledger.Entry{ContainerID: ledger.ClaimID("cuid-" + name), PodUID: podUIDs[0], Namespace: "ns", Container: "resourceclaim/" + name,
		Devices: devs, Claim: &ledger.Claim{UID: "cuid-" + name, Namespace: "ns", Name: name, PodUIDs: podUIDs}}, e.agent.Inventory())
	if err != nil {
		t.Fatal(err)
	}
}

// draCtr is a container as the kubelet makes it for a claim: the CDI names NodePrepareResources
// answered (resolved by containerd before NRI, so the GPU node is in it).
func (e *env) draCtr(id string, gpuIndex int, share bool) *nriapi.Container {
	inv := e.agent.Inventory()
	c := e.ctr(id, "/dev/nvidia"+string(rune('0'+gpuIndex)))
	token := "tessera.dev/gpu=common"
	if share {
		token = "tessera.dev/vgpu=share"
	}
	c.CDIDevices = []*nriapi.CDIDevice{{Name: token}, {Name: "tessera.dev/gpu=" + inv.GPUs[gpuIndex].UUID}}
	return c
}

// TestDRAContainers: a container granted a prepared claim (PodResources' dynamic resources) is
// realised as a device-plugin share is (vcuda limits from the claim's capacity), its devices are
// counted once (on the claim), and only the pod the claim is reserved for may use it.
func TestDRAContainers(t *testing.T) {
	e := newEnv(t)
	inv := e.agent.Inventory()
	g0 := inv.GPUs[0].UUID
	prepareClaim(t, e, "c1", []string{"uid-dra"}, api.DeviceAssignment{UUID: g0, MemoryBytes: 10 << 30, CoresPercent: 30})
	ourDevice := api.DRADriverName + "/node-a/gpu-0"

	pod := e.pod("dra", nil, nil)
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "dra", Container: "main"}, podresources.ClaimKey("ns", "c1"), ourDevice)
	adj, err := e.create(pod, e.draCtr("c-dra", 0, true))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := mountDests(adj), []string{"/etc/ld.so.preload", api.NodeFilesDirInContainer, api.LimitsPathInContainer, api.ComputeMeasuredDirInContainer, api.RegionDirInContainer + "/region", api.VCUDALibraryInContainer}; !slices.Equal(got, want) {
		t.Errorf("mounts %v, want %v", got, want)
	}
	if got := cdiNames(adj); len(got) != 0 {
		t.Errorf("CDI devices %v added again; the kubelet passed the claim's", got)
	}
	limits, err := os.ReadFile(filepath.Join(e.dir, "state", "claims", "cuid-c1", "limits"))
	if err != nil || !strings.Contains(string(limits), "gpu "+g0+" 10737418240 30") {
		t.Errorf("limits file %q %v: want the claim's 10 GiB / 30%%", limits, err)
	}
	entry, ok := e.agent.Ledger().Get("c-dra")
	if !ok || !slices.Equal(entry.Claims, []string{"cuid-c1"}) || len(entry.Devices) != 0 {
		t.Errorf("container entry %+v: want the claim by UID and no devices of its own", entry)
	}
	if u := e.agent.Ledger().Usage()[g0]; u.Shares != 1 || u.MemoryBytes != 10<<30 {
		t.Errorf("GPU usage %+v: the claim's share must count once", u)
	}

	// Another pod naming the same claim (a forged PodResources entry cannot happen, but a claim
	// shared by pods is reserved for each of them): refused when not reserved for it.
	other := e.pod("other", nil, nil)
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "other", Container: "main"}, podresources.ClaimKey("ns", "c1"), ourDevice)
	if _, err := e.create(other, e.draCtr("c-other", 0, true)); err == nil || !strings.Contains(err.Error(), "reserved for pods [uid-dra], not for this pod") {
		t.Errorf("a pod the claim is not reserved for: %v", err)
	}
	// A claim shared by pods is prepared once (for the first); a later pod whose spec, as the API
	// server has it, names the claim may use it.
	second := e.pod("second", nil, nil)
	name := "c1"
	e.pods.mu.Lock()
	e.pods.pods["ns/second"].Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &name}}
	e.pods.mu.Unlock()
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "second", Container: "main"}, podresources.ClaimKey("ns", "c1"), ourDevice)
	if _, err := e.create(second, e.draCtr("c-second", 0, true)); err != nil {
		t.Errorf("a second pod of a shared claim: %v", err)
	}
	// A claim this node never prepared.
	ghost := e.pod("ghost", nil, nil)
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "ghost", Container: "main"}, podresources.ClaimKey("ns", "c9"), ourDevice)
	if _, err := e.create(ghost, e.draCtr("c-ghost", 0, true)); err == nil || !strings.Contains(err.Error(), "has not prepared it") {
		t.Errorf("an unprepared claim: %v", err)
	}
	// A GPU node the claim does not hold (GPU 1) is refused like any ungranted device.
	prepareClaim(t, e, "c2", []string{"uid-sneak"}, api.DeviceAssignment{UUID: g0, MemoryBytes: 1 << 30})
	sneak := e.pod("sneak", nil, nil)
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "sneak", Container: "main"}, podresources.ClaimKey("ns", "c2"), ourDevice)
	if _, err := e.create(sneak, e.draCtr("c-sneak", 1, true)); err == nil || !strings.Contains(err.Error(), "did not grant") {
		t.Errorf("a GPU outside the claim: %v", err)
	}

	// A whole-GPU claim: no vcuda.
	g2 := inv.GPUs[2].UUID
	prepareClaim(t, e, "w", []string{"uid-whole"}, api.DeviceAssignment{UUID: g2, Whole: true})
	whole := e.pod("whole", nil, nil)
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "whole", Container: "main"}, podresources.ClaimKey("ns", "w"), api.DRADriverName+"/node-a/gpu-2")
	adj, err = e.create(whole, e.draCtr("c-whole", 2, false))
	if err != nil {
		t.Fatal(err)
	}
	if len(adj.GetMounts()) != 0 {
		t.Errorf("whole claim got mounts %v", mountDests(adj))
	}

	// Synchronize with no containers left: container entries go (to holds, then away with their
	// pods), prepared claims stay until NodeUnprepareResources.
	if _, err := e.plugin.Synchronize(context.Background(), nil, nil); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"cuid-c1", "cuid-w"} {
		if _, ok := e.agent.Ledger().Get(ledger.ClaimID(id)); !ok {
			t.Errorf("Synchronize released prepared claim %s", id)
		}
	}
	if _, ok := e.agent.Ledger().Get("c-dra"); ok {
		t.Error("Synchronize kept the entry of a container that is gone")
	}
}

// TestSecurityDRASharedClaimOneCap: a 10 GiB share claim shared by two pods, and named by two
// containers of one of them, is one 10 GiB cap, not one per container: every container gets the
// claim's one region and one limits file (made once, never rewritten), the ledger charges the
// claim once, and the files go when the claim is unprepared. A container that would take shares
// from the claim and from another claim is refused, naming both.
func TestSecurityDRASharedClaimOneCap(t *testing.T) {
	e := newEnv(t)
	g0 := e.agent.Inventory().GPUs[0].UUID
	prepareClaim(t, e, "shared", []string{"uid-a", "uid-b"}, api.DeviceAssignment{UUID: g0, MemoryBytes: 10 << 30, CoresPercent: 30})
	ourDevice := api.DRADriverName + "/node-a/gpu-0"
	claimDir := filepath.Join(e.dir, "state", "claims", "cuid-shared")
	region := filepath.Join(claimDir, "vcuda", "region")
	var regionIno uint64
	pods := map[string]*nriapi.PodSandbox{"a": e.pod("a", nil, nil), "b": e.pod("b", nil, nil)}
	for _, u := range []struct{ pod, container, id string }{{"a", "main", "c-a"}, {"b", "main", "c-b"}, {"a", "side", "c-a2"}} {
		e.grants.Add(podresources.Key{Namespace: "ns", Pod: u.pod, Container: u.container}, podresources.ClaimKey("ns", "shared"), ourDevice)
		c := e.draCtr(u.id, 0, true)
		c.Name = u.container
		adj, err := e.create(pods[u.pod], c)
		if err != nil {
			t.Fatalf("%s: %v", u.id, err)
		}
		src := map[string]string{}
		for _, m := range adj.GetMounts() {
			src[m.Destination] = m.Source
		}
		if src[api.LimitsPathInContainer] != filepath.Join(claimDir, "limits") || src[api.RegionDirInContainer+"/region"] != region {
			t.Errorf("%s: limits from %q and region from %q, want the claim's %s/{limits,vcuda/region}", u.id, src[api.LimitsPathInContainer],
				src[api.RegionDirInContainer+"/region"], claimDir)
		}
		if _, err := os.Stat(filepath.Join(e.dir, "state", "containers", u.id, "vcuda")); !os.IsNotExist(err) {
			t.Errorf("%s: a per-container vcuda dir was made (%v)", u.id, err)
		}
		var st syscall.Stat_t
		if err := syscall.Stat(region, &st); err != nil {
			t.Fatal(err)
		}
		if regionIno == 0 {
			regionIno = st.Ino
			// What vcuda of the first container writes must be what the later ones see.
			if err := os.WriteFile(region, []byte("used"), 0); err != nil {
				t.Fatal(err)
			}
		} else if got, _ := os.ReadFile(region); st.Ino != regionIno || string(got) != "used" {
			t.Errorf("%s: the claim's region was made again (inode %d, was %d; content %q)", u.id, st.Ino, regionIno, got)
		}
		if entry, ok := e.agent.Ledger().Get(u.id); !ok || len(entry.Devices) != 0 || !slices.Equal(entry.Claims, []string{"cuid-shared"}) {
			t.Errorf("%s: ledger entry %+v, want the claim by UID and no devices of its own", u.id, entry)
		}
	}
	limits, err := os.ReadFile(filepath.Join(claimDir, "limits"))
	if err != nil || strings.Count(string(limits), "\ngpu ") != 1 || !strings.Contains(string(limits), "\ngpu "+g0+" 10737418240 30\n") ||
		!strings.Contains(string(limits), "\ncontainer "+ledger.ClaimID("cuid-shared")+"\n") {
		t.Errorf("claim's limits file %q %v: want the claim's one 10 GiB / 30%% GPU", limits, err)
	}
	if got := e.plugin.RegionPath(ledger.ClaimID("cuid-shared")); got != region {
		t.Errorf("RegionPath of the claim = %q, want %q (the metrics read it there)", got, region)
	}
	if u := e.agent.Ledger().Usage()[g0]; u.Shares != 1 || u.MemoryBytes != 10<<30 {
		t.Errorf("GPU usage %+v: the shared claim must be charged once", u)
	}

	// The files outlive their containers while the claim is prepared (a later pod may use it).
	if _, err := e.plugin.Synchronize(context.Background(), nil, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(region); err != nil {
		t.Errorf("the prepared claim's region went with its containers: %v", err)
	}
	// Unprepared: gone (the DRA plugin calls ReleaseClaim), the tmpfs with them.
	if _, _, err := e.agent.Ledger().Release(ledger.ClaimID("cuid-shared")); err != nil {
		t.Fatal(err)
	}
	e.plugin.ReleaseClaim("cuid-shared")
	if _, err := os.Stat(claimDir); !os.IsNotExist(err) {
		t.Errorf("the unprepared claim's files are left: %v", err)
	}
	// An unprepare the plugin missed: Synchronize removes the files of a claim the ledger lost.
	prepareClaim(t, e, "later", []string{"uid-c"}, api.DeviceAssignment{UUID: g0, MemoryBytes: 1 << 30})
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "c", Container: "main"}, podresources.ClaimKey("ns", "later"), ourDevice)
	if _, err := e.create(e.pod("c", nil, nil), e.draCtr("c-c", 0, true)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.agent.Ledger().Release(ledger.ClaimID("cuid-later")); err != nil {
		t.Fatal(err)
	}
	if _, err := e.plugin.Synchronize(context.Background(), nil, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(e.dir, "state", "claims", "cuid-later")); !os.IsNotExist(err) {
		t.Errorf("Synchronize left the files of a claim the ledger no longer holds: %v", err)
	}

	// Shares from two claims in one container would need two regions: refused, naming both.
	g1 := e.agent.Inventory().GPUs[1].UUID
	prepareClaim(t, e, "x", []string{"uid-two"}, api.DeviceAssignment{UUID: g0, MemoryBytes: 1 << 30})
	prepareClaim(t, e, "y", []string{"uid-two"}, api.DeviceAssignment{UUID: g1, MemoryBytes: 1 << 30})
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "two", Container: "main"}, podresources.ClaimKey("ns", "x"), ourDevice)
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "two", Container: "main"}, podresources.ClaimKey("ns", "y"), api.DRADriverName+"/node-a/gpu-1")
	two := e.draCtr("c-two", 0, true)
	two.CDIDevices = append(two.CDIDevices, &nriapi.CDIDevice{Name: "tessera.dev/gpu=" + g1})
	two.Linux.Devices = append(two.Linux.Devices, e.ctr("", "/dev/nvidia1").Linux.Devices...)
	if _, err := e.create(e.pod("two", nil, nil), two); err == nil || !strings.Contains(err.Error(), "ResourceClaim ns/x and ResourceClaim ns/y") {
		t.Errorf("a container taking shares from two claims: %v", err)
	}
}

// TestSecurityDRAAdminAccessClaim: a monitoring pod's admin-access claim (recorded with its GPUs
// in Claim.AdminAccess, holding nothing) lets in exactly those GPUs' device nodes, with no vcuda
// (nothing to cap) and no charge on a GPU another claim holds whole; any other GPU node is refused.
func TestSecurityDRAAdminAccessClaim(t *testing.T) {
	e := newEnv(t)
	inv := e.agent.Inventory()
	g2 := inv.GPUs[2].UUID
	prepareClaim(t, e, "w", []string{"uid-whole"}, api.DeviceAssignment{UUID: g2, Whole: true})
	err := e.agent.Ledger().Reserve(ledger.Entry{ContainerID: ledger.ClaimID("cuid-mon"), PodUID: "uid-mon", Namespace: "ns", Container: "resourceclaim/mon",
		Claim: &ledger.Claim{UID: "cuid-mon", Namespace: "ns", Name: "mon", PodUIDs: []string{"uid-mon"}, AdminAccess: []string{g2}}}, e.agent.Inventory())
	if err != nil {
		t.Fatal(err)
	}
	before := e.agent.Ledger().Usage()[g2]
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "mon", Container: "main"}, podresources.ClaimKey("ns", "mon"), api.DRADriverName+"/node-a/gpu-2")
	adj, err := e.create(e.pod("mon", nil, nil), e.draCtr("c-mon", 2, false))
	if err != nil {
		t.Fatalf("admin-access claim container: %v", err)
	}
	if len(adj.GetMounts()) != 0 {
		t.Errorf("admin-access container got mounts %v; nothing is capped", mountDests(adj))
	}
	if u := e.agent.Ledger().Usage()[g2]; u != before {
		t.Errorf("GPU usage %+v after the monitoring container, was %+v: admin access charges nothing", u, before)
	}
	// The claim reaches GPU 2 only: GPU 1's node is ungranted.
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "mon2", Container: "main"}, podresources.ClaimKey("ns", "mon"), api.DRADriverName+"/node-a/gpu-2")
	name := "mon"
	pod := e.pod("mon2", nil, nil)
	e.pods.mu.Lock()
	e.pods.pods["ns/mon2"].Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &name}}
	e.pods.mu.Unlock()
	if _, err := e.create(pod, e.draCtr("c-mon2", 1, false)); err == nil || !strings.Contains(err.Error(), "did not grant") {
		t.Errorf("a GPU outside the admin-access claim: %v", err)
	}
}
