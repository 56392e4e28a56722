package nri

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	nriadapt "github.com/containerd/nri/pkg/adaptation"
	nriapi "github.com/containerd/nri/pkg/api"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/ledger"
	"github.com/tessera-gpu/tessera/internal/podresources"
)

var shareReq = map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "10Gi", api.ResourceShareCores: "30"}

// victim creates a share container placed locally and returns its ledger entry's GPU.
func (e *env) victim(t *testing.T) string {
	t.Helper()
	pod := e.pod("victim", shareReq, nil)
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "victim", Container: "main"}, api.ResourceShare, "vgpu-0")
	if _, err := e.create(pod, ctr("c-victim")); err != nil {
		t.Fatal(err)
	}
	v, ok := e.agent.Ledger().Get("c-victim")
	if !ok {
		t.Fatal("victim not in the ledger")
	}
	return v.Devices[0].UUID
}

// Holds of a pod the kubelet stopped listing go after two lists without it, once the API server has
// no such pod either (while it has the pod, the kubelet may run it again with the same grant).
func TestSecurityHoldReleasedWhenUnlisted(t *testing.T) {
	e := newEnv(t)
	g := e.victim(t)
	pod := e.pod("gone", shareReq, nil)
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "gone", Container: "main"}, api.ResourceShare, "vgpu-1")
	if _, err := e.create(pod, ctr("c-gone")); err != nil {
		t.Fatal(err)
	}
	if _, err := e.rt.StopContainer(context.Background(), &nriadapt.StopContainerRequest{Pod: pod, Container: ctr("c-gone")}); err != nil {
		t.Fatal(err)
	}
	victimOnly := map[podresources.Key]podresources.Grant{{Namespace: "ns", Pod: "victim", Container: "main"}: nil}
	e.plugin.ReleaseUnlisted(context.Background(), victimOnly)
	e.plugin.ReleaseUnlisted(context.Background(), victimOnly)
	if _, ok := e.agent.Ledger().Get(holdID("uid-gone", "main")); !ok {
		t.Fatal("hold released while the API server still has the pod")
	}
	e.pods.set("ns", "gone", func(*corev1.Pod) *corev1.Pod { return nil })
	both := map[podresources.Key]podresources.Grant{{Namespace: "ns", Pod: "victim", Container: "main"}: nil, {Namespace: "ns", Pod: "gone", Container: "main"}: nil}
	e.plugin.ReleaseUnlisted(context.Background(), both)
	if _, ok := e.agent.Ledger().Get(holdID("uid-gone", "main")); !ok {
		t.Fatal("hold released while the kubelet still lists the pod")
	}
	e.plugin.ReleaseUnlisted(context.Background(), victimOnly)
	if _, ok := e.agent.Ledger().Get(holdID("uid-gone", "main")); !ok {
		t.Fatal("hold released after one list without the pod")
	}
	e.plugin.ReleaseUnlisted(context.Background(), victimOnly)
	if _, ok := e.agent.Ledger().Get(holdID("uid-gone", "main")); ok {
		t.Error("hold of a pod the kubelet no longer lists survived two lists")
	}
	e.victimUntouched(t, g)
}

// A pod deleted and recreated under the same name on the node (a StatefulSet's pod): the kubelet
// lists that name for the new pod as long as it runs here, so the old pod's hold goes by the API
// server's word that the name is another pod's, at the next list, not when the name goes. The new
// pod's container is untouched and gets the released share.
func TestSecurityHoldOfReplacedPodReleased(t *testing.T) {
	e := newEnv(t)
	g := e.victim(t)
	old := e.pod("web-0", shareReq, nil)
	key := podresources.Key{Namespace: "ns", Pod: "web-0", Container: "main"}
	e.grants.Add(key, api.ResourceShare, "vgpu-1")
	if _, err := e.create(old, ctr("c-web-a")); err != nil {
		t.Fatal(err)
	}
	if _, err := e.rt.StopContainer(context.Background(), &nriadapt.StopContainerRequest{Pod: old, Container: ctr("c-web-a")}); err != nil {
		t.Fatal(err)
	}
	listed := map[podresources.Key]podresources.Grant{{Namespace: "ns", Pod: "victim", Container: "main"}: nil, key: nil}
	e.plugin.ReleaseUnlisted(context.Background(), listed)
	if _, ok := e.agent.Ledger().Get(holdID("uid-web-0", "main")); !ok {
		t.Fatal("hold released while the API server still has the pod")
	}
	e.pods.set("ns", "web-0", func(p *corev1.Pod) *corev1.Pod { p.UID = "uid-web-0-b"; return p })
	e.plugin.ReleaseUnlisted(context.Background(), listed)
	if h, ok := e.agent.Ledger().Get(holdID("uid-web-0", "main")); ok {
		t.Fatalf("the replaced pod's hold outlives it while the kubelet lists its name for the new pod: %+v", h)
	}
	recreated := &nriapi.PodSandbox{Id: "sb-web-0-b", Name: "web-0", Namespace: "ns", Uid: "uid-web-0-b"}
	if _, err := e.create(recreated, ctr("c-web-b")); err != nil {
		t.Fatalf("the new pod's container: %v", err)
	}
	e.plugin.ReleaseUnlisted(context.Background(), listed)
	e.plugin.ReleaseUnlisted(context.Background(), listed)
	if _, ok := e.agent.Ledger().Get("c-web-b"); !ok {
		t.Error("the new pod's running container lost its entry")
	}
	e.victimUntouched(t, g)
}

// victimUntouched checks the victim still holds its GPU.
func (e *env) victimUntouched(t *testing.T, gpu string) {
	t.Helper()
	if v, ok := e.agent.Ledger().Get("c-victim"); !ok || v.Devices[0].UUID != gpu {
		t.Errorf("victim lost its GPU %s: %+v", gpu, v)
	}
}

func ociState(id string, ann map[string]string) *strings.Reader {
	data, _ := json.Marshal(map[string]any{"ociVersion": "1.2.0", "id": id, "annotations": ann})
	return strings.NewReader(string(data))
}

// The realisation hook passes only a container the plugin approved: the nonce in its annotations
// must match the mark on the host.
func TestSecurityRealisationHook(t *testing.T) {
	e := newEnv(t)
	g := e.victim(t)
	adj, err := e.create(e.pod("victim", shareReq, nil), ctr("c-victim"))
	if err != nil {
		t.Fatal(err)
	}
	runDir := filepath.Join(e.dir, "state")
	nonce := adj.GetAnnotations()[api.AnnotationRealised]
	if nonce == "" {
		t.Fatal("the plugin added no realisation annotation")
	}
	if err := CheckRealised(runDir, ociState("c-victim", map[string]string{api.AnnotationRealised: nonce})); err != nil {
		t.Errorf("realised container refused: %v", err)
	}
	for name, tc := range map[string]struct {
		id  string
		ann map[string]string
	}{
		"no annotation (plugin timed out)": {"c-victim", nil},
		"forged nonce":                     {"c-victim", map[string]string{api.AnnotationRealised: "0123"}},
		"never realised":                   {"c-other", map[string]string{api.AnnotationRealised: nonce}},
		"path as id":                       {"../c-victim", map[string]string{api.AnnotationRealised: nonce}},
	} {
		err := CheckRealised(runDir, ociState(tc.id, tc.ann))
		if err == nil {
			t.Errorf("%s: hook passed", name)
		} else if !strings.Contains(err.Error(), "not") {
			t.Errorf("%s: unclear error %v", name, err)
		}
	}
	e.victimUntouched(t, g)
}

// A GPU node under another path (195:N mounted as /dev/gpu3) is recognised by its number.
func TestSecurityDeviceByNumber(t *testing.T) {
	e := newEnv(t)
	g := e.victim(t)
	_, err := e.create(e.pod("renamed", nil, nil), e.ctr("c-renamed", "/dev/gpu3=/dev/nvidia3"))
	if err == nil || !strings.Contains(err.Error(), "/dev/gpu3 (195:3") {
		t.Errorf("renamed GPU node: %v", err)
	}
	// A GPU the inventory does not list (excluded, fallen off the bus) is still a GPU; a MIG
	// instance's access cap (not major 195) is known from the inventory.
	unknown := ctr("c-unknown")
	unknown.Linux.Devices = []*nriapi.LinuxDevice{{Path: "/dev/x", Type: "c", Major: 195, Minor: 200}}
	if _, err := e.create(e.pod("unknown", nil, nil), unknown); err == nil || !strings.Contains(err.Error(), "NVIDIA GPU minor 200") {
		t.Errorf("unknown GPU minor: %v", err)
	}
	n := e.agent.Node()
	var capPath string
	for i := range n.GPUs {
		if n.GPUs[i].MIG != nil && len(n.GPUs[i].MIG.Instances) > 0 {
			capPath = n.MIGNodes(&n.GPUs[i], &n.GPUs[i].MIG.Instances[0])[1].Path
		}
	}
	if _, err := e.create(e.pod("cap", nil, nil), e.ctr("c-cap", "/dev/mycap="+capPath)); err == nil || !strings.Contains(err.Error(), "/dev/mycap (") || !strings.Contains(err.Error(), "MIG ") {
		t.Errorf("MIG cap under another path: %v", err)
	}
	e.victimUntouched(t, g)
}

// The validator sees what every plugin added: GPU devices, host GPU nodes bind-mounted, CDI
// annotations a later runtime would resolve, NVIDIA_VISIBLE_DEVICES turned back on.
func TestSecurityValidatorAfterAllPlugins(t *testing.T) {
	e := newEnv(t)
	g := e.victim(t)
	dev := e.ctr("x", "/dev/gpu5=/dev/nvidia5").Linux.Devices[0]
	host := filepath.Join(e.agent.Node().DevRoot, "dev", "nvidia4")
	pod := e.pod("late", nil, nil)
	base := func() *nriapi.ValidateContainerAdjustmentRequest {
		adj := &nriapi.ContainerAdjustment{}
		adj.AddEnv(VisibleDevicesEnv, "void")
		return &nriapi.ValidateContainerAdjustmentRequest{Pod: pod, Container: ctr("c-late"), Adjust: adj, Owners: &nriapi.OwningPlugins{}}
	}
	if err := e.plugin.ValidateContainerAdjustment(context.Background(), base()); err != nil {
		t.Fatalf("clean container refused: %v", err)
	}
	cases := map[string]struct {
		edit func(*nriapi.ValidateContainerAdjustmentRequest)
		want string
	}{
		"device from a later plugin": {func(r *nriapi.ValidateContainerAdjustmentRequest) { r.Adjust.AddDevice(dev) }, "/dev/gpu5 (195:5"},
		"hostPath character device": {func(r *nriapi.ValidateContainerAdjustmentRequest) {
			r.Container.Mounts = []*nriapi.Mount{{Source: host, Destination: "/dev/x"}}
		}, "mounted from host " + host},
		"CDI annotation passed through": {func(r *nriapi.ValidateContainerAdjustmentRequest) {
			r.Container.Annotations = map[string]string{"cdi.k8s.io/evil": "nvidia.com/gpu=all"}
		}, "cdi.k8s.io/evil=nvidia.com/gpu=all"},
		"env turned back on": {func(r *nriapi.ValidateContainerAdjustmentRequest) { r.Adjust.AddEnv(VisibleDevicesEnv, "all") }, `NVIDIA_VISIBLE_DEVICES is "all"`},
	}
	nic := base()
	nic.Container.Annotations = map[string]string{"cdi.k8s.io/nic": "example.com/nic=eth1"}
	if err := e.plugin.ValidateContainerAdjustment(context.Background(), nic); err != nil {
		t.Errorf("another vendor's CDI annotation refused: %v", err)
	}
	for name, tc := range cases {
		r := base()
		tc.edit(r)
		err := e.plugin.ValidateContainerAdjustment(context.Background(), r)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", name, err, tc.want)
		}
	}
	e.victimUntouched(t, g)
}

// Environment cannot pull GPUs: every container gets NVIDIA_VISIBLE_DEVICES=void, except in an
// administrator's namespace.
func TestSecurityVisibleDevicesVoid(t *testing.T) {
	e := newEnv(t)
	c := ctr("c-env")
	c.Env = []string{"NVIDIA_VISIBLE_DEVICES=all"}
	adj, err := e.create(e.pod("env", nil, nil), c)
	if err != nil {
		t.Fatal(err)
	}
	if v := finalEnv(c.Env, adj.GetEnv(), VisibleDevicesEnv); v != "void" {
		t.Errorf("NVIDIA_VISIBLE_DEVICES after the plugin: %q", v)
	}
	e.plugin.cfg.AdminNamespaces = []string{"ns"}
	adj, err = e.create(e.pod("monitor", nil, nil), e.ctr("c-mon", "/dev/nvidia0", "/dev/nvidia1"))
	if err != nil {
		t.Fatalf("admin namespace pod refused: %v", err)
	}
	if v := finalEnv([]string{"NVIDIA_VISIBLE_DEVICES=all"}, adj.GetEnv(), VisibleDevicesEnv); v != "all" {
		t.Errorf("admin namespace: NVIDIA_VISIBLE_DEVICES %q", v)
	}
	if _, admin, _ := e.plugin.SecurityStats(); admin != 1 {
		t.Errorf("admin containers counted %d", admin)
	}
}

// Privileged containers run (they are root on the node, outside isolation) and are counted.
func TestSecurityPrivilegedRuns(t *testing.T) {
	e := newEnv(t)
	g := e.victim(t)
	pod := e.pod("priv", nil, nil)
	yes := true
	e.pods.pods["ns/priv"].Spec.Containers[0].SecurityContext = &corev1.SecurityContext{Privileged: &yes}
	adj, err := e.create(pod, e.ctr("c-priv", "/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"))
	if err != nil {
		t.Fatalf("privileged container refused: %v", err)
	}
	// Driver and operator pods rely on their NVIDIA_VISIBLE_DEVICES; a privileged container has
	// every device anyway.
	if v := finalEnv([]string{"NVIDIA_VISIBLE_DEVICES=all"}, adj.GetEnv(), VisibleDevicesEnv); v != "all" {
		t.Errorf("privileged container's NVIDIA_VISIBLE_DEVICES: %q", v)
	}
	if priv, _, _ := e.plugin.SecurityStats(); priv != 1 {
		t.Errorf("privileged containers counted %d", priv)
	}
	// The same devices in a pod that is not privileged: refused.
	if _, err := e.create(e.pod("notpriv", nil, nil), e.ctr("c-np", "/dev/nvidia0")); err == nil {
		t.Error("unprivileged container with every GPU admitted")
	}
	e.victimUntouched(t, g)
}

// A stopped container's GPU stays with its pod: another pod cannot take it and the restarted
// container gets the same GPU back; the pod deleted and its sandbox stopped frees it.
func TestSecurityRestartKeepsGPU(t *testing.T) {
	e := newEnv(t)
	req := map[string]string{api.ResourceGPU: "6"}
	pod := e.pod("crash", req, nil)
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "crash", Container: "main"}, api.ResourceGPU, "gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5")
	if _, err := e.create(pod, ctr("c-crash-1")); err != nil {
		t.Fatal(err)
	}
	first, _ := e.agent.Ledger().Get("c-crash-1")
	if _, err := e.rt.StopContainer(context.Background(), &nriadapt.StopContainerRequest{Pod: pod, Container: ctr("c-crash-1")}); err != nil {
		t.Fatal(err)
	}
	// Another pod scheduled without the extender, while the container is down: nothing free.
	other := e.pod("thief", map[string]string{api.ResourceGPU: "1"}, nil)
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "thief", Container: "main"}, api.ResourceGPU, "gpu-6")
	if _, err := e.create(other, ctr("c-thief")); err == nil {
		t.Error("another pod took a GPU held for a restarting container")
	}
	if _, err := e.create(pod, ctr("c-crash-2")); err != nil {
		t.Fatalf("restarted container refused: %v", err)
	}
	again, _ := e.agent.Ledger().Get("c-crash-2")
	if len(again.Devices) != 6 || again.Devices[0].UUID != first.Devices[0].UUID {
		t.Errorf("restart got %+v, first run had %+v", again.Devices, first.Devices)
	}
	if _, err := e.rt.StopContainer(context.Background(), &nriadapt.StopContainerRequest{Pod: pod, Container: ctr("c-crash-2")}); err != nil {
		t.Fatal(err)
	}
	// The kubelet still lists the pod: its hold stays; one list without it is not enough either.
	listed := map[podresources.Key]podresources.Grant{{Namespace: "ns", Pod: "crash", Container: "main"}: nil}
	e.plugin.ReleaseUnlisted(context.Background(), listed)
	e.plugin.ReleaseUnlisted(context.Background(), listed)
	e.plugin.ReleaseUnlisted(context.Background(), nil)
	if _, ok := e.agent.Ledger().Get(holdID("uid-crash", "main")); !ok {
		t.Error("hold released while the kubelet listed the pod a moment ago")
	}
	e.pods.set("ns", "crash", func(*corev1.Pod) *corev1.Pod { return nil })
	if err := e.rt.StopPodSandbox(context.Background(), &nriadapt.StopPodSandboxRequest{Pod: pod}); err != nil {
		t.Fatal(err)
	}
	if n := len(e.agent.Ledger().Entries()); n != 0 {
		t.Errorf("pod stopped but the ledger holds %d entries: %+v", n, e.agent.Ledger().Entries())
	}
}

// A sandbox containerd recovered after a restart reports its ID but no pod metadata: its holds go
// when it is stopped all the same (its pod, as the ledger names it, is gone).
func TestSecurityRecoveredSandboxReleasesHolds(t *testing.T) {
	e := newEnv(t)
	pod := e.pod("old", shareReq, nil)
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "old", Container: "main"}, api.ResourceShare, "vgpu-0")
	if _, err := e.create(pod, ctr("c-old")); err != nil {
		t.Fatal(err)
	}
	if _, err := e.rt.StopContainer(context.Background(), &nriadapt.StopContainerRequest{Pod: pod, Container: ctr("c-old")}); err != nil {
		t.Fatal(err)
	}
	e.pods.set("ns", "old", func(*corev1.Pod) *corev1.Pod { return nil })
	if err := e.rt.StopPodSandbox(context.Background(), &nriadapt.StopPodSandboxRequest{Pod: &nriapi.PodSandbox{Id: pod.GetId()}}); err != nil {
		t.Fatal(err)
	}
	if n := len(e.agent.Ledger().Entries()); n != 0 {
		t.Errorf("recovered sandbox stopped but the ledger holds %+v", e.agent.Ledger().Entries())
	}
}

// The accounting region is a file on its own small tmpfs: writing past the limit fails (the node's
// /run cannot fill), and a region swapped for a FIFO or a symlink is refused without blocking.
func TestSecurityRegionBounded(t *testing.T) {
	e := newEnv(t)
	e.victim(t)
	path := e.plugin.RegionPath("c-victim")
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, err = f.Write(make([]byte, RegionLimit+1<<20))
	f.Close()
	if err == nil || !strings.Contains(err.Error(), "no space left") {
		t.Errorf("writing past the region's limit: %v", err)
	}
	if data, err := e.plugin.ReadRegion("c-victim"); err != nil || len(data) > RegionLimit {
		t.Errorf("region read: %d bytes, %v", len(data), err)
	}
	os.Remove(path)
	if err := syscall.Mkfifo(path, 0o666); err != nil {
		t.Fatal(err)
	}
	if _, err := e.plugin.ReadRegion("c-victim"); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("FIFO region: %v", err)
	}
	os.Remove(path)
	for _, target := range []string{"/dev/zero", filepath.Join(e.dir, "ledger.json")} {
		os.Remove(path)
		if err := os.Symlink(target, path); err != nil {
			t.Fatal(err)
		}
		if _, err := e.plugin.ReadRegion("c-victim"); err == nil {
			t.Errorf("region symlinked to %s was followed", target)
		}
	}
	// The region's tmpfs goes with the container.
	e.plugin.removeContainerDir("c-victim")
	if _, err := os.Stat(filepath.Dir(path)); !os.IsNotExist(err) {
		t.Errorf("container dir left: %v", err)
	}
}

// A running container that holds a GPU with no ledger entry (it started without the plugin) is
// reported at Synchronize: metric and Event; a container with its entry is not.
func TestSecurityUnrealisedReported(t *testing.T) {
	e, l := newAgentEnv(t)
	rogue := e.ctr("c-rogue", "/dev/nvidia2")
	rogue.State = nriapi.ContainerState_CONTAINER_RUNNING
	e.pod("rogue", nil, nil)
	e.sandboxes = []*nriapi.PodSandbox{{Id: "sb", Name: "rogue", Namespace: "ns", Uid: "uid-rogue"}}
	e.running = []*nriapi.Container{rogue}
	e.start(podresources.New(filepath.Join(e.dir, "none.sock")), l)
	if _, _, n := e.plugin.SecurityStats(); n != 1 {
		t.Errorf("unrealised containers: %d, want 1", n)
	}
	e.events.mu.Lock()
	defer e.events.mu.Unlock()
	if len(e.events.events) != 1 || !strings.HasPrefix(e.events.events[0], "Warning v1/Pod ns/rogue(uid-rogue) TesseraUnrealisedGPU: ") || !strings.Contains(e.events.events[0], "/dev/nvidia2 (195:2") {
		t.Errorf("events: %v", e.events.events)
	}
}

// A Kata pod's mdev container restarts with its mdev vGPU (it used to be refused: the pod kept the
// device under another entry).
func TestSecurityRestartKeepsMdev(t *testing.T) {
	e := newEnv(t)
	res := api.MdevResource("A100-4C")
	devs := e.agent.Devices(res)
	if len(devs) == 0 {
		t.Fatalf("no %s devices", res)
	}
	if _, err := e.agent.Allocate(res, []string{devs[0].ID}); err != nil {
		t.Fatal(err)
	}
	pod := e.pod("vm", map[string]string{res: "1"}, nil)
	pod.RuntimeHandler = "kata-qemu"
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "vm", Container: "main"}, res, devs[0].ID)
	for i, id := range []string{"c-vm-1", "c-vm-2"} {
		if _, err := e.create(pod, ctr(id)); err != nil {
			t.Fatalf("run %d: %v", i+1, err)
		}
		if got, _ := e.agent.Ledger().Get(id); len(got.Mdev) != 1 || got.Mdev[0] != devs[0].ID {
			t.Errorf("run %d holds %+v", i+1, got.Mdev)
		}
		if _, err := e.rt.StopContainer(context.Background(), &nriadapt.StopContainerRequest{Pod: pod, Container: ctr(id)}); err != nil {
			t.Fatal(err)
		}
	}
	if h, ok := e.agent.Ledger().Get(holdID("uid-vm", "main")); !ok || len(h.Mdev) != 1 {
		t.Errorf("the mdev is not held for the pod: %+v", h)
	}
}

// TestSecurityValidatorForeignPluginName: a GPU CDI annotation that a later runtime would resolve is
// Tessera's own (the Kata mdev annotation) only when the plugin that set it is this plugin as NRI
// names it (index as configured, "-tessera") and the same plugin set the container's realisation
// nonce to the value on the host. A foreign plugin named "evil-tessera", or "tessera" under another
// index, or one that copies the exact name but cannot know the nonce, is refused.
func TestSecurityValidatorForeignPluginName(t *testing.T) {
	e := newEnv(t)
	pod := e.pod("foreign", nil, nil)
	const key, gpus = "cdi.k8s.io/x", "tessera.dev/gpu=all"
	self := e.plugin.cfg.PluginIndex + "-" + pluginName
	// request builds the validation request: the CDI annotation set by owner; the realisation
	// annotation set by realisedBy, with the host's nonce (real) or a made-up one.
	request := func(id, owner, realisedBy string, real bool) *nriapi.ValidateContainerAdjustmentRequest {
		adj := &nriapi.ContainerAdjustment{}
		adj.AddEnv(VisibleDevicesEnv, "void")
		if err := e.plugin.markRealised(id, adj); err != nil {
			t.Fatal(err)
		}
		if !real {
			adj.AddAnnotation(api.AnnotationRealised, "00112233445566778899aabbccddeeff")
		}
		adj.AddAnnotation(key, gpus)
		owners := nriapi.NewOwningPlugins()
		for k, by := range map[string]string{key: owner, api.AnnotationRealised: realisedBy} {
			if err := owners.ClaimAnnotation(id, k, by); err != nil {
				t.Fatal(err)
			}
		}
		return &nriapi.ValidateContainerAdjustmentRequest{Pod: pod, Container: ctr(id), Adjust: adj, Owners: owners}
	}
	if err := e.plugin.ValidateContainerAdjustment(context.Background(), request("c-self", self, self, true)); err != nil {
		t.Fatalf("Tessera's own annotation (owner %s, the host's nonce) refused: %v", self, err)
	}
	unnamed := request("c-unnamed", self, self, true)
	unnamed.Owners = nil
	for name, r := range map[string]*nriapi.ValidateContainerAdjustmentRequest{
		"no owners recorded":                              unnamed,
		"a plugin named evil-tessera":                     request("c-evil", "10-evil-tessera", self, true),
		"a plugin named tessera under another index":      request("c-idx", "10-tessera", "10-tessera", true),
		"a plugin with the exact name but a forged nonce": request("c-forged", self, self, false),
		"the exact name, the nonce set by another plugin": request("c-split", self, "10-tessera", true),
		"a plugin named plain tessera, no index":          request("c-plain", pluginName, pluginName, true),
	} {
		err := e.plugin.ValidateContainerAdjustment(context.Background(), r)
		if err == nil || !strings.Contains(err.Error(), key+"="+gpus) {
			t.Errorf("%s: GPU CDI annotation admitted (%v): a later runtime would inject %s", name, err, gpus)
		}
	}
}

// stopPod stops the containers, then their pod's sandbox, as the runtime reports a pod going.
func (e *env) stopPod(t *testing.T, sb *nriapi.PodSandbox, ids ...string) {
	t.Helper()
	for _, id := range ids {
		if _, err := e.rt.StopContainer(context.Background(), &nriadapt.StopContainerRequest{Pod: sb, Container: ctr(id)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.rt.StopPodSandbox(context.Background(), &nriadapt.StopPodSandboxRequest{Pod: sb}); err != nil {
		t.Fatal(err)
	}
}

// TestSecuritySandboxRecreationKeepsGPU: a pod's sandbox is stopped and removed also when the kubelet
// recreates it (the sandbox died, the node rebooted); the kubelet keeps the pod's grant, and the
// recreated container (same pod UID, same grant, a new sandbox) gets its GPUs back: the holds stay
// while the API server shows the pod may run again or cannot say (unreachable), and another pod
// cannot take them meanwhile. They go once the pod is finished (terminal phase: at the sandbox's
// stop, or at the next kubelet list if the phase came later) or gone.
func TestSecuritySandboxRecreationKeepsGPU(t *testing.T) {
	e := newEnv(t)
	pod := e.pod("crash", map[string]string{api.ResourceGPU: "6"}, nil)
	e.pods.set("ns", "crash", func(p *corev1.Pod) *corev1.Pod { p.Status.Phase = corev1.PodRunning; return p })
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "crash", Container: "main"}, api.ResourceGPU, "gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5")
	if _, err := e.create(pod, ctr("c-crash-1")); err != nil {
		t.Fatal(err)
	}
	first, _ := e.agent.Ledger().Get("c-crash-1")
	stopSandbox := func(sb *nriapi.PodSandbox) {
		t.Helper()
		e.stopPod(t, sb, first.ContainerID)
		if err := e.rt.RemovePodSandbox(context.Background(), &nriadapt.RemovePodSandboxRequest{Pod: sb}); err != nil {
			t.Fatal(err)
		}
	}
	stopSandbox(pod)
	if _, ok := e.agent.Ledger().Get(holdID("uid-crash", "main")); !ok {
		t.Fatal("the sandbox of a running pod went and its GPUs were released")
	}
	other := e.pod("thief", map[string]string{api.ResourceGPU: "1"}, nil)
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "thief", Container: "main"}, api.ResourceGPU, "gpu-6")
	if _, err := e.create(other, ctr("c-thief")); err == nil {
		t.Error("another pod took a GPU while the kubelet recreated the sandbox of its pod")
	}
	recreated := &nriapi.PodSandbox{Id: "sb-crash-2", Name: "crash", Namespace: "ns", Uid: "uid-crash"}
	if _, err := e.create(recreated, ctr("c-crash-2")); err != nil {
		t.Fatalf("container of the recreated sandbox refused: %v", err)
	}
	again, _ := e.agent.Ledger().Get("c-crash-2")
	if len(again.Devices) != 6 || again.Devices[0].UUID != first.Devices[0].UUID || again.SandboxID != "sb-crash-2" {
		t.Errorf("recreated sandbox's container got %+v, the first had %+v", again, first)
	}
	first = again
	// The API server cannot answer: the holds stay.
	e.pods.setDown(errors.New("connection refused"))
	stopSandbox(recreated)
	e.plugin.ReleaseUnlisted(context.Background(), nil)
	e.plugin.ReleaseUnlisted(context.Background(), nil)
	if _, ok := e.agent.Ledger().Get(holdID("uid-crash", "main")); !ok {
		t.Fatal("holds released while the API server could not say whether the pod is gone")
	}
	// The pod succeeded (its phase written after the sandbox stopped): the next list frees it,
	// though the kubelet still lists it.
	e.pods.setDown(nil)
	e.pods.set("ns", "crash", func(p *corev1.Pod) *corev1.Pod { p.Status.Phase = corev1.PodSucceeded; return p })
	e.plugin.ReleaseUnlisted(context.Background(), map[podresources.Key]podresources.Grant{{Namespace: "ns", Pod: "crash", Container: "main"}: nil})
	if n := len(e.agent.Ledger().Entries()); n != 0 {
		t.Errorf("the pod succeeded but the ledger holds %+v", e.agent.Ledger().Entries())
	}
	// A finished pod's sandbox stop frees at once.
	third := &nriapi.PodSandbox{Id: "sb-crash-3", Name: "crash", Namespace: "ns", Uid: "uid-crash"}
	e.pods.set("ns", "crash", func(p *corev1.Pod) *corev1.Pod { p.Status.Phase = corev1.PodRunning; return p })
	if _, err := e.create(third, ctr("c-crash-3")); err != nil {
		t.Fatal(err)
	}
	e.pods.set("ns", "crash", func(p *corev1.Pod) *corev1.Pod { p.DeletionTimestamp = &metav1.Time{}; return p })
	e.stopPod(t, third, "c-crash-3")
	if n := len(e.agent.Ledger().Entries()); n != 0 {
		t.Errorf("the pod is being deleted and its sandbox stopped, but the ledger holds %+v", e.agent.Ledger().Entries())
	}
}

// TestSecurityInitContainerGPUs: the kubelet passes an init container's devices on to the pod's
// later containers. A MIG instance granted to the init container and then to the main container is
// the main container's once the init container stopped (it was refused as held by the init
// container's hold), stays the pod's against another pod, and goes back to the init container when
// a recreated sandbox runs it again. A whole GPU in an init container, which no assignment can name,
// is refused with the reason (as the extender's Filter refuses the pod: api.ParsePodRequest).
func TestSecurityInitContainerGPUs(t *testing.T) {
	t.Run("MIG passed on", func(t *testing.T) {
		e := newEnv(t)
		res := "nvidia.com/mig-1g.5gb"
		mig := e.agent.Inventory().GPUs[7].MIG.Instances[2].UUID
		pod := e.pod("staged", map[string]string{res: "1"}, nil)
		e.pods.set("ns", "staged", func(p *corev1.Pod) *corev1.Pod {
			p.Spec.InitContainers = []corev1.Container{{Name: "init", Resources: p.Spec.Containers[0].Resources}}
			return p
		})
		for _, c := range []string{"init", "main"} {
			e.grants.Add(podresources.Key{Namespace: "ns", Pod: "staged", Container: c}, res, mig)
		}
		named := func(id, name string) *nriapi.Container { c := ctr(id); c.Name = name; return c }
		run := func(sb *nriapi.PodSandbox, id, name string) {
			t.Helper()
			if _, err := e.create(sb, named(id, name)); err != nil {
				t.Fatalf("container %s refused: %v", name, err)
			}
			if got, _ := e.agent.Ledger().Get(id); len(got.MIG) != 1 || got.MIG[0] != mig {
				t.Fatalf("container %s holds %+v, want MIG %s", name, got.MIG, mig)
			}
			if _, err := e.rt.StopContainer(context.Background(), &nriadapt.StopContainerRequest{Pod: sb, Container: named(id, name)}); err != nil {
				t.Fatal(err)
			}
		}
		run(pod, "c-init", "init")
		if _, err := e.create(pod, named("c-main", "main")); err != nil {
			t.Fatalf("main container refused the MIG instance its init container passed on: %v", err)
		}
		if got, _ := e.agent.Ledger().Get("c-main"); len(got.MIG) != 1 || got.MIG[0] != mig {
			t.Fatalf("main container holds %+v", got.MIG)
		}
		if _, ok := e.agent.Ledger().Get(holdID("uid-staged", "init")); ok {
			t.Error("the init container's hold still names the instance the main container took")
		}
		thief := e.pod("thief", map[string]string{res: "1"}, nil)
		e.grants.Add(podresources.Key{Namespace: "ns", Pod: "thief", Container: "main"}, res, mig)
		if _, err := e.create(thief, ctr("c-thief")); err == nil || !strings.Contains(err.Error(), "already held by container c-main") {
			t.Errorf("another pod's container given the pod's MIG instance: %v", err)
		}
		if _, err := e.rt.StopContainer(context.Background(), &nriadapt.StopContainerRequest{Pod: pod, Container: named("c-main", "main")}); err != nil {
			t.Fatal(err)
		}
		if _, err := e.create(thief, ctr("c-thief-2")); err == nil {
			t.Error("another pod took the MIG instance held for the stopped main container")
		}
		// A recreated sandbox runs the init container again, then the main container.
		again := &nriapi.PodSandbox{Id: "sb-staged-2", Name: "staged", Namespace: "ns", Uid: "uid-staged"}
		run(again, "c-init-2", "init")
		run(again, "c-main-2", "main")
	})
	t.Run("whole GPU refused", func(t *testing.T) {
		e := newEnv(t)
		pod := e.pod("initgpu", nil, nil)
		e.pods.set("ns", "initgpu", func(p *corev1.Pod) *corev1.Pod {
			p.Spec.InitContainers = []corev1.Container{{Name: "init", Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{api.ResourceGPU: resource.MustParse("1")}}}}
			return p
		})
		e.grants.Add(podresources.Key{Namespace: "ns", Pod: "initgpu", Container: "init"}, api.ResourceGPU, "gpu-0")
		c := ctr("c-init")
		c.Name = "init"
		_, err := e.create(pod, c)
		if err == nil || !strings.Contains(err.Error(), `init container "init": nvidia.com/gpu is not supported in init containers`) {
			t.Errorf("init container with a whole GPU: %v", err)
		}
		if n := len(e.agent.Ledger().Entries()); n != 0 {
			t.Errorf("refused init container left %+v", e.agent.Ledger().Entries())
		}
	})
}

// TestSecurityStaticPodPrivileged: a static pod's sandbox carries the kubelet's UID for it (its
// config hash); the API server has its mirror pod, of another UID, naming that hash in
// kubernetes.io/config.mirror. A privileged container of a static pod (kube-proxy, a CNI agent) is
// resolved through its mirror pod and runs; the annotation counts only on a mirror pod of this node,
// and a pod of the same name with another UID and no such annotation is not the sandbox's pod. The
// pods are read through APIPods over client-go's fake clientset, so the rule under test is the
// production one.
func TestSecurityStaticPodPrivileged(t *testing.T) {
	yes := true
	mirror := func(name, hash, node string) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "kube-system", UID: types.UID("mirror-" + name)},
			Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "main", SecurityContext: &corev1.SecurityContext{Privileged: &yes}}}}}
		if hash != "" {
			p.Annotations = map[string]string{corev1.MirrorPodAnnotationKey: hash}
		}
		return p
	}
	client := fake.NewClientset(
		mirror("kube-proxy-node-a", "static-hash-1", "node-a"),
		mirror("elsewhere", "static-hash-2", "node-b"),
		mirror("plain", "", "node-a"),
	)
	e, l := newAgentEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	e.apiPods = NewAPIPods(ctx, client, "node-a")
	e.start(e.podResources(t), l)
	for _, tc := range []struct {
		name, uid string
		admit     bool
	}{
		{"kube-proxy-node-a", "static-hash-1", true},
		{"elsewhere", "static-hash-2", false}, // the mirror pod of another node
		{"plain", "static-hash-3", false},     // another UID, no mirror annotation
		{"kube-proxy-node-a", "static-hash-9", false},
	} {
		sb := &nriapi.PodSandbox{Id: "sb-" + tc.uid, Name: tc.name, Namespace: "kube-system", Uid: tc.uid}
		_, err := e.create(sb, e.ctr("c-"+tc.uid, "/dev/nvidia0", "/dev/nvidiactl"))
		if tc.admit && err != nil {
			t.Errorf("privileged container of static pod %s (sandbox UID %s) refused: %v", tc.name, tc.uid, err)
		}
		if !tc.admit && (err == nil || !strings.Contains(err.Error(), "is no longer in the API server")) {
			t.Errorf("container of sandbox %s/%s with GPU devices: %v, want a refusal (its pod is not in the API server)", tc.name, tc.uid, err)
		}
	}
	if priv, _, _ := e.plugin.SecurityStats(); priv != 1 {
		t.Errorf("privileged containers counted %d, want 1", priv)
	}
}

// TestSecurityUnreadableSpecRetryable: when the pod's spec cannot be read (the API server is down,
// the cache cold), a container whose admission depends on it (a privileged one with every GPU, a
// share container whose grant is checked against its requests) is refused with an error that says
// the refusal is not final and what to check, and the kubelet's retry is admitted once the API server
// answers. A pod the API server no longer has is refused without that promise.
func TestSecurityUnreadableSpecRetryable(t *testing.T) {
	e := newEnv(t)
	yes := true
	priv := e.pod("priv", nil, nil)
	e.pods.set("ns", "priv", func(p *corev1.Pod) *corev1.Pod {
		p.Spec.Containers[0].SecurityContext = &corev1.SecurityContext{Privileged: &yes}
		return p
	})
	share := e.pod("share", shareReq, nil)
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "share", Container: "main"}, api.ResourceShare, "vgpu-0")
	e.pods.setDown(errors.New("dial tcp 10.96.0.1:443: connect: connection refused"))
	for _, try := range []struct {
		pod *nriapi.PodSandbox
		c   *nriapi.Container
	}{{priv, e.ctr("c-priv-1", "/dev/nvidia0")}, {share, ctr("c-share-1")}} {
		_, err := e.create(try.pod, try.c)
		if err == nil || !strings.Contains(err.Error(), "cannot read the pod's spec from the API server") || !strings.Contains(err.Error(), "connection refused") ||
			!strings.Contains(err.Error(), "not a final refusal: the kubelet retries creating the container") || !strings.Contains(err.Error(), "check the API server and tessera-node's access") {
			t.Errorf("%s with the API server down: %v", try.pod.GetName(), err)
		}
	}
	if n := len(e.agent.Ledger().Entries()); n != 0 {
		t.Errorf("refused containers left %+v", e.agent.Ledger().Entries())
	}
	e.pods.setDown(nil)
	if _, err := e.create(priv, e.ctr("c-priv-2", "/dev/nvidia0")); err != nil {
		t.Errorf("privileged container retried with the API server back: %v", err)
	}
	if _, err := e.create(share, ctr("c-share-2")); err != nil {
		t.Errorf("share container retried with the API server back: %v", err)
	}
	e.pods.set("ns", "priv", func(*corev1.Pod) *corev1.Pod { return nil })
	if _, err := e.create(priv, e.ctr("c-priv-3", "/dev/nvidia0")); err == nil || strings.Contains(err.Error(), "not a final refusal") || !strings.Contains(err.Error(), "no longer in the API server") {
		t.Errorf("container of a deleted pod: %v", err)
	}
}

// TestSecurityFailurePolicyKeepsValidator: a CreateContainer the plugin does not answer within the
// runtime's request timeout (here the API server stalls) fails as such, instead of proceeding
// without the plugin, and the plugin stays registered: the next container with GPU devices nobody
// granted is still refused, by the same connection (no new registration). Without KeepConnected the
// runtime drops the plugin, and with it the validator, until it reconnects.
func TestSecurityFailurePolicyKeepsValidator(t *testing.T) {
	nriadapt.SetPluginRequestTimeout(300 * time.Millisecond)
	t.Cleanup(func() { nriadapt.SetPluginRequestTimeout(nriadapt.DefaultPluginRequestTimeout) })
	e := newEnv(t)
	registered := e.syncs.Load()
	slow := e.pod("slow", shareReq, nil)
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "slow", Container: "main"}, api.ResourceShare, "vgpu-0")
	stall := make(chan struct{})
	e.pods.mu.Lock()
	e.pods.stall = stall
	e.pods.mu.Unlock()
	// Without the policy the request would go on without the plugin, and only the validator's
	// NVIDIA_VISIBLE_DEVICES rule would stop it, under a misleading reason.
	if _, err := e.create(slow, ctr("c-slow")); err == nil || !strings.Contains(err.Error(), "failed to handle CreateContainer request: context deadline exceeded") {
		t.Errorf("a CreateContainer the plugin did not answer in time: %v, want it failed for that", err)
	}
	e.pods.mu.Lock()
	e.pods.stall = nil
	e.pods.mu.Unlock()
	close(stall)
	if _, err := e.create(e.pod("rogue", nil, nil), e.ctr("c-rogue", "/dev/nvidia0")); err == nil || !strings.Contains(err.Error(), "did not grant") {
		t.Errorf("after a timeout, a container with an ungranted GPU: %v (the plugin was dropped?)", err)
	}
	if n := e.syncs.Load(); n != registered {
		t.Errorf("the plugin was synchronized %d times, %d before the timeout: the timeout dropped it", n, registered)
	}
}

// TestSecurityRebootKeepsGPU: after a reboot (or a runtime restart that lost its containers) the
// runtime reports neither the container nor its sandbox; the container's devices become its pod's
// hold at Synchronize, for the container the kubelet recreates with the same grant, instead of being
// freed for any pod (ReleaseUnlisted frees holds of pods that are gone: TestSecurityHoldReleasedWhenUnlisted).
func TestSecurityRebootKeepsGPU(t *testing.T) {
	e, l := newAgentEnv(t)
	gpu := e.agent.Inventory().GPUs[0].UUID
	if err := l.Reserve(ledger.Entry{ContainerID: "c-before", PodUID: "uid-train", Namespace: "ns", Pod: "train", Container: "main", SandboxID: "sb-before",
		Devices: []api.DeviceAssignment{{UUID: gpu, Whole: true}}, Local: true}, e.agent.Inventory()); err != nil {
		t.Fatal(err)
	}
	e.pod("train", map[string]string{api.ResourceGPU: "1"}, nil)
	e.start(e.podResources(t), l)
	if h, ok := l.Get(holdID("uid-train", "main")); !ok || len(h.Devices) != 1 || h.Devices[0].UUID != gpu {
		t.Fatalf("after a reboot the container's GPU is not held for its pod: %+v", l.Entries())
	}
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "train", Container: "main"}, api.ResourceGPU, "gpu-0")
	if _, err := e.create(&nriapi.PodSandbox{Id: "sb-after", Name: "train", Namespace: "ns", Uid: "uid-train"}, ctr("c-after")); err != nil {
		t.Fatalf("recreated container refused: %v", err)
	}
	if got, _ := l.Get("c-after"); len(got.Devices) != 1 || got.Devices[0].UUID != gpu {
		t.Errorf("recreated container got %+v, before the reboot %s", got.Devices, gpu)
	}
}

// TestSecurityNoAPIServerHoldsGoBySandbox: a node agent started without API server credentials
// cannot ask whether a pod may run again; the runtime's and the kubelet's word decide, as before
// holds waited for the API server: its holds go with the pod's sandbox.
func TestSecurityNoAPIServerHoldsGoBySandbox(t *testing.T) {
	e := newEnv(t)
	pod := e.pod("mig", nil, nil)
	mig := e.agent.Inventory().GPUs[7].MIG.Instances[2].UUID
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "mig", Container: "main"}, "nvidia.com/mig-1g.5gb", mig)
	e.pods.setDown(fmt.Errorf("%w (no kubeconfig)", ErrNoAPIServer))
	if _, err := e.create(pod, ctr("c-mig")); err != nil {
		t.Fatal(err)
	}
	e.stopPod(t, pod, "c-mig")
	if n := len(e.agent.Ledger().Entries()); n != 0 {
		t.Errorf("without an API server the stopped sandbox's holds stay: %+v", e.agent.Ledger().Entries())
	}
}

// TestSecurityValidatorForeignCDIDevices: NRI hands the CDI devices plugins add to the runtime
// unresolved and shows them to no later plugin's CreateContainer, so the NVIDIA Container Toolkit's
// NRI plugin (index 10 by default, ahead of Tessera's 50; the GPU Operator's cdi.nriPluginEnabled)
// could give any pod annotated nvidia.cdi.k8s.io/container.<name> every GPU. The validator, which
// sees every plugin's adjustment, refuses GPU CDI devices another plugin added; Tessera's own (its
// name and the host's nonce), other vendors' devices and admin namespaces pass.
func TestSecurityValidatorForeignCDIDevices(t *testing.T) {
	e := newEnv(t)
	pod := e.pod("toolkit", nil, nil)
	self := e.plugin.cfg.PluginIndex + "-" + pluginName
	const toolkit = "10-nvidia-ctk-installer"
	request := func(id, device, owner string) *nriapi.ValidateContainerAdjustmentRequest {
		adj := &nriapi.ContainerAdjustment{}
		adj.AddEnv(VisibleDevicesEnv, "void")
		if err := e.plugin.markRealised(id, adj); err != nil {
			t.Fatal(err)
		}
		adj.AddCDIDevice(&nriapi.CDIDevice{Name: device})
		owners := nriapi.NewOwningPlugins()
		if err := owners.ClaimCdiDevice(id, device, owner); err != nil {
			t.Fatal(err)
		}
		if err := owners.ClaimAnnotation(id, api.AnnotationRealised, self); err != nil {
			t.Fatal(err)
		}
		return &nriapi.ValidateContainerAdjustmentRequest{Pod: pod, Container: ctr(id), Adjust: adj, Owners: owners}
	}
	for name, r := range map[string]*nriapi.ValidateContainerAdjustmentRequest{
		"Tessera's own device":   request("c-own", "tessera.dev/gpu="+e.agent.Inventory().GPUs[0].UUID, self),
		"another vendor's (NIC)": request("c-nic", "example.com/nic=eth1", toolkit),
	} {
		if err := e.plugin.ValidateContainerAdjustment(context.Background(), r); err != nil {
			t.Errorf("%s refused: %v", name, err)
		}
	}
	for name, r := range map[string]*nriapi.ValidateContainerAdjustmentRequest{
		"all GPUs from the toolkit's plugin":       request("c-all", "nvidia.com/gpu=all", toolkit),
		"management devices from the toolkit":      request("c-mgmt", "management.nvidia.com/gpu=all", toolkit),
		"Tessera's device added by another plugin": request("c-copy", "tessera.dev/gpu=all", toolkit),
		"Tessera's name under another index":       request("c-idx", "nvidia.com/gpu=0", "10-"+pluginName),
	} {
		err := e.plugin.ValidateContainerAdjustment(context.Background(), r)
		if err == nil || !strings.Contains(err.Error(), "GPU CDI devices") || !strings.Contains(err.Error(), "cdi.nriPluginEnabled") {
			t.Errorf("%s: %v, want the foreign GPU CDI device refused", name, err)
		}
	}
	unnamed := request("c-unnamed", "nvidia.com/gpu=all", toolkit)
	unnamed.Owners = nil
	if err := e.plugin.ValidateContainerAdjustment(context.Background(), unnamed); err == nil {
		t.Error("a GPU CDI device with no owner recorded was admitted")
	}
	// A privileged container (as the API server's spec says) holds every GPU anyway: the operator's
	// own pods, which its toolkit's plugin gives the management devices.
	priv := e.pod("operand", nil, nil)
	yes := true
	e.pods.pods["ns/operand"].Spec.Containers[0].SecurityContext = &corev1.SecurityContext{Privileged: &yes}
	r := request("c-priv", "management.nvidia.com/gpu=all", toolkit)
	r.Pod, r.Container = priv, e.ctr("c-priv", "/dev/nvidia0", "/dev/nvidiactl")
	if err := e.plugin.ValidateContainerAdjustment(context.Background(), r); err != nil {
		t.Errorf("privileged operator container refused: %v", err)
	}
	r = request("c-unpriv", "management.nvidia.com/gpu=all", toolkit)
	r.Container = e.ctr("c-unpriv", "/dev/nvidia0")
	if err := e.plugin.ValidateContainerAdjustment(context.Background(), r); err == nil {
		t.Error("an unprivileged container with a GPU device and the toolkit's CDI devices was admitted")
	}
	// The operator's own pods (its namespace listed as an admin namespace) get management devices.
	e.plugin.cfg.AdminNamespaces = []string{pod.GetNamespace()}
	if err := e.plugin.ValidateContainerAdjustment(context.Background(), request("c-op", "management.nvidia.com/gpu=all", toolkit)); err != nil {
		t.Errorf("admin namespace refused: %v", err)
	}
}
