package e2e

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestMultiNode runs the three-node cluster (multinode.go): placement across nodes, then the
// day-2 drills, each leaving the cluster empty.
func TestMultiNode(t *testing.T) {
	m := StartMultiNode(t)
	steps := []struct {
		name string
		fn   func(*testing.T, *MultiNode)
	}{
		{"Placement", testMultiNodePlacement},
		{"Policy", testMultiNodePolicy},
		{"AgentDown", testMultiNodeAgentDown},
		{"NodeLoss", testMultiNodeNodeLoss},
		{"LeaderKill", testMultiNodeLeaderKill},
		{"XID", testMultiNodeXID},
		{"Drain", testMultiNodeDrain},
		// Last: by now every agent has been running past NRIGrace, so nothing is waited for.
		{"RuntimeCheck", testMultiNodeRuntimeCheck},
	}
	for _, s := range steps {
		t.Run(s.name, func(t *testing.T) {
			t.Cleanup(func() { m.Reset(t) })
			s.fn(t, m)
		})
	}
}

// Reset deletes every pod and waits until both agents hold nothing and no claim is left.
func (m *MultiNode) Reset(t testing.TB) {
	t.Helper()
	a := m.Node(t, NodeA100)
	a.DeleteAllPods(t)
	for _, n := range []string{NodeA100, NodeH100} {
		m.Node(t, n).WaitLedgerEmpty(t)
	}
	a.WaitClaimsGone(t)
}

// model is the GPU model of a node's shareable GPUs, from its published inventory.
func (m *MultiNode) model(t testing.TB, node string) string {
	t.Helper()
	for _, g := range m.Node(t, node).Inventory.GPUs {
		if g.Shareable() {
			return g.Model
		}
	}
	t.Fatalf("node %s has no shareable GPU", node)
	return ""
}

// placedOn waits for the pods to run and checks each landed on its node and, where the extender
// placed it, that its assignment names that node and devices of that node's inventory.
func (m *MultiNode) placedOn(t *testing.T, want map[string]string) {
	t.Helper()
	c := m.Node(t, NodeCPU)
	for pod, node := range want {
		p := c.WaitRunning(t, 3*time.Minute, pod)[0]
		if p.Spec.NodeName != node {
			t.Errorf("pod %s runs on %s, want %s", pod, p.Spec.NodeName, node)
			continue
		}
		a := c.Assignment(t, p)
		if a == nil {
			continue
		}
		if a.Node != node {
			t.Errorf("pod %s: assignment for node %s, bound to %s", pod, a.Node, node)
		}
		inv := m.Node(t, node).Inventory
		for _, ca := range a.Containers {
			for _, d := range ca.Devices {
				if inv.GPUByUUID(d.UUID) == nil {
					t.Errorf("pod %s: assigned GPU %s is not in node %s's inventory", pod, d.UUID, node)
				}
			}
		}
	}
}

// waitHolds waits until the node's published holdings, which the extenders count as occupied,
// list the pod.
func (m *MultiNode) waitHolds(t testing.TB, node, pod string) { m.waitHeld(t, node, pod, true) }

// waitHeld waits until the node's published holdings list the pod (held) or do not (!held).
func (m *MultiNode) waitHeld(t testing.TB, node, pod string, held bool) {
	t.Helper()
	err := waitFor(time.Minute, 200*time.Millisecond, func() (bool, error) {
		n, err := m.CP.Client.CoreV1().Nodes().Get(context.Background(), node, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		h, err := api.DecodeHoldings([]byte(n.Annotations[api.AnnotationHoldings]))
		if err != nil {
			return false, err
		}
		listed := slices.ContainsFunc(h.Pods, func(p api.PodHolding) bool { return p.Pod == pod })
		return listed == held, fmt.Errorf("node %s's holdings list %s: %v, want %v", node, pod, listed, held)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// cudaTotal runs cudaprobe in the pod on its node and returns the memory CUDA reports.
func (m *MultiNode) cudaTotal(t *testing.T, node, pod string) uint64 {
	t.Helper()
	out := m.Node(t, node).MustExec(t, pod, "cudaprobe info")
	return probeValues(t, out, "device")["total_mem"]
}

// testMultiNodePlacement: whole GPUs, device-plugin shares, MIG instances and a DRA claim land on
// the node whose GPUs fit them (a model asked for, a MIG profile only one model has, a claim
// selecting a model), never on the CPU-only node; a plain pod runs there. CUDA (the fake driver)
// runs in every GPU pod and sees what it was given: the share's cap, the whole GPU's memory, the
// MIG instance's memory.
func testMultiNodePlacement(t *testing.T, m *MultiNode) {
	c := m.Node(t, NodeCPU)
	a100, h100 := m.model(t, NodeA100), m.model(t, NodeH100)
	if a100 == h100 {
		t.Fatalf("both GPU nodes have %s; the test needs two models", a100)
	}
	// The claim first: the scheduler's DRA allocator does not see the extender's placements (nor
	// the extender a claim before the agent has prepared it and published its holdings), so a
	// claim and a whole GPU placed at the same moment may meet on one GPU, and the agent refuses
	// the second (TestDRA's BothFrontDoors). Run in turn they do not.
	c.CreateClaimTemplate(t, "share-a100", classShare, map[string]string{"memory": "10Gi", "compute": "30"},
		fmt.Sprintf(`device.attributes["gpu.tessera.dev"].model == %q`, a100))
	c.CreatePod(t, ClaimPod("claim-a100", "share-a100"))
	m.placedOn(t, map[string]string{"claim-a100": NodeA100})
	m.waitHolds(t, NodeA100, "claim-a100")
	c.CreatePod(t, TestPod("whole-a100", map[string]string{api.ResourceGPU: "1"}, map[string]string{api.AnnotationGPUModel: a100}))
	c.CreatePod(t, TestPod("share-h100", map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "10Gi", api.ResourceShareCores: "30"},
		map[string]string{api.AnnotationGPUModel: h100}))
	c.CreatePod(t, TestPod("mig-a100", map[string]string{api.MIGResourcePrefix + "1g.5gb": "1"}, nil))
	c.CreatePod(t, TestPod("mig-h100", map[string]string{api.MIGResourcePrefix + "1g.10gb": "1"}, nil))
	cpu := TestPod("plain", nil, nil)
	cpu.Spec.NodeSelector = map[string]string{corev1.LabelHostname: NodeCPU}
	c.CreatePod(t, cpu)
	m.placedOn(t, map[string]string{"whole-a100": NodeA100, "share-h100": NodeH100, "mig-a100": NodeA100,
		"mig-h100": NodeH100, "plain": NodeCPU})

	checkShareCUDA(t, m.Node(t, NodeH100), "share-h100", 10<<30)
	checkShareCUDA(t, m.Node(t, NodeA100), "claim-a100", 10<<30)
	whole := c.Assignment(t, c.Pod(t, "whole-a100")).Containers[0].Devices[0]
	if got, want := m.cudaTotal(t, NodeA100, "whole-a100"), m.Node(t, NodeA100).GPU(whole.UUID).MemoryBytes; got != uint64(want) {
		t.Errorf("whole-a100: CUDA reports %d bytes, want the whole %s's %d", got, a100, want)
	}
	// CUDA in a MIG container sees the instance it was given, as on a real node: the instance's
	// memory, not its parent GPU's (the fake's two MIG views, internal/testing/README.md).
	for pod, want := range map[string]struct{ node, profile string }{"mig-a100": {NodeA100, "1g.5gb"}, "mig-h100": {NodeH100, "1g.10gb"}} {
		var inst *api.MIGInstance
		parent := int64(0)
		for _, g := range m.Node(t, want.node).Inventory.GPUs {
			if g.MIG == nil {
				continue
			}
			for i := range g.MIG.Instances {
				if g.MIG.Instances[i].Profile == want.profile {
					inst, parent = &g.MIG.Instances[i], g.MemoryBytes
				}
			}
		}
		if inst == nil {
			t.Errorf("%s: %s has no %s instance", pod, want.node, want.profile)
			continue
		}
		if got := m.cudaTotal(t, want.node, pod); got != uint64(inst.MemoryBytes) || got == uint64(parent) {
			t.Errorf("%s: CUDA reports %d bytes, want its %s instance's %d, not the parent GPU's %d", pod, got, want.profile, inst.MemoryBytes, parent)
		}
	}
	// Each agent holds what runs on its node, and only that (a claim pod twice: its prepared claim
	// and its container).
	for node, want := range map[string]string{NodeA100: "claim-a100 claim-a100 mig-a100 whole-a100", NodeH100: "mig-h100 share-h100"} {
		var held []string
		for _, e := range m.Node(t, node).LedgerEntries(t) {
			held = append(held, e.Pod)
		}
		slices.Sort(held)
		if got := strings.Join(held, " "); got != want {
			t.Errorf("node %s's ledger holds %s, want %s:\n%s", node, got, want, m.Node(t, node).Ledger(t))
		}
	}
}

// testMultiNodeAgentDown: tessera-node on the H100 node stops while pods come and go (the operator
// takes the node's nvidia.com/gpu.present label off, and the DaemonSet deletes the agent pod;
// putting it back starts a new one).
// Expectation: the share running there keeps running with its cap (CUDA still reports and enforces
// it); a pod that only fits an H100 is refused with a reason (the kubelet no longer offers the
// stopped device plugin's shares; after inventoryMaxAge the extenders also find the heartbeat
// stale), and a pod any GPU fits is placed on the
// A100 node; a pod deleted meanwhile leaves no hold behind. After the restart the agent holds
// exactly the pods bound to its node (nothing stale, nothing lost) and the refused pod runs there.
func testMultiNodeAgentDown(t *testing.T, m *MultiNode) {
	h := m.Node(t, NodeH100)
	h100 := m.model(t, NodeH100)
	share := func(name, model string) *corev1.Pod {
		ann := map[string]string{}
		if model != "" {
			ann[api.AnnotationGPUModel] = model
		}
		return TestPod(name, map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "8Gi"}, ann)
	}
	h.CreatePod(t, share("keep", h100))
	h.CreatePod(t, share("leave", h100))
	m.placedOn(t, map[string]string{"keep": NodeH100, "leave": NodeH100})
	keep := h.Assignment(t, h.Pod(t, "keep")).Containers[0].Devices[0]

	m.StopAgent(t, NodeH100)
	stopped := time.Now()
	h.DeletePods(t, "leave")
	// The share keeps its cap with no agent: the cap lives in the container (vcuda, its region).
	checkShareCUDA(t, h, "keep", 8<<30)
	// Stale once no heartbeat has been seen for multiNodeMaxAge (the last came at most one
	// multiNodeHeartbeat before the stop).
	time.Sleep(time.Until(stopped.Add(multiNodeMaxAge + time.Second)))
	h.CreatePod(t, share("only-h100", h100))
	h.CreatePod(t, share("any-gpu", ""))
	// Two guards refuse it: the kubelet marks a stopped device plugin's devices unhealthy (no
	// allocatable shares left), and the extenders refuse a node with a stale heartbeat.
	msg := h.WaitUnschedulable(t, "only-h100")
	if !strings.Contains(msg, "Insufficient "+api.ResourceShare) && !strings.Contains(msg, "inventory is stale") {
		t.Errorf("only-h100 is refused with %q, want a reason naming the missing shares or the stale inventory", msg)
	}
	t.Logf("only-h100 refused while the agent is down: %s", msg)
	m.placedOn(t, map[string]string{"any-gpu": NodeA100})
	t.Logf("agent down %.0fs", time.Since(stopped).Seconds())

	m.StartAgent(t, NodeH100)
	m.placedOn(t, map[string]string{"only-h100": NodeH100})
	// The pod deleted while the agent was down: no sandbox event told it, so its hold goes once the
	// API server has no such pod and two kubelet lists (10 s apart) lack it (nri.ReleaseUnlisted).
	err := waitFor(time.Minute, 500*time.Millisecond, func() (bool, error) {
		var held []string
		for _, e := range h.LedgerEntries(t) {
			held = append(held, e.Pod)
		}
		slices.Sort(held)
		return strings.Join(held, " ") == "keep only-h100", fmt.Errorf("the H100 agent holds %v, want keep and only-h100", held)
	})
	if err != nil {
		t.Errorf("after the restart: %v\n%s", err, h.Ledger(t))
	}
	if got := h.Assignment(t, h.Pod(t, "keep")).Containers[0].Devices[0]; got != keep {
		t.Errorf("keep's grant changed across the agent's restart: %+v, was %+v", got, keep)
	}
	checkShareCUDA(t, h, "keep", 8<<30)
}

// testMultiNodeNodeLoss: the GPU node running a ReplicaSet's share pods dies outright (kubelet,
// containerd, containers and tessera-node killed). Expectation: once its heartbeat is older than
// inventoryMaxAge the extenders place nothing there (a pod only that node's GPUs fit is refused,
// naming the stale inventory); when the operator force-deletes the dead node's pods (no
// node-lifecycle controller runs here to do it) the ReplicaSet's replacements run on the other GPU
// node; when the node boots again its agent's ledger reconciles with the API: the deleted pods'
// holds are gone and the refused pod runs there.
func testMultiNodeNodeLoss(t *testing.T, m *MultiNode) {
	c := m.Node(t, NodeCPU)
	ctx := context.Background()
	one := int32(1)
	tmpl := shareTemplate("web", "4Gi")
	rs := &appsv1.ReplicaSet{ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: metav1.NamespaceDefault},
		Spec: appsv1.ReplicaSetSpec{Replicas: &one, Selector: &metav1.LabelSelector{MatchLabels: tmpl.Labels}, Template: tmpl}}
	if _, err := m.CP.Client.AppsV1().ReplicaSets(metav1.NamespaceDefault).Create(ctx, rs, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// Before the Reset: a ReplicaSet would recreate the pods it deletes.
	t.Cleanup(func() {
		m.CP.Client.AppsV1().ReplicaSets(metav1.NamespaceDefault).Delete(ctx, "web", metav1.DeleteOptions{})
	})
	first := m.webPods(t, 1)[0]
	dead := first.Spec.NodeName
	other := map[string]string{NodeA100: NodeH100, NodeH100: NodeA100}[dead]
	m.placedOn(t, map[string]string{first.Name: dead})
	t.Logf("web's pod %s runs on %s; killing that node", first.Name, dead)

	killed := time.Now()
	m.KillNode(t, dead)
	time.Sleep(time.Until(killed.Add(multiNodeMaxAge + time.Second)))
	c.CreatePod(t, TestPod("only-dead", map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "4Gi"},
		map[string]string{api.AnnotationGPUModel: m.model(t, dead)}))
	t.Logf("only-dead refused: %s", c.WaitUnschedulable(t, "only-dead", "inventory is stale"))

	// What an operator does for pods of a node that will not answer: delete them without waiting
	// for the kubelet's confirmation.
	zero := int64(0)
	if err := m.CP.Client.CoreV1().Pods(metav1.NamespaceDefault).Delete(ctx, first.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	replaced := time.Now()
	var repl *corev1.Pod
	err := waitFor(2*time.Minute, 300*time.Millisecond, func() (bool, error) {
		for _, p := range m.webPods(t, 1) {
			if p.Name != first.Name && p.Spec.NodeName != "" {
				repl = p
				return true, nil
			}
		}
		return false, fmt.Errorf("no replacement bound")
	})
	if err != nil {
		t.Fatal(err)
	}
	m.placedOn(t, map[string]string{repl.Name: other})
	t.Logf("replacement %s runs on %s %.1fs after the force delete", repl.Name, other, time.Since(replaced).Seconds())

	m.RestartNode(t, dead)
	t.Logf("node %s back %.0fs after it died", dead, time.Since(killed).Seconds())
	m.placedOn(t, map[string]string{"only-dead": dead})
	d := m.Node(t, dead)
	err = waitFor(time.Minute, 300*time.Millisecond, func() (bool, error) {
		var held []string
		for _, e := range d.LedgerEntries(t) {
			held = append(held, e.Pod)
		}
		return len(held) == 1 && held[0] == "only-dead", fmt.Errorf("ledger of %s holds %v, want only-dead alone", dead, held)
	})
	if err != nil {
		t.Errorf("%v\n%s", err, d.Ledger(t))
	}
}

// shareTemplate is the pod template of a controller's share pods labelled app=<app>, each one
// share of memory.
func shareTemplate(app, memory string) corev1.PodTemplateSpec {
	p := TestPod("", map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: memory}, nil)
	p.Labels = map[string]string{"app": app}
	p.Spec.RestartPolicy = corev1.RestartPolicyAlways
	return corev1.PodTemplateSpec{ObjectMeta: p.ObjectMeta, Spec: p.Spec}
}

// webPods waits until the ReplicaSet "web" has n bound pods not being deleted, and returns them.
func (m *MultiNode) webPods(t testing.TB, n int) []*corev1.Pod { return m.boundPods(t, "app=web", n) }

// boundPods waits until exactly n pods matching the label selector are bound and not being
// deleted, and returns them.
func (m *MultiNode) boundPods(t testing.TB, selector string, n int) []*corev1.Pod {
	t.Helper()
	var out []*corev1.Pod
	err := waitFor(2*time.Minute, 300*time.Millisecond, func() (bool, error) {
		l, err := m.CP.Client.CoreV1().Pods(metav1.NamespaceDefault).List(context.Background(), metav1.ListOptions{LabelSelector: selector})
		if err != nil {
			return false, err
		}
		out = nil
		for i := range l.Items {
			if l.Items[i].DeletionTimestamp == nil && l.Items[i].Spec.NodeName != "" {
				out = append(out, &l.Items[i])
			}
		}
		return len(out) == n, fmt.Errorf("%d bound pods %s, want %d", len(out), selector, n)
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// burstPods is the size of the leader-failover burst, each a share of burstShareMemory: 1Gi is small
// enough that memory never stops shares piling onto one GPU, so only placement's share-slot limit
// (GPUState.MaxShares, from NodeInventory.SharesPerGPU) keeps each GPU within the 10 share tokens its
// agent offers (without it the extenders put 26 shares on one A100 and the agent refused the 11th).
const (
	burstPods        = 50
	burstShareMemory = "1Gi"
)

// testMultiNodeLeaderKill: a burst of 50 share pods, and the extender replica holding the leader
// Lease is killed (SIGKILL) once 10 are bound. The second half of the burst is created only after
// the kill: on a fast machine the first half can all be bound before the kill lands, and then
// nothing would be left for the survivor to bind. Expectation: another holder takes the Lease and
// the burst completes: every pod bound once and running (none Failed, no bind refused because the
// pod was bound already), each held once by the agent of the node it is bound to. The time from the
// kill to the first bind of a pod created after it (only a live leader can make that one; a bind
// the dead leader had in flight can land after the kill) is logged as the recovery time. The kubelet
// restarts the killed replica's container at once, advertising a new peer port, so it is a new
// holder as well: whichever replica the Lease goes to is logged.
func testMultiNodeLeaderKill(t *testing.T, m *MultiNode) {
	c := m.Node(t, NodeCPU)
	ctx := context.Background()
	var names []string
	create := func(from, to int) {
		for i := from; i < to; i++ {
			names = append(names, fmt.Sprintf("burst-%02d", i))
			c.CreatePod(t, TestPod(names[i], map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: burstShareMemory}, nil))
		}
	}
	create(0, burstPods/2)
	bound := func() int {
		l, err := m.CP.Client.CoreV1().Pods(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, p := range l.Items {
			if p.Spec.NodeName != "" {
				n++
			}
		}
		return n
	}
	if err := waitFor(2*time.Minute, 100*time.Millisecond, func() (bool, error) { return bound() >= 10, nil }); err != nil {
		t.Fatalf("fewer than 10 of the burst bound: %v", err)
	}
	atKill := bound()
	killed := time.Now()
	holder := m.killLeader(t)
	create(burstPods/2, burstPods)
	afterKill := names[burstPods/2:]
	survivorBound := func() (bool, error) {
		for _, n := range afterKill {
			p, err := m.CP.Client.CoreV1().Pods(metav1.NamespaceDefault).Get(ctx, n, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			if p.Spec.NodeName != "" {
				return true, nil
			}
		}
		return false, fmt.Errorf("none of the %d pods created after the kill is bound", len(afterKill))
	}
	if err := waitFor(2*time.Minute, 100*time.Millisecond, survivorBound); err != nil {
		t.Fatalf("no bind after the leader %s was killed (%d bound at the kill): %v", holder, atKill, err)
	}
	t.Logf("leader %s killed with %d of %d bound; the first bind of a pod created after the kill %.1fs later", holder, atKill, burstPods, time.Since(killed).Seconds())
	var taker string
	err := waitFor(time.Minute, 200*time.Millisecond, func() (bool, error) {
		taker = m.leaseHolder(t)
		return taker != holder, fmt.Errorf("the Lease is still %s's", holder)
	})
	if err != nil {
		t.Fatalf("no replica took the leader Lease over: %v", err)
	}
	t.Logf("%s holds the Lease %.1fs after the kill", taker, time.Since(killed).Seconds())
	pods := c.WaitRunning(t, 5*time.Minute, names...)
	t.Logf("burst complete %.1fs after the kill", time.Since(killed).Seconds())
	held := map[string]string{}
	for _, node := range []string{NodeA100, NodeH100} {
		for _, e := range m.Node(t, node).LedgerEntries(t) {
			if prev, ok := held[e.Pod]; ok {
				t.Errorf("pod %s held by %s and %s", e.Pod, prev, node)
			}
			held[e.Pod] = node
		}
	}
	for _, p := range pods {
		if held[p.Name] != p.Spec.NodeName {
			t.Errorf("pod %s bound to %s, held by %q", p.Name, p.Spec.NodeName, held[p.Name])
		}
		for _, e := range c.Events(t, p.Name, "FailedScheduling") {
			if strings.Contains(e, "already") {
				t.Errorf("pod %s: a second bind was tried: %s", p.Name, e)
			}
		}
	}
}
