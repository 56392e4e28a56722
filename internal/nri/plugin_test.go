package nri

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	nriadapt "github.com/containerd/nri/pkg/adaptation"
	nriapi "github.com/containerd/nri/pkg/api"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/agent"
	"github.com/tessera-gpu/tessera/internal/ledger"
	"github.com/tessera-gpu/tessera/internal/podresources"
	"github.com/tessera-gpu/tessera/internal/podresources/podresourcestest"
	"github.com/tessera-gpu/tessera/internal/testing/simagent"
)

// fakePods is the API server's pod store for the plugin: a missing pod is ErrPodGone, a pod of
// another UID ErrPodReplaced, as with APIPods (which the static-pod test uses for the mirror rule); down makes every read fail as
// an unreachable API server does (no answer, so not ErrPodGone).
type fakePods struct {
	mu   sync.Mutex
	pods map[string]*corev1.Pod
	down error
	// stall, when set, holds every read until it is closed (a slow API server).
	stall chan struct{}
}

func (f *fakePods) Pod(_ context.Context, ns, name, uid string) (*corev1.Pod, error) {
	f.mu.Lock()
	stall := f.stall
	f.mu.Unlock()
	if stall != nil {
		<-stall
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.down != nil {
		return nil, fmt.Errorf("get pod %s/%s: %w", ns, name, f.down)
	}
	p, ok := f.pods[ns+"/"+name]
	if !ok {
		return nil, fmt.Errorf("pods %q not found: %w", name, ErrPodGone)
	}
	if string(p.UID) != uid {
		return nil, fmt.Errorf("pods %q has UID %s, not %s: %w", name, p.UID, uid, ErrPodReplaced)
	}
	return p, nil
}

// setDown makes the API server unreachable (err) or reachable again (nil).
func (f *fakePods) setDown(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.down = err
}

// set changes the API server's copy of a pod (nil deletes it).
func (f *fakePods) set(ns, name string, change func(*corev1.Pod) *corev1.Pod) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if p := change(f.pods[ns+"/"+name].DeepCopy()); p != nil {
		f.pods[ns+"/"+name] = p
	} else {
		delete(f.pods, ns+"/"+name)
	}
}

// env is the plugin connected to NRI's runtime-side adaptation over a real socket, with a real
// simulated-node agent and ledger, and the kubelet's PodResources API served by podresourcestest.Server.
type env struct {
	t         testing.TB
	rt        *nriadapt.Adaptation
	agent     *agent.Agent
	grants    *podresourcestest.Server
	pods      *fakePods
	apiPods   Pods // when set, the plugin reads pods here instead of pods (APIPods over a fake clientset)
	plugin    *Plugin
	dir       string
	running   []*nriapi.Container // what the runtime reports at Synchronize
	syncs     atomic.Int32        // how many times a plugin registered and was synchronized
	sandboxes []*nriapi.PodSandbox
	events    *fakeEvents

	mu       sync.Mutex
	outcomes map[string]error // container name -> what OnCreate was told
}

// fakeEvents is a record.EventRecorder that keeps each Event as "TYPE APIVERSION/KIND
// NAMESPACE/NAME(UID) REASON: MESSAGE".
type fakeEvents struct {
	mu     sync.Mutex
	events []string
}

func (f *fakeEvents) Event(object runtime.Object, eventtype, reason, message string) {
	ref, ok := object.(*corev1.ObjectReference)
	if !ok {
		panic(fmt.Sprintf("event on a %T, want an *ObjectReference", object))
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.events = append(f.events, fmt.Sprintf("%s %s/%s %s/%s(%s) %s: %s", eventtype, ref.APIVersion, ref.Kind, ref.Namespace, ref.Name, ref.UID, reason, message))
}

func (f *fakeEvents) Eventf(object runtime.Object, eventtype, reason, messageFmt string, args ...any) {
	f.Event(object, eventtype, reason, fmt.Sprintf(messageFmt, args...))
}

func (f *fakeEvents) AnnotatedEventf(object runtime.Object, _ map[string]string, eventtype, reason, messageFmt string, args ...any) {
	f.Eventf(object, eventtype, reason, messageFmt, args...)
}

// outcome returns what OnCreate was told about the container, and whether it was called.
func (e *env) outcome(container string) (error, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	err, ok := e.outcomes[container]
	return err, ok
}

// newAgentEnv builds an env's node side, not yet started: a temp dir, the simulated node, a ledger
// and an agent that has discovered the GPUs.
func newAgentEnv(t testing.TB) (*env, *ledger.Ledger) {
	t.Helper()
	dir, err := os.MkdirTemp("/tmp", "tsr-nri-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	e := &env{t: t, dir: dir, grants: podresourcestest.NewServer(), pods: &fakePods{pods: map[string]*corev1.Pod{}}}
	e.agent, _ = simagent.New(t, dir, agent.Config{})
	return e, e.agent.Ledger()
}

func newEnv(t testing.TB, preexisting ...*nriapi.Container) *env {
	t.Helper()
	e, l := newAgentEnv(t)
	e.running = preexisting
	return e.start(e.podResources(t), l)
}

// podResources serves the env's kubelet PodResources API and returns a client of it.
func (e *env) podResources(t testing.TB) *podresources.Client {
	t.Helper()
	srv, err := e.grants.Serve(filepath.Join(e.dir, "podres.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	client := podresources.New(filepath.Join(e.dir, "podres.sock"))
	t.Cleanup(func() { client.Close() })
	return client
}

func (e *env) start(client *podresources.Client, l *ledger.Ledger) *env {
	t := e.t
	sock := filepath.Join(e.dir, "nri.sock")
	rt, err := nriadapt.New("containerd", "2.2.9",
		func(ctx context.Context, cb nriadapt.SyncCB) error {
			e.syncs.Add(1)
			_, err := cb(ctx, e.sandboxes, e.running)
			return err
		},
		func(context.Context, []*nriadapt.ContainerUpdate) ([]*nriadapt.ContainerUpdate, error) {
			return nil, nil
		},
		nriadapt.WithSocketPath(sock), nriadapt.WithPluginPath(filepath.Join(e.dir, "plugins")), nriadapt.WithPluginConfigPath(filepath.Join(e.dir, "conf")))
	if err != nil {
		t.Fatal(err)
	}
	if err := rt.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rt.Stop)
	e.rt = rt
	e.events = &fakeEvents{}
	e.outcomes = map[string]error{}
	onCreate := func(pod *nriapi.PodSandbox, c *nriapi.Container, _ time.Duration, refusal error) {
		e.mu.Lock()
		defer e.mu.Unlock()
		e.outcomes[pod.GetName()+"/"+c.GetName()+"/"+c.GetId()] = refusal
	}
	var pods Pods = e.pods
	if e.apiPods != nil {
		pods = e.apiPods
	}
	e.plugin = New(Config{StateDir: filepath.Join(e.dir, "state"), VCUDALibrary: "/opt/libvcuda.so", Events: e.events, OnCreate: onCreate}, e.agent, client, pods)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go e.plugin.Run(ctx, sock)
	deadline := time.Now().Add(20 * time.Second)
	for !e.plugin.Synced() {
		if time.Now().After(deadline) {
			t.Fatal("plugin did not connect and synchronize")
		}
		time.Sleep(10 * time.Millisecond)
	}
	return e
}

// pod registers an API pod with one container "main" and returns its sandbox.
func (e *env) pod(name string, limits map[string]string, annotations map[string]string) *nriapi.PodSandbox {
	l := corev1.ResourceList{}
	for k, v := range limits {
		l[corev1.ResourceName(k)] = resource.MustParse(v)
	}
	uid := "uid-" + name
	e.pods.mu.Lock()
	e.pods.pods["ns/"+name] = &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", UID: types.UID(uid)},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "main", Resources: corev1.ResourceRequirements{Limits: l}}}}}
	e.pods.mu.Unlock()
	return &nriapi.PodSandbox{Id: "sb-" + name, Name: name, Namespace: "ns", Uid: uid, Annotations: annotations}
}

// create passes the container to the runtime side as the kubelet would have made it: with the CDI
// names the device plugins answered for its grant.
func (e *env) create(pod *nriapi.PodSandbox, c *nriapi.Container) (*nriapi.ContainerAdjustment, error) {
	list, err := e.grants.List(context.Background(), nil)
	if err != nil {
		return nil, err
	}
	for _, pr := range list.GetPodResources() {
		for _, cr := range pr.GetContainers() {
			if pr.GetNamespace() != pod.GetNamespace() || pr.GetName() != pod.GetName() || cr.GetName() != c.GetName() {
				continue
			}
			for _, d := range cr.GetDevices() {
				resp, err := e.agent.Allocate(d.GetResourceName(), d.GetDeviceIds())
				if err != nil {
					return nil, err
				}
				for _, n := range resp.CdiDevices {
					c.CDIDevices = append(c.CDIDevices, &nriapi.CDIDevice{Name: n.Name})
				}
			}
		}
	}
	resp, err := e.rt.CreateContainer(context.Background(), &nriadapt.CreateContainerRequest{Pod: pod, Container: c})
	if err != nil {
		return nil, err
	}
	return resp.Adjust, nil
}

func ctr(id string) *nriapi.Container {
	return &nriapi.Container{Id: id, PodSandboxId: "sb", Name: "main", State: nriapi.ContainerState_CONTAINER_CREATED, Linux: &nriapi.LinuxContainer{}}
}

// ctr is a container with device nodes as the runtime lists them: the path inside the container
// and the number of the simulated node's device behind it (host is its /dev-relative name, or the
// same as the path).
func (e *env) ctr(id string, devices ...string) *nriapi.Container {
	c := ctr(id)
	for _, d := range devices {
		path, host, _ := strings.Cut(d, "=")
		if host == "" {
			host = path
		}
		num, _ := statDevice(filepath.Join(e.agent.Node().DevRoot, "dev", strings.TrimPrefix(host, "/dev/")))
		c.Linux.Devices = append(c.Linux.Devices, &nriapi.LinuxDevice{Path: path, Type: "c", Major: num.major, Minor: num.minor})
	}
	return c
}

func assignment(devs ...api.DeviceAssignment) map[string]string {
	data, _ := json.Marshal(&api.PodAssignment{APIVersion: api.Version, Node: "node-a", Containers: []api.ContainerAssignment{{Name: "main", Devices: devs}}})
	return map[string]string{api.AnnotationAssignment: string(data)}
}

func cdiNames(a *nriapi.ContainerAdjustment) []string {
	var out []string
	for _, d := range a.GetCDIDevices() {
		out = append(out, d.Name)
	}
	return out
}

func mountDests(a *nriapi.ContainerAdjustment) []string {
	var out []string
	for _, m := range a.GetMounts() {
		out = append(out, m.Destination)
	}
	slices.Sort(out)
	return out
}

func TestCreateContainer(t *testing.T) {
	e := newEnv(t)
	inv := e.agent.Inventory()
	g0, g1, g2 := inv.GPUs[0].UUID, inv.GPUs[1].UUID, inv.GPUs[2].UUID
	shareLimits := map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "10Gi", api.ResourceShareCores: "30"}

	// A share: the GPU by CDI name, the vcuda mounts, a limits file with the cap, a ledger entry.
	pod := e.pod("share", shareLimits, assignment(api.DeviceAssignment{UUID: g0, MemoryBytes: 10 << 30, CoresPercent: 30}))
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "share", Container: "main"}, api.ResourceShare, "vgpu-0")
	adj, err := e.create(pod, ctr("c-share"))
	if err != nil {
		t.Fatal(err)
	}
	if got := cdiNames(adj); !slices.Equal(got, []string{"tessera.dev/gpu=" + g0}) {
		t.Errorf("CDI devices %v", got)
	}
	if got, want := mountDests(adj), []string{"/etc/ld.so.preload", api.NodeFilesDirInContainer, api.LimitsPathInContainer, api.ComputeMeasuredDirInContainer, api.RegionDirInContainer + "/region", api.VCUDALibraryInContainer}; !slices.Equal(got, want) {
		t.Errorf("mounts %v, want %v", got, want)
	}
	// The measured context overhead the guard publishes is the node's, read-only in every share.
	for _, m := range adj.GetMounts() {
		if m.Destination == api.NodeFilesDirInContainer && (m.Source != filepath.Join(e.dir, "state", "node") || !slices.Contains(m.Options, "ro")) {
			t.Errorf("node files mount %+v, want %s/state/node read-only", m, e.dir)
		}
	}
	// The driver's measured compute: the agent's directory beside the limits, read-only (the
	// container must not write the reference its limiter corrects itself by), where the guard
	// writes (MeasuredComputeFile).
	measured := filepath.Join(e.dir, "state", "containers", "c-share", api.ComputeMeasuredDir)
	if st, err := os.Stat(measured); err != nil || !st.IsDir() {
		t.Errorf("measured compute directory %s: %v %v", measured, st, err)
	}
	if f, err := e.plugin.MeasuredComputeFile("c-share"); err != nil || f != filepath.Join(measured, api.ComputeMeasuredFile) {
		t.Errorf("MeasuredComputeFile = %q (%v), want %s/%s", f, err, measured, api.ComputeMeasuredFile)
	}
	for _, m := range adj.GetMounts() {
		if m.Destination != api.ComputeMeasuredDirInContainer {
			continue
		}
		if m.Source != measured || m.Type != "bind" || slices.Contains(m.Options, "rw") {
			t.Errorf("measured compute mount %+v, want a bind of %s", m, measured)
		}
		for _, o := range []string{"bind", "ro", "nosuid", "nodev", "noexec"} {
			if !slices.Contains(m.Options, o) {
				t.Errorf("measured compute mount %+v lacks %s", m, o)
			}
		}
	}
	limits, err := os.ReadFile(filepath.Join(e.dir, "state", "containers", "c-share", "limits"))
	if err != nil || !strings.Contains(string(limits), "gpu "+g0+" 10737418240 30") {
		t.Errorf("limits file %q %v", limits, err)
	}
	if _, err := api.DecodeLimits(limits); err != nil {
		t.Errorf("limits file does not decode: %v", err)
	}
	if st, err := os.Stat(filepath.Join(e.dir, "state", "containers", "c-share", "vcuda", "region")); err != nil || st.Mode().Perm() != 0o666 {
		t.Errorf("region file not pre-created writable for any container user: %v %v", st, err)
	}
	if _, ok := e.agent.Ledger().Get("c-share"); !ok || adj.GetAnnotations()[api.AnnotationLedgerEntry] == "" {
		t.Errorf("no ledger entry / annotation")
	}

	// A whole GPU: the GPU, no vcuda.
	pod = e.pod("whole", map[string]string{api.ResourceGPU: "1"}, assignment(api.DeviceAssignment{UUID: g2, Whole: true}))
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "whole", Container: "main"}, api.ResourceGPU, "gpu-0")
	adj, err = e.create(pod, ctr("c-whole"))
	if err != nil {
		t.Fatal(err)
	}
	if got := cdiNames(adj); !slices.Equal(got, []string{"tessera.dev/gpu=" + g2}) || len(adj.GetMounts()) != 0 {
		t.Errorf("whole GPU: CDI %v mounts %v", got, mountDests(adj))
	}

	// No assignment: the agent places the share itself.
	pod = e.pod("local", map[string]string{api.ResourceShare: "2", api.ResourceShareMemoryPercent: "50"}, nil)
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "local", Container: "main"}, api.ResourceShare, "vgpu-1", "vgpu-2")
	adj, err = e.create(pod, ctr("c-local"))
	if err != nil {
		t.Fatal(err)
	}
	if entry, _ := e.agent.Ledger().Get("c-local"); !entry.Local || len(entry.Devices) != 2 || entry.Devices[0].MemoryBytes != inv.GPUs[0].MemoryBytes/2 {
		t.Errorf("local placement %+v", entry)
	}

	// Refusals name the problem.
	cases := []struct {
		name   string
		limits map[string]string
		ann    map[string]string
		grant  map[string][]string
		want   string
	}{
		{"memory above request", shareLimits, assignment(api.DeviceAssignment{UUID: g1, MemoryBytes: 20 << 30, CoresPercent: 30}), map[string][]string{api.ResourceShare: {"vgpu-9"}},
			"its assignment does not match its request: GPU " + g1 + ": memory cap 21474836480 bytes, the container requests 10737418240"},
		{"cores above request", shareLimits, assignment(api.DeviceAssignment{UUID: g1, MemoryBytes: 10 << 30, CoresPercent: 90}), map[string][]string{api.ResourceShare: {"vgpu-9"}},
			"compute cap 90%, the container requests 30%"},
		{"held whole", shareLimits, assignment(api.DeviceAssignment{UUID: g2, MemoryBytes: 10 << 30, CoresPercent: 30}), map[string][]string{api.ResourceShare: {"vgpu-9"}},
			"GPU " + g2 + " is already held whole"},
		{"tokens differ from request", shareLimits, assignment(api.DeviceAssignment{UUID: g1, MemoryBytes: 10 << 30, CoresPercent: 30}), map[string][]string{api.ResourceShare: {"vgpu-8", "vgpu-9"}},
			"the kubelet granted 0 whole GPUs and 2 shares, which is not what the pod requests"},
		{"other node", shareLimits, map[string]string{api.AnnotationAssignment: `{"apiVersion":"tessera.dev/v1","node":"node-b","containers":[{"name":"main","devices":[{"uuid":"` + g1 + `","memoryBytes":10737418240,"coresPercent":30}]}]}`},
			map[string][]string{api.ResourceShare: {"vgpu-9"}}, `its assignment is for node "node-b", this is "node-a"`},
		{"malformed annotation", shareLimits, map[string]string{api.AnnotationAssignment: `{"apiVersion":"tessera.dev/v1","node":"node-a","extra":1}`},
			map[string][]string{api.ResourceShare: {"vgpu-9"}}, "invalid GPU assignment: extra: Forbidden: unknown field"},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			name := fmt.Sprintf("bad-%d", i)
			pod := e.pod(name, tc.limits, tc.ann)
			for res, ids := range tc.grant {
				e.grants.Add(podresources.Key{Namespace: "ns", Pod: name, Container: "main"}, res, ids...)
			}
			_, err := e.create(pod, ctr("c-"+name))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want %q", err, tc.want)
			}
			if _, ok := e.agent.Ledger().Get("c-" + name); ok {
				t.Error("a refused container is in the ledger")
			}
		})
	}

	// No grant at all, a forged assignment and GPU nodes smuggled in (CDI annotation): refused.
	pod = e.pod("sneaky", nil, assignment(api.DeviceAssignment{UUID: g1, Whole: true}))
	_, err = e.create(pod, e.ctr("c-sneaky", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-caps/nvidia-cap12"))
	if err == nil || !strings.Contains(err.Error(), "GPU devices the kubelet did not grant it: /dev/nvidia1 (195:") || strings.Contains(err.Error(), "/dev/nvidiactl (") {
		t.Errorf("sneaky container: %v", err)
	}
	// OnCreate (the agent's histogram and the pod's Warning Event) hears of refusals and admissions.
	if refusal, called := e.outcome("sneaky/main/c-sneaky"); !called || refusal == nil || !strings.Contains(refusal.Error(), "did not grant") {
		t.Errorf("OnCreate for the refused container: called %v, refusal %v", called, refusal)
	}
	if refusal, called := e.outcome("whole/main/c-whole"); !called || refusal != nil {
		t.Errorf("OnCreate for the admitted container: called %v, refusal %v", called, refusal)
	}
	// Control nodes alone (a CPU container with nvidiactl) and no grant: nothing to do.
	pod = e.pod("plain", nil, nil)
	if adj, err = e.create(pod, e.ctr("c-plain", "/dev/nvidiactl")); err != nil || len(cdiNames(adj)) != 0 || len(adj.GetMounts()) != 0 {
		t.Errorf("plain container: %v %+v", err, adj)
	}

	// A Kata pod with an mdev vGPU: the container-level CDI annotation Kata's agent resolves.
	res := api.MdevResource("A100-4C")
	devs := e.agent.Devices(res)
	if len(devs) == 0 {
		t.Fatalf("no %s devices", res)
	}
	if _, err := e.agent.Allocate(res, []string{devs[0].ID}); err != nil {
		t.Fatal(err)
	}
	pod = e.pod("kata", map[string]string{res: "1"}, nil)
	pod.RuntimeHandler = "kata-qemu"
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "kata", Container: "main"}, res, devs[0].ID)
	adj, err = e.create(pod, e.ctr("c-kata", "/dev/vfio/200"))
	if err != nil {
		t.Fatal(err)
	}
	if got := adj.GetAnnotations()["cdi.k8s.io/tessera_c-kata"]; got != "tessera.dev/mdev="+devs[0].ID {
		t.Errorf("Kata CDI annotation %q (annotations %v)", got, adj.GetAnnotations())
	}
	// A Kata pod cannot take a share.
	pod = e.pod("kata-share", shareLimits, assignment(api.DeviceAssignment{UUID: g1, MemoryBytes: 10 << 30, CoresPercent: 30}))
	pod.RuntimeHandler = "kata"
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "kata-share", Container: "main"}, api.ResourceShare, "vgpu-5")
	if _, err := e.create(pod, ctr("c-kata-share")); err == nil || !strings.Contains(err.Error(), "under a Kata runtime ask for an mdev vGPU") {
		t.Errorf("Kata share: %v", err)
	}

	// Stop keeps the share for the pod (a restart gets it back) and removes the container's files.
	if _, err := e.rt.StopContainer(context.Background(), &nriadapt.StopContainerRequest{Pod: e.pod("share", shareLimits, nil), Container: ctr("c-share")}); err != nil {
		t.Fatal(err)
	}
	if _, ok := e.agent.Ledger().Get("c-share"); ok {
		t.Error("stopped container still in the ledger")
	}
	if h, ok := e.agent.Ledger().Get(holdID("uid-share", "main")); !ok || h.Devices[0].UUID != g0 {
		t.Errorf("stopped container's share not held for its pod: %+v", h)
	}
	if _, err := os.Stat(filepath.Join(e.dir, "state", "containers", "c-share")); !os.IsNotExist(err) {
		t.Errorf("container files left: %v", err)
	}
}

func TestSynchronizeRebuildsLedger(t *testing.T) {
	// The runtime reports one running container Tessera adjusted earlier (its annotation holds the
	// entry) that the ledger lost, and the ledger holds one the runtime no longer has.
	dir := t.TempDir()
	l, _ := ledger.Open(filepath.Join(dir, "x.json"), nil)
	_ = l
	entry := ledger.Entry{ContainerID: "c-live", PodUID: "u", Namespace: "ns", Pod: "p", Container: "main"}
	live := ctr("c-live")
	live.State = nriapi.ContainerState_CONTAINER_RUNNING
	e := newEnvWithLedgerEntries(t, []ledger.Entry{{ContainerID: "c-gone", Pod: "old"}}, live, &entry)
	if _, ok := e.agent.Ledger().Get("c-gone"); ok {
		t.Error("entry of a container the runtime does not have survived Synchronize")
	}
	if got, ok := e.agent.Ledger().Get("c-live"); !ok || got.Devices[0].MemoryBytes != 1<<30 {
		t.Errorf("running container not re-adopted: %+v", got)
	}
}

// newEnvWithLedgerEntries starts an env whose ledger already holds stale entries and whose runtime
// reports a live container annotated with entry (given a share on GPU 0).
func newEnvWithLedgerEntries(t *testing.T, stale []ledger.Entry, live *nriapi.Container, entry *ledger.Entry) *env {
	t.Helper()
	e, l := newAgentEnv(t)
	inv := e.agent.Inventory()
	for _, s := range stale {
		if err := l.Reserve(s, inv); err != nil {
			t.Fatal(err)
		}
	}
	entry.Devices = []api.DeviceAssignment{{UUID: inv.GPUs[0].UUID, MemoryBytes: 1 << 30}}
	raw, _ := json.Marshal(entry)
	live.Annotations = map[string]string{api.AnnotationLedgerEntry: string(raw)}
	e.running = []*nriapi.Container{live}
	client := podresources.New(filepath.Join(e.dir, "none.sock"))
	return e.start(client, l)
}

// BenchmarkCreateContainerShare is the plugin's own cost for a share container (grant lookup over
// the PodResources socket, verification, ledger, limits file) through NRI's runtime adaptation over
// a real socket, with a Stop between creates so the share is released each time.
func BenchmarkCreateContainerShare(b *testing.B) {
	e := newEnv(b)
	g0 := e.agent.Inventory().GPUs[0].UUID
	pod := e.pod("bench", map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "1Gi"}, assignment(api.DeviceAssignment{UUID: g0, MemoryBytes: 1 << 30}))
	e.grants.Add(podresources.Key{Namespace: "ns", Pod: "bench", Container: "main"}, api.ResourceShare, "vgpu-0")
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		c := ctr(fmt.Sprintf("c-%d", i))
		if _, err := e.create(pod, c); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		if _, err := e.rt.StopContainer(context.Background(), &nriadapt.StopContainerRequest{Pod: pod, Container: c}); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
}
