package e2e

import (
	"context"
	"fmt"
	"hash/fnv"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/util/retry"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// The TestExtender* tests run the real tessera-extender behind a real kube-scheduler and
// kube-apiserver (StartControlPlane). There is no kubelet: Nodes are API objects carrying the node
// agent's inventory annotation and extended-resource capacity, and a bound pod stays Pending with
// spec.nodeName set, which is all these tests look at. Every check recomputes the GPU usage from the
// assignment annotations and the inventories, independently of the extender's own bookkeeping.

const gib = int64(1) << 30

// extenderStack is a control plane whose scheduler consults a running tessera-extender.
type extenderStack struct {
	*ControlPlane
	Extender     *Process
	extenderAddr string
	ns           string

	mu    sync.Mutex
	nodes map[string]*api.NodeInventory
}

// startExtenderStack starts the control plane with the scheduler configured for the extender, then
// the extender itself as the chart deploys it: the ServiceAccount, ClusterRole, ClusterRoleBinding
// and ConfigMap come from `helm template` of deploy/helm/tessera, the extender reads that
// ConfigMap's config.yaml and authenticates as the ServiceAccount (a client certificate with the
// ServiceAccount's user name and groups, which RBAC treats alike), so a permission missing from
// the chart fails these tests. The scheduler calls it as the chart configures it (chartExtender);
// adjust, if not nil, changes that for a test that needs otherwise and says why. The chart is
// rendered in scheduler.mode=default, as this control plane runs it: the default scheduler calls the
// extender, so the extender binds pods of default-scheduler (its config's schedulerNames).
func startExtenderStack(t *testing.T, adjust func(*ExtenderConfig)) *extenderStack {
	t.Helper()
	t0 := time.Now()
	bin := tesseraBinary(t, "tessera-extender")
	addr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	ext := chartExtender(t, "http://"+addr)
	if adjust != nil {
		adjust(ext)
	}
	cp := StartControlPlane(t, ControlPlaneOptions{Extender: ext})
	cp.CreateNamespace(t, chartNamespace)
	rendered := mustRun(t, time.Minute, tool(t, "helm"), "template", "tessera", filepath.Join(repoRoot(), "deploy", "helm", "tessera"),
		"--namespace", chartNamespace, "--set", "scheduler.mode=default", "--set", "extender.networkPolicy.enabled=false", "--show-only", "templates/extender.yaml")
	manifest := filepath.Join(cp.Dir, "extender-chart.yaml")
	if err := os.WriteFile(manifest, []byte(rendered), 0o644); err != nil {
		t.Fatal(err)
	}
	// the Deployment and Service are inert here (no kube-controller-manager, no kubelet)
	mustRun(t, time.Minute, tool(t, "kubectl"), "--kubeconfig", cp.Kubeconfig, "apply", "-f", manifest)
	cm, err := cp.Client.CoreV1().ConfigMaps(chartNamespace).Get(context.Background(), "tessera-extender", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("chart ConfigMap: %v", err)
	}
	cfg := filepath.Join(cp.Dir, "extender-config.yaml")
	if err := os.WriteFile(cfg, []byte(cm.Data["config.yaml"]), 0o644); err != nil {
		t.Fatal(err)
	}
	kc := cp.MintKubeconfig(t, "tessera-extender", CertSpec{
		CommonName:    "system:serviceaccount:" + chartNamespace + ":tessera-extender",
		Organizations: []string{"system:serviceaccounts", "system:serviceaccounts:" + chartNamespace, "system:authenticated"},
	})
	s := &extenderStack{ControlPlane: cp, extenderAddr: addr, ns: metav1.NamespaceDefault, nodes: map[string]*api.NodeInventory{}}
	s.Extender = cp.StartProcess(t, "tessera-extender", bin, "--kubeconfig", kc, "--listen", addr, "--config", cfg, "-v=4")
	s.waitExtender(t)
	t.Logf("control plane and tessera-extender (chart RBAC and config) up in %.1fs (nodeCacheCapable %t)", time.Since(t0).Seconds(), ext.NodeCacheCapable)
	return s
}

// waitExtender waits until the extender answers GET /healthz with 200, which it does once its
// informers have synced (it rebuilt its state from the API server).
func (s *extenderStack) waitExtender(t *testing.T) {
	t.Helper()
	s.Extender.WaitHealthy(t, "http://"+s.extenderAddr+"/healthz", 30*time.Second)
}

// gpuNode describes a Node made through the API.
type gpuNode struct {
	name         string
	pool         string // label tessera.dev/pool; test pods select their pool
	gpus         int
	memory       int64 // per GPU, bytes
	sharesPerGPU int
}

// addNode creates a Ready Node with the agent's inventory annotation and capacity for whole GPUs
// and shares, without the not-ready taint that node admission adds (no node-lifecycle controller
// would remove it).
func (s *extenderStack) addNode(t *testing.T, n gpuNode) *api.NodeInventory {
	t.Helper()
	h := fnv.New32a()
	h.Write([]byte(n.name))
	inv := &api.NodeInventory{Node: n.name, DriverVersion: "sim", SharesPerGPU: n.sharesPerGPU}
	for i := 0; i < n.gpus; i++ {
		inv.GPUs = append(inv.GPUs, api.GPU{
			UUID:  fmt.Sprintf("GPU-%08x-0000-4000-8000-%012x", h.Sum32(), i),
			Index: i, Model: "NVIDIA A100-SXM4-40GB", MemoryBytes: n.memory, SMCount: 108, ComputeCapability: "8.0",
			NUMANode: i * 2 / n.gpus, PCIBusID: fmt.Sprintf("0000:%02x:00.0", 0x10+i), Minor: i, Healthy: true,
		})
	}
	for a := 0; a < n.gpus; a++ {
		for b := a + 1; b < n.gpus; b++ {
			inv.Links = append(inv.Links, api.Link{A: a, B: b, Kind: api.LinkNVLink, NVLinks: 12})
		}
	}
	data, err := api.EncodeInventory(inv)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{
		Name:   n.name,
		Labels: map[string]string{"kubernetes.io/hostname": n.name, api.LabelPool: n.pool, api.LabelGPUModel: "A100-SXM4-40GB"},
		// The test plays the node agent: an inventory and a fresh heartbeat (the chart's extender
		// config refuses nodes without one after inventoryMaxAge).
		Annotations: map[string]string{api.AnnotationInventory: string(data),
			api.AnnotationInventoryHeartbeat: time.Now().UTC().Format(time.RFC3339)},
	}}
	// The status goes in with the node as a kubelet registers it: a scheduler that saw the node
	// before a later status update found no allocatable pods or shares ("Too many pods") and, in
	// one CI run, did not retry the pod when the update came (a minute unbound).
	res := corev1.ResourceList{
		corev1.ResourceCPU:    resource.MustParse("64"),
		corev1.ResourceMemory: resource.MustParse("512Gi"),
		corev1.ResourcePods:   resource.MustParse("250"),
		api.ResourceGPU:       *resource.NewQuantity(int64(n.gpus), resource.DecimalSI),
		api.ResourceShare:     *resource.NewQuantity(int64(n.gpus*n.sharesPerGPU), resource.DecimalSI),
	}
	node.Status.Capacity, node.Status.Allocatable = res, res
	created, err := s.Client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create node %s: %v", n.name, err)
	}
	if got, want := created.Status.Allocatable[api.ResourceShare], res[api.ResourceShare]; got.Cmp(want) != 0 {
		t.Fatalf("node %s created with allocatable shares %s, want %s: the API server dropped the status", n.name, got.String(), want.String())
	}
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := s.Client.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		cur.Spec.Taints = nil
		_, err = s.Client.CoreV1().Nodes().Update(ctx, cur, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatalf("untaint node %s: %v", n.name, err)
	}
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := s.Client.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		now := metav1.Now()
		cur.Status.Capacity, cur.Status.Allocatable = res, res
		cur.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue,
			Reason: "KubeletReady", Message: "API-made node for the extender e2e", LastHeartbeatTime: now, LastTransitionTime: now}}
		_, err = s.Client.CoreV1().Nodes().UpdateStatus(ctx, cur, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatalf("node %s status: %v", n.name, err)
	}
	s.mu.Lock()
	s.nodes[n.name] = inv
	s.mu.Unlock()
	return inv
}

// gpuPod describes a test pod with one container.
type gpuPod struct {
	name      string
	pool      string
	whole     int   // nvidia.com/gpu
	shares    int   // tessera.dev/vgpu
	memory    int64 // tessera.dev/vgpu-memory per share, bytes
	memoryPct int   // tessera.dev/vgpu-memory-percent
	cores     int   // tessera.dev/vgpu-cores
	// priority is a PriorityClass name; such pods also get a termination grace period of 0, so
	// that a victim the scheduler deletes is gone at once (no kubelet confirms it here).
	priority string
	app      string // label app (PodDisruptionBudget selectors)
}

func (p gpuPod) object(ns string) *corev1.Pod {
	lim := corev1.ResourceList{}
	q := func(v int64) resource.Quantity { return *resource.NewQuantity(v, resource.DecimalSI) }
	if p.whole > 0 {
		lim[api.ResourceGPU] = q(int64(p.whole))
	}
	if p.shares > 0 {
		lim[api.ResourceShare] = q(int64(p.shares))
	}
	if p.memory > 0 {
		lim[api.ResourceShareMemory] = *resource.NewQuantity(p.memory, resource.BinarySI)
	}
	if p.memoryPct > 0 {
		lim[api.ResourceShareMemoryPercent] = q(int64(p.memoryPct))
	}
	if p.cores > 0 {
		lim[api.ResourceShareCores] = q(int64(p.cores))
	}
	no := false
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: p.name, Namespace: ns, Labels: map[string]string{"e2e-pool": p.pool}},
		Spec: corev1.PodSpec{
			NodeSelector:                 map[string]string{api.LabelPool: p.pool},
			AutomountServiceAccountToken: &no,
			Containers: []corev1.Container{{
				Name: "main", Image: "registry.k8s.io/pause:3.10",
				Resources: corev1.ResourceRequirements{Limits: lim},
			}},
		},
	}
	if p.app != "" {
		pod.Labels["app"] = p.app
	}
	if p.priority != "" {
		pod.Spec.PriorityClassName = p.priority
		pod.Spec.TerminationGracePeriodSeconds = new(int64)
	}
	return pod
}

func (s *extenderStack) createPod(t testing.TB, p gpuPod) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := s.Client.CoreV1().Pods(s.ns).Create(ctx, p.object(s.ns), metav1.CreateOptions{}); err != nil {
		t.Fatalf("create pod %s: %v", p.name, err)
	}
}

// poolPods lists the pods of a pool.
func (s *extenderStack) poolPods(t testing.TB, pool string) []corev1.Pod {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err := s.Client.CoreV1().Pods(s.ns).List(ctx, metav1.ListOptions{LabelSelector: "e2e-pool=" + pool})
	if err != nil {
		t.Fatalf("list pods: %v", err)
	}
	sort.Slice(l.Items, func(i, j int) bool { return l.Items[i].Name < l.Items[j].Name })
	return l.Items
}

// waitBound waits until every named pod of the pool has a node.
func (s *extenderStack) waitBound(t *testing.T, pool string, names []string, timeout time.Duration) []corev1.Pod {
	t.Helper()
	var pods []corev1.Pod
	err := waitFor(timeout, 200*time.Millisecond, func() (bool, error) {
		pods = s.poolPods(t, pool)
		bound := map[string]bool{}
		for _, p := range pods {
			if p.Spec.NodeName != "" {
				bound[p.Name] = true
			}
		}
		var missing []string
		for _, n := range names {
			if !bound[n] {
				missing = append(missing, n)
			}
		}
		if len(missing) > 0 {
			return false, fmt.Errorf("%d pods not bound: %v", len(missing), missing)
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("pods of pool %s: %v\n%s%s", pool, err, describePending(pods), s.leases())
	}
	return pods
}

// leases describes all Leases (the extender's leader and per-node bind Leases among them), for
// failure messages.
func (s *extenderStack) leases() string {
	l, err := s.Client.CoordinationV1().Leases("").List(context.Background(), metav1.ListOptions{})
	if err != nil {
		return "leases: " + err.Error()
	}
	var b strings.Builder
	b.WriteString("leases at " + time.Now().Format("15:04:05.000") + ":\n")
	for _, x := range l.Items {
		holder, renew, dur := "<none>", "<none>", int32(0)
		if x.Spec.HolderIdentity != nil {
			holder = *x.Spec.HolderIdentity
		}
		if x.Spec.RenewTime != nil {
			renew = x.Spec.RenewTime.Format("15:04:05.000")
		}
		if x.Spec.LeaseDurationSeconds != nil {
			dur = *x.Spec.LeaseDurationSeconds
		}
		fmt.Fprintf(&b, "  %s/%s: holder %q renewed %s for %ds (resourceVersion %s)\n", x.Namespace, x.Name, holder, renew, dur, x.ResourceVersion)
	}
	return b.String()
}

// describePending summarises why pods are still unbound.
func describePending(pods []corev1.Pod) string {
	var b strings.Builder
	for _, p := range pods {
		if p.Spec.NodeName != "" {
			continue
		}
		c := scheduledCondition(&p)
		if c == nil {
			fmt.Fprintf(&b, "  %s: no PodScheduled condition\n", p.Name)
			continue
		}
		fmt.Fprintf(&b, "  %s: PodScheduled=%s %s: %s\n", p.Name, c.Status, c.Reason, c.Message)
	}
	return b.String()
}

func scheduledCondition(p *corev1.Pod) *corev1.PodCondition {
	for i := range p.Status.Conditions {
		if p.Status.Conditions[i].Type == corev1.PodScheduled {
			return &p.Status.Conditions[i]
		}
	}
	return nil
}

// waitUnschedulable waits until the pod has PodScheduled=False/Unschedulable with a message that
// contains every want, and checks that it is still unbound; it returns the message.
func (s *extenderStack) waitUnschedulable(t *testing.T, name string, want ...string) string {
	t.Helper()
	var msg string
	err := waitFor(45*time.Second, 200*time.Millisecond, func() (bool, error) {
		p, err := s.Client.CoreV1().Pods(s.ns).Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if p.Spec.NodeName != "" {
			return false, fmt.Errorf("pod %s was bound to %s", name, p.Spec.NodeName)
		}
		c := scheduledCondition(p)
		if c == nil || c.Status != corev1.ConditionFalse || c.Reason != corev1.PodReasonUnschedulable {
			return false, fmt.Errorf("pod %s: PodScheduled condition %+v", name, c)
		}
		msg = c.Message
		for _, w := range want {
			if !strings.Contains(msg, w) {
				return false, fmt.Errorf("pod %s: Unschedulable message %q lacks %q", name, msg, w)
			}
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("%v\nextender log:\n%s", err, s.Extender.LogTail(30))
	}
	return msg
}

// schedulingEvents returns the messages of FailedScheduling events of a pod.
func (s *extenderStack) schedulingEvents(t *testing.T, name string) []string {
	t.Helper()
	sel := fields.AndSelectors(fields.OneTermEqualSelector("involvedObject.name", name),
		fields.OneTermEqualSelector("reason", "FailedScheduling")).String()
	l, err := s.Client.CoreV1().Events(s.ns).List(context.Background(), metav1.ListOptions{FieldSelector: sel})
	if err != nil {
		t.Fatalf("list events: %v", err)
	}
	var out []string
	for _, e := range l.Items {
		out = append(out, e.Message)
	}
	return out
}

// gpuUse is what the bound pods hold on one GPU, recomputed from their assignments.
type gpuUse struct {
	whole  []string // pods holding it whole
	shares []string // pods holding a share
	memory int64
	cores  int
}

// checkAssignments verifies every bound pod's assignment annotation against its request and its
// node's inventory (each share on a distinct GPU of that node, memory and cores as requested, whole
// GPUs whole) and that no GPU is over-committed across all bound pods: a GPU is held whole by at
// most one pod and then shared by none, and its shares' memory and cores stay within the GPU. It
// returns the usage per GPU UUID.
func (s *extenderStack) checkAssignments(t *testing.T, pods []corev1.Pod, specs map[string]gpuPod) map[string]*gpuUse {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	use := map[string]*gpuUse{}
	gpuOf := map[string]*api.GPU{}
	for _, inv := range s.nodes {
		for i := range inv.GPUs {
			gpuOf[inv.GPUs[i].UUID] = &inv.GPUs[i]
			use[inv.GPUs[i].UUID] = &gpuUse{}
		}
	}
	for _, p := range pods {
		if p.Spec.NodeName == "" {
			if _, ok := p.Annotations[api.AnnotationAssignment]; ok {
				// an assignment without a binding holds nothing the node agent would honour
				t.Logf("pod %s is unbound but carries an assignment annotation", p.Name)
			}
			continue
		}
		spec, known := specs[p.Name]
		raw, ok := p.Annotations[api.AnnotationAssignment]
		if !ok {
			t.Errorf("pod %s is bound to %s without a %s annotation", p.Name, p.Spec.NodeName, api.AnnotationAssignment)
			continue
		}
		a, err := api.DecodeAssignment([]byte(raw))
		if err != nil {
			t.Errorf("pod %s: %v", p.Name, err)
			continue
		}
		if a.Node != p.Spec.NodeName {
			t.Errorf("pod %s is bound to %s but its assignment names node %s", p.Name, p.Spec.NodeName, a.Node)
		}
		inv := s.nodes[p.Spec.NodeName]
		c := a.Container("main")
		if c == nil || len(a.Containers) != 1 {
			t.Errorf("pod %s: assignment %s does not hold exactly container main", p.Name, raw)
			continue
		}
		if known {
			want := spec.whole + spec.shares
			if len(c.Devices) != want {
				t.Errorf("pod %s asked for %d whole GPUs and %d shares, got %d devices: %s", p.Name, spec.whole, spec.shares, len(c.Devices), raw)
			}
		}
		for _, d := range c.Devices {
			g := gpuOf[d.UUID]
			if g == nil || inv == nil || inv.GPUByUUID(d.UUID) == nil {
				t.Errorf("pod %s on %s is assigned GPU %s, which that node does not have", p.Name, p.Spec.NodeName, d.UUID)
				continue
			}
			u := use[d.UUID]
			if d.Whole {
				if known && spec.whole == 0 {
					t.Errorf("pod %s asked for shares but got GPU %s whole", p.Name, d.UUID)
				}
				u.whole = append(u.whole, p.Name)
				continue
			}
			if known {
				if spec.whole > 0 {
					t.Errorf("pod %s asked for whole GPUs but got a share of %s", p.Name, d.UUID)
				}
				wantMem := spec.memory
				if spec.memoryPct > 0 {
					wantMem = g.MemoryBytes * int64(spec.memoryPct) / 100
				}
				if d.MemoryBytes != wantMem {
					t.Errorf("pod %s: share on %s has %d bytes, asked for %d", p.Name, d.UUID, d.MemoryBytes, wantMem)
				}
				if d.CoresPercent != spec.cores {
					t.Errorf("pod %s: share on %s has %d%% cores, asked for %d%%", p.Name, d.UUID, d.CoresPercent, spec.cores)
				}
			}
			u.shares = append(u.shares, p.Name)
			u.memory += d.MemoryBytes
			u.cores += d.CoresPercent
		}
	}
	for uuid, u := range use {
		g := gpuOf[uuid]
		switch {
		case len(u.whole) > 1:
			t.Errorf("GPU %s is held whole by %d pods: %v", uuid, len(u.whole), u.whole)
		case len(u.whole) == 1 && len(u.shares) > 0:
			t.Errorf("GPU %s is held whole by %s and shared by %v", uuid, u.whole[0], u.shares)
		}
		if u.memory > g.MemoryBytes {
			t.Errorf("GPU %s is over-committed: shares hold %d bytes of %d (%v)", uuid, u.memory, g.MemoryBytes, u.shares)
		}
		if u.cores > api.MaxCoresPercent {
			t.Errorf("GPU %s is over-committed: shares hold %d%% of its cores (%v)", uuid, u.cores, u.shares)
		}
	}
	return use
}

// TestExtenderPlacement: shares (with byte and percent memory caps), whole GPUs and n shares across
// n GPUs are bound by the extender with assignments that match the requests, and no GPU is
// over-committed; a pod without GPU requests is scheduled without the extender.
func TestExtenderPlacement(t *testing.T) {
	s := startExtenderStack(t, nil)
	const pool = "placement"
	for _, n := range []string{"place-a", "place-b"} {
		s.addNode(t, gpuNode{name: n, pool: pool, gpus: 8, memory: 40 * gib, sharesPerGPU: 4})
	}
	specs := map[string]gpuPod{}
	// Phases keep the demand feasible whatever the placement policy prefers: whole GPUs first (7 of
	// 16, so one node keeps at least 5 free), then shares across several GPUs, then single shares.
	phases := [][]gpuPod{{
		{name: "whole-1", pool: pool, whole: 1},
		{name: "whole-2", pool: pool, whole: 2},
		{name: "whole-4", pool: pool, whole: 4},
	}, {
		{name: "multi-5", pool: pool, shares: 5, memory: 8 * gib, cores: 20},
		{name: "multi-3", pool: pool, shares: 3, memory: 4 * gib, cores: 10},
	}, {
		{name: "share-pct", pool: pool, shares: 1, memoryPct: 50, cores: 30},
		{name: "share-uncapped", pool: pool, shares: 1, memory: 5 * gib},
	}}
	for i := 0; i < 6; i++ {
		phases[2] = append(phases[2], gpuPod{name: fmt.Sprintf("share-%d", i), pool: pool, shares: 1, memory: 6 * gib, cores: 10})
	}
	var bound []corev1.Pod
	for _, phase := range phases {
		var names []string
		for _, p := range phase {
			s.createPod(t, p)
			specs[p.name] = p
			names = append(names, p.name)
		}
		t0 := time.Now()
		bound = s.waitBound(t, pool, names, time.Minute)
		t.Logf("%d pods bound in %.1fs", len(names), time.Since(t0).Seconds())
	}
	use := s.checkAssignments(t, bound, specs)
	whole := 0
	for _, u := range use {
		whole += len(u.whole)
	}
	if whole != 7 {
		t.Errorf("%d GPUs are held whole, want 7", whole)
	}

	// A pod without GPU requests is not the extender's: the scheduler places it alone.
	plain := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "plain", Namespace: s.ns},
		Spec: corev1.PodSpec{NodeSelector: map[string]string{api.LabelPool: pool},
			Containers: []corev1.Container{{Name: "main", Image: "registry.k8s.io/pause:3.10"}}}}
	if _, err := s.Client.CoreV1().Pods(s.ns).Create(context.Background(), plain, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	err := waitFor(30*time.Second, 200*time.Millisecond, func() (bool, error) {
		p, err := s.Client.CoreV1().Pods(s.ns).Get(context.Background(), "plain", metav1.GetOptions{})
		return err == nil && p.Spec.NodeName != "", err
	})
	if err != nil {
		t.Fatalf("plain pod not scheduled: %v", err)
	}
	// the extender logs every filter call at debug level
	if log, _ := os.ReadFile(s.Extender.Log); strings.Contains(string(log), `"default/plain"`) {
		t.Errorf("the scheduler consulted the extender for a pod without GPU requests (managedResources)")
	}
}

// TestExtenderWithoutNodeCache: the one test that runs the scheduler with nodeCacheCapable: false,
// against the chart's true, on purpose: tessera-extender also serves a scheduler configured by hand
// without it, which sends whole Node objects and reads the kept nodes back as a NodeList (filter.go),
// and only a real kube-scheduler shows that reply is understood. Two whole GPUs fit only the larger
// node, so the pod binds only if the scheduler took the extender's filtered list; a share binds too.
func TestExtenderWithoutNodeCache(t *testing.T) {
	s := startExtenderStack(t, func(e *ExtenderConfig) { e.NodeCacheCapable = false })
	const pool = "nocache"
	s.addNode(t, gpuNode{name: "nocache-small", pool: pool, gpus: 1, memory: 40 * gib, sharesPerGPU: 4})
	s.addNode(t, gpuNode{name: "nocache-big", pool: pool, gpus: 4, memory: 40 * gib, sharesPerGPU: 4})
	specs := map[string]gpuPod{}
	for _, p := range []gpuPod{
		{name: "whole-2", pool: pool, whole: 2},
		{name: "share", pool: pool, shares: 1, memory: 8 * gib, cores: 20},
	} {
		s.createPod(t, p)
		specs[p.name] = p
	}
	bound := s.waitBound(t, pool, []string{"whole-2", "share"}, time.Minute)
	s.checkAssignments(t, bound, specs)
	for _, p := range bound {
		if p.Name == "whole-2" && p.Spec.NodeName != "nocache-big" {
			t.Errorf("whole-2 bound to %s, where two GPUs do not fit", p.Spec.NodeName)
		}
	}
}

// TestExtenderUnschedulable: pods that cannot fit stay unbound with PodScheduled=False and the
// extender's per-node reason in the message (and in a FailedScheduling event), while the pods that
// fit are bound; a pod the node's capacity could hold in count but not in GPU memory is refused.
func TestExtenderUnschedulable(t *testing.T) {
	s := startExtenderStack(t, nil)
	const pool = "small"
	// 2 GPUs x 40 GiB; 8 share tokens per GPU, so the scheduler's own count never says no first
	s.addNode(t, gpuNode{name: "small-a", pool: pool, gpus: 2, memory: 40 * gib, sharesPerGPU: 8})
	specs := map[string]gpuPod{}
	create := func(p gpuPod) {
		specs[p.name] = p
		s.createPod(t, p)
	}

	// static misfits: more distinct GPUs than the node has; more memory per share than a GPU has
	create(gpuPod{name: "too-many-shares", pool: pool, shares: 3, memory: gib, cores: 10})
	create(gpuPod{name: "too-much-memory", pool: pool, shares: 1, memory: 48 * gib, cores: 10})
	m1 := s.waitUnschedulable(t, "too-many-shares", "0/1 nodes are available", "3 distinct GPUs")
	m2 := s.waitUnschedulable(t, "too-much-memory", "0/1 nodes are available", "49152 MiB")
	t.Logf("too-many-shares: %s", m1)
	t.Logf("too-much-memory: %s", m2)
	// an invalid request is refused with the parser's reason, never rounded
	create(gpuPod{name: "cores-150", pool: pool, shares: 1, memory: gib, cores: 150})
	m0 := s.waitUnschedulable(t, "cores-150", "0/1 nodes are available", api.ResourceShareCores)
	t.Logf("cores-150: %s", m0)
	for _, c := range []struct{ pod, msg string }{{"too-many-shares", m1}, {"too-much-memory", m2}} {
		// the scheduler's own reasons would name the resource ("Insufficient tessera.dev/vgpu");
		// the extender's reason is its own sentence
		if strings.Contains(c.msg, "Insufficient") || !strings.Contains(strings.ToLower(c.msg), "gpu") {
			t.Errorf("pod %s: message does not carry the extender's reason: %q", c.pod, c.msg)
		}
	}

	// fill GPU memory with shares: 4 x 20 GiB fit (2 per GPU), the 5th does not
	var names []string
	for i := 0; i < 4; i++ {
		n := fmt.Sprintf("fill-%d", i)
		create(gpuPod{name: n, pool: pool, shares: 1, memory: 20 * gib, cores: 10})
		names = append(names, n)
	}
	s.waitBound(t, pool, names, time.Minute)
	create(gpuPod{name: "no-memory-left", pool: pool, shares: 1, memory: 20 * gib, cores: 10})
	m3 := s.waitUnschedulable(t, "no-memory-left", "0/1 nodes are available", "20480 MiB")
	t.Logf("no-memory-left: %s", m3)
	// both GPUs now carry shares, so no GPU can be given whole
	create(gpuPod{name: "whole-on-shared", pool: pool, whole: 1})
	m4 := s.waitUnschedulable(t, "whole-on-shared", "0/1 nodes are available", "locked to shares")
	t.Logf("whole-on-shared: %s", m4)
	for _, c := range []struct{ pod, msg string }{{"no-memory-left", m3}, {"whole-on-shared", m4}} {
		if strings.Contains(c.msg, "Insufficient") {
			t.Errorf("pod %s was refused by the scheduler's own count, not by the extender: %q", c.pod, c.msg)
		}
	}
	// the extender's own Warning Event says why, too
	err := waitFor(30*time.Second, 200*time.Millisecond, func() (bool, error) {
		l, err := s.Client.CoreV1().Events(s.ns).List(context.Background(), metav1.ListOptions{FieldSelector: fields.AndSelectors(
			fields.OneTermEqualSelector("involvedObject.name", "too-many-shares"), fields.OneTermEqualSelector("source", "tessera-extender")).String()})
		if err != nil {
			return false, err
		}
		for _, e := range l.Items {
			if e.Type == corev1.EventTypeWarning && strings.Contains(e.Message, "3 distinct GPUs") {
				return true, nil
			}
		}
		return false, fmt.Errorf("events from tessera-extender: %+v", l.Items)
	})
	if err != nil {
		t.Errorf("no Warning Event from tessera-extender on too-many-shares: %v", err)
	}
	if ev := s.schedulingEvents(t, "no-memory-left"); len(ev) == 0 {
		t.Errorf("no FailedScheduling event for no-memory-left")
	} else if !strings.Contains(ev[len(ev)-1], "0/1 nodes are available") {
		t.Errorf("FailedScheduling event for no-memory-left: %q", ev[len(ev)-1])
	}
	s.checkAssignments(t, s.poolPods(t, pool), specs)

	// freeing a GPU's shares lets the waiting pods in
	for _, p := range s.poolPods(t, pool) {
		if strings.HasPrefix(p.Name, "fill-") {
			if err := s.Client.CoreV1().Pods(s.ns).Delete(context.Background(), p.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
				t.Fatal(err)
			}
		}
	}
	delete(specs, "fill-0")
	delete(specs, "fill-1")
	delete(specs, "fill-2")
	delete(specs, "fill-3")
	bound := s.waitBound(t, pool, []string{"no-memory-left", "whole-on-shared"}, time.Minute)
	s.checkAssignments(t, bound, specs)
}

// TestExtenderRestart: the extender is killed (SIGKILL, then SIGTERM) and started again while pods
// are being created. Demand equals capacity exactly (every GPU's memory and cores), so a lost
// decision would leave a pod unbound for good and a forgotten one would over-commit a GPU: all pods
// must be bound eventually with no GPU over-committed, and one more pod must then stay unbound.
func TestExtenderRestart(t *testing.T) {
	s := startExtenderStack(t, nil)
	const pool = "restart"
	// 2 nodes x 4 GPUs x 40 GiB; 16 share tokens per GPU: memory and cores bind, not the token count
	for _, n := range []string{"restart-a", "restart-b"} {
		s.addNode(t, gpuNode{name: n, pool: pool, gpus: 4, memory: 40 * gib, sharesPerGPU: 16})
	}
	const total = 32 // 8 GPUs x 4 shares of 10 GiB and 25% each
	specs := map[string]gpuPod{}
	var names []string
	for i := 0; i < total; i++ {
		p := gpuPod{name: fmt.Sprintf("r-%02d", i), pool: pool, shares: 1, memory: 10 * gib, cores: 25}
		specs[p.name] = p
		names = append(names, p.name)
	}
	killAt := map[int]func(){
		6:  func() { t.Log("killing the extender (SIGKILL)"); s.Extender.Kill(t) },
		10: func() { t.Log("starting the extender"); s.Extender.Start(t) },
		18: func() { t.Log("stopping the extender (SIGTERM)"); s.Extender.Stop(t) },
		21: func() { t.Log("starting the extender"); s.Extender.Start(t) },
	}
	for i, n := range names {
		if f := killAt[i]; f != nil {
			f()
		}
		s.createPod(t, specs[n])
		time.Sleep(100 * time.Millisecond) // a stream of pods, so that restarts land mid-stream
	}
	s.waitExtender(t)
	bound := s.waitBound(t, pool, names, 90*time.Second)
	use := s.checkAssignments(t, bound, specs)
	for uuid, u := range use {
		if len(u.shares) != 4 {
			t.Errorf("GPU %s holds %d shares, want 4 (demand equals capacity)", uuid, len(u.shares))
		}
	}
	if t.Failed() {
		return
	}
	// full: one more share must not fit anywhere
	extra := gpuPod{name: "r-extra", pool: pool, shares: 1, memory: 10 * gib, cores: 25}
	specs[extra.name] = extra
	s.createPod(t, extra)
	msg := s.waitUnschedulable(t, extra.name, "0/2 nodes are available")
	t.Logf("r-extra: %s", msg)
	s.checkAssignments(t, s.poolPods(t, pool), specs)
	if _, err := s.Client.CoreV1().Pods(s.ns).Get(context.Background(), extra.name, metav1.GetOptions{}); apierrors.IsNotFound(err) {
		t.Errorf("r-extra disappeared")
	}
}

// TestExtenderAPIServerRestart: the API server goes away for longer than the extender's leader
// Lease renew deadline (10 s) and comes back, as in a control-plane upgrade. The extender must bind
// again afterwards: pods created after the outage are bound, and the ones bound before keep their
// GPUs (no over-commit).
func TestExtenderAPIServerRestart(t *testing.T) {
	s := startExtenderStack(t, nil)
	const pool = "outage"
	s.addNode(t, gpuNode{name: "outage-a", pool: pool, gpus: 2, memory: 40 * gib, sharesPerGPU: 8})
	specs := map[string]gpuPod{}
	create := func(p gpuPod) string {
		specs[p.name] = p
		s.createPod(t, p)
		return p.name
	}
	s.waitBound(t, pool, []string{create(gpuPod{name: "before", pool: pool, shares: 1, memory: 30 * gib, cores: 50})}, time.Minute)

	t.Log("stopping kube-apiserver for 15s")
	s.APIServer.Stop(t)
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		if !s.Extender.Running() {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	s.APIServer.Start(t)
	s.WaitAPIServerReady(t)
	// an extender that exits when it loses its Lease is fine as long as something restarts it;
	// here the test plays the supervisor
	if !s.Extender.Running() {
		t.Log("tessera-extender exited during the outage; restarting it as a supervisor would")
		s.Extender.Stop(t)
		s.Extender.Start(t)
		s.waitExtender(t)
	}
	var names []string
	for i := 0; i < 3; i++ {
		names = append(names, create(gpuPod{name: fmt.Sprintf("after-%d", i), pool: pool, shares: 1, memory: 10 * gib, cores: 10}))
	}
	// one that only fits if "before" is forgotten: 30 GiB are taken on one GPU, 10+10+10 on the other or spread
	names2 := create(gpuPod{name: "too-big", pool: pool, shares: 2, memory: 35 * gib, cores: 10})
	bound := s.waitBound(t, pool, names, 90*time.Second)
	s.checkAssignments(t, bound, specs)
	s.waitUnschedulable(t, names2, "0/1 nodes are available")
}
