package e2e

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// multiNodePolicy is the placement policy the chart's extenders run (values.yaml extender.policy).
const multiNodePolicy = api.PolicyTessera

// policyPod is one share pod of the policy check: no GPU model asked, so every GPU of both GPU
// nodes fits it and where it lands is the policy's choice alone.
type policyPod struct {
	name, memory string
	cores        int
	// claim: the share is a DRA claim of the share class (a template without selectors) rather
	// than device-plugin resources. The chart's scheduler configuration sends the extender only
	// pods asking for its managedResources, so the kube-scheduler places a claim-only pod alone
	// (its own scores, the allocator's first fit) and it is not compared; it is part of the state
	// the pods after it meet, which the extender counts from the claim's allocation (--dra-claims)
	// and the engine here from the agent's holdings.
	claim bool
}

// testMultiNodePolicy: share pods that any GPU fits, created one at a time on both GPU nodes, land
// on the node and GPU that tessera-sim's engine (placement.Engine.Pick, the simulator's picker for
// the chart's policy) chooses for the same state: the nodes' published inventories, their agents'
// published holdings, every pod's CPU and memory on its node, and the typical shapes of the GPU
// pods arrived so far. The extender's shape snapshot trails arrivals (with --warm-memo a rebuilt
// snapshot is staged until the warmer promotes it, at most 2 s), so a pod's Filter may be scored
// with or without its own shape: the engine's pick with the current pod's shape counted and its
// pick without it are both accepted (seen live: policy-3 after a claim pod went where the engine
// without its own shape chose). Each pod after the first meets GPUs that differ in what they
// already hold.
// The check is not trivially met: at least one pod's node is a choice (both nodes fit, one scores
// strictly higher), at least one pod's GPU is (distinct candidates on its node, one scoring
// strictly higher), and another policy would have placed at least one pod elsewhere.
func testMultiNodePolicy(t *testing.T, m *MultiNode) {
	c := m.Node(t, NodeCPU)
	eng, err := placement.NewEngine(multiNodePolicy)
	if err != nil {
		t.Fatal(err)
	}
	var others []*placement.Engine
	var otherNames []string
	for _, p := range api.KnownPolicies {
		if p == multiNodePolicy || p == api.PolicyRandom {
			continue
		}
		e, err := placement.NewEngine(p)
		if err != nil {
			t.Fatal(err)
		}
		others, otherNames = append(others, e), append(otherNames, p)
	}
	pods := []policyPod{{"policy-1", "10Gi", 30, false}, {"policy-2", "4Gi", 20, false}, {"policy-claim", "8Gi", 20, true},
		{"policy-3", "30Gi", 60, false}, {"policy-4", "10Gi", 30, false}, {"policy-5", "6Gi", 10, false}}
	var arrived []*placement.Request
	nodeChoices, gpuChoices := 0, 0
	differs := map[string]string{} // policy -> the first pod it would place otherwise, and where
	for _, p := range pods {
		mem := resource.MustParse(p.memory)
		share := placement.ContainerShape{Name: "main", Shares: 1, Memory: mem.Value(), Milli: p.cores * 10}
		if p.claim {
			// The pod's container asks for no GPU itself; its claim's request is its one shape
			// (docs/placement.md, "Placement under DRA").
			share.Name = "resourceclaim/gpu/gpu"
		}
		req := &placement.Request{Key: metav1.NamespaceDefault + "/" + p.name, Containers: []placement.ContainerShape{share}}
		arrived = append(arrived, req)
		if p.claim {
			c.CreateClaimTemplate(t, p.name, classShare, map[string]string{"memory": p.memory, "compute": fmt.Sprint(p.cores)}, "")
			c.CreatePod(t, ClaimPod(p.name, p.name))
			got := c.WaitRunning(t, 3*time.Minute, p.name)[0]
			var on []string
			for _, r := range c.PodClaim(t, p.name).Status.Allocation.Devices.Results {
				on = append(on, r.Pool+"/"+r.Device)
			}
			t.Logf("%s (claim %s, %d%%): the scheduler alone placed it on %s, the allocator on %v", p.name, p.memory, p.cores, got.Spec.NodeName, on)
			m.waitHolds(t, got.Spec.NodeName, p.name)
			continue
		}
		nodes := m.policyStates(t)
		sc := policyContext(nodes, arrived)
		i, want := eng.Pick(sc, nodes, req, nil)
		if i < 0 {
			t.Fatalf("%s: the engine places it nowhere", p.name)
		}
		node := nodes[i]
		wantUUID := node.GPUs[want.Devices[0].GPU].UUID
		// The pick on the snapshot that does not count this pod yet.
		trailNode, trailUUID := node.Name, wantUUID
		if k, tp := eng.Pick(policyContext(nodes, arrived[:len(arrived)-1]), nodes, req, nil); k >= 0 {
			trailNode, trailUUID = nodes[k].Name, nodes[k].GPUs[tp.Devices[0].GPU].UUID
		}
		// Whether the choice was one, and whether other policies choose otherwise.
		if isNodeChoice(eng, sc, nodes, i, req) {
			nodeChoices++
		}
		if isGPUChoice(eng, policyContext(nodes, arrived), node, req) {
			gpuChoices++
		}
		for k, o := range others {
			// Another policy tells itself apart only where it differs from both accepted picks.
			j, op := o.Pick(policyContext(nodes, arrived), nodes, req, nil)
			if _, seen := differs[otherNames[k]]; seen || j < 0 {
				continue
			}
			if on, uuid := nodes[j].Name, nodes[j].GPUs[op.Devices[0].GPU].UUID; (on != node.Name || uuid != wantUUID) && (on != trailNode || uuid != trailUUID) {
				differs[otherNames[k]] = fmt.Sprintf("%s on %s GPU %s", p.name, on, uuid)
			}
		}

		c.CreatePod(t, TestPod(p.name, map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: p.memory,
			api.ResourceShareCores: fmt.Sprint(p.cores)}, nil))
		got := c.WaitRunning(t, 3*time.Minute, p.name)[0]
		var gotUUIDs []string
		if a := c.Assignment(t, got); a != nil {
			for _, ca := range a.Containers {
				for _, d := range ca.Devices {
					gotUUIDs = append(gotUUIDs, d.UUID)
				}
			}
		}
		t.Logf("%s (%s, %d%%): extender %s %v; %s engine %s %s (without its own shape: %s %s)", p.name, p.memory, p.cores, got.Spec.NodeName, gotUUIDs,
			multiNodePolicy, node.Name, wantUUID, trailNode, trailUUID)
		matches := func(n, uuid string) bool { return got.Spec.NodeName == n && len(gotUUIDs) == 1 && gotUUIDs[0] == uuid }
		if !matches(node.Name, wantUUID) && !matches(trailNode, trailUUID) {
			t.Fatalf("%s: the extender placed it on %s GPU %v; the %s policy (tessera-sim's engine) on the same state chooses %s GPU %s (%s GPU %s without the pod's own shape)\n%s",
				p.name, got.Spec.NodeName, gotUUIDs, multiNodePolicy, node.Name, wantUUID, trailNode, trailUUID, m.describeStates(nodes))
		}
		// The next pod's state: the agent has published this hold.
		m.waitHolds(t, got.Spec.NodeName, p.name)
	}
	if nodeChoices == 0 || gpuChoices == 0 {
		t.Errorf("the check met no real choice: %d pods with a node chosen over another that fits, %d with a GPU chosen over a distinct one; change the pods", nodeChoices, gpuChoices)
	}
	if len(differs) == 0 {
		t.Errorf("every other policy (%s) places these pods as %s does: the check cannot tell the policies apart; change the pods", strings.Join(otherNames, ", "), multiNodePolicy)
	}
	t.Logf("%d of %d pods had a node choice, %d a GPU choice; where other policies choose otherwise first: %v", nodeChoices, len(pods), gpuChoices, differs)
}

// policyContext is the score context of the simulator for the arrived requests on nodes: the
// typical shapes learned from them and the model pressure read from the nodes' free compute.
func policyContext(nodes []*placement.NodeState, arrived []*placement.Request) *placement.ScoreContext {
	st := placement.NewShapeStats()
	for _, r := range arrived {
		st.Observe(r, 1)
	}
	for _, n := range nodes {
		st.AddNodeFree(n, 1)
	}
	return st.ScoreContext()
}

// isNodeChoice reports whether nodes[best] fits req and scores strictly above every other node
// that fits it, at least one other fitting.
func isNodeChoice(eng *placement.Engine, sc *placement.ScoreContext, nodes []*placement.NodeState, best int, req *placement.Request) bool {
	_, top, u := eng.Evaluate(sc, nodes[best], req)
	if u != nil {
		return false
	}
	rivals := 0
	for i, n := range nodes {
		if i == best {
			continue
		}
		if _, s, u := eng.Evaluate(sc, n, req); u == nil {
			rivals++
			if s >= top-placement.ScoreEpsilon {
				return false
			}
		}
	}
	return rivals > 0
}

// isGPUChoice reports whether req has distinct candidate placements on n and the policy's best
// scores strictly above every other.
func isGPUChoice(eng *placement.Engine, sc *placement.ScoreContext, n *placement.NodeState, req *placement.Request) bool {
	cands, u := placement.Candidates(n, req)
	if u != nil || len(cands) < 2 {
		return false
	}
	pol := eng.PolicyFor(req)
	var scores []float64
	for i := range cands {
		scores = append(scores, pol.Score(sc, n, req, &cands[i]))
	}
	slices.Sort(scores)
	return scores[len(scores)-1] > scores[len(scores)-2]+placement.ScoreEpsilon
}

// policyStates builds every node's placement state as an extender sees it from the API server,
// in name order (the extender's pick-one breaks ties by the smaller name, the engine by list
// order): the GPUs of the inventory the node publishes, what its agent's published holdings hold
// on them, and the node's allocatable CPU and memory less what the pods bound there request.
func (m *MultiNode) policyStates(t *testing.T) []*placement.NodeState {
	t.Helper()
	ctx := context.Background()
	nl, err := m.CP.Client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pl, err := m.CP.Client.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var out []*placement.NodeState
	for i := range nl.Items {
		node := &nl.Items[i]
		inv := &api.NodeInventory{Node: node.Name}
		if raw, ok := node.Annotations[api.AnnotationInventory]; ok {
			if inv, err = api.DecodeInventory([]byte(raw)); err != nil {
				t.Fatalf("node %s's inventory: %v", node.Name, err)
			}
		}
		n := placement.NewNodeState(inv, node.Labels)
		n.CPUMilli, n.MemMiB = node.Status.Allocatable.Cpu().MilliValue(), node.Status.Allocatable.Memory().Value()>>20
		if raw, ok := node.Annotations[api.AnnotationHoldings]; ok {
			h, err := api.DecodeHoldings([]byte(raw))
			if err != nil {
				t.Fatalf("node %s's holdings: %v", node.Name, err)
			}
			for _, ph := range h.Pods {
				var p placement.Placement
				for ci, ca := range ph.Containers {
					for _, d := range ca.Devices {
						g := n.GPUIndexByUUID(d.UUID)
						if g < 0 {
							t.Fatalf("node %s holds GPU %s for %s, not in its inventory", node.Name, d.UUID, ph.Pod)
						}
						p.Devices = append(p.Devices, placement.Device{Container: ci, GPU: g, Whole: d.Whole, Memory: d.MemoryBytes, Milli: d.CoresPercent * 10})
					}
				}
				n.Apply(&placement.Request{}, &p)
			}
		}
		for j := range pl.Items {
			if p := &pl.Items[j]; p.Spec.NodeName == node.Name && p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed {
				n.AddUse(podRequests(p))
			}
		}
		out = append(out, n)
	}
	slices.SortFunc(out, func(a, b *placement.NodeState) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// podRequests is the CPU (millicores) and memory (MiB, rounded up) the scheduler counts for a pod:
// its containers' requests, or an init container's when larger, plus the pod's overhead.
func podRequests(p *corev1.Pod) (int64, int64) {
	var cpu, mem int64
	for _, c := range p.Spec.Containers {
		cpu += c.Resources.Requests.Cpu().MilliValue()
		mem += c.Resources.Requests.Memory().Value()
	}
	for _, c := range p.Spec.InitContainers {
		cpu = max(cpu, c.Resources.Requests.Cpu().MilliValue())
		mem = max(mem, c.Resources.Requests.Memory().Value())
	}
	cpu += p.Spec.Overhead.Cpu().MilliValue()
	mem += p.Spec.Overhead.Memory().Value()
	return cpu, (mem + 1<<20 - 1) >> 20
}

// describeStates lists what each node's GPUs hold in the engine's state (a failure's evidence).
func (m *MultiNode) describeStates(nodes []*placement.NodeState) string {
	var b strings.Builder
	for _, n := range nodes {
		fmt.Fprintf(&b, "%s (cpu %d/%dm, mem %d/%dMi):\n", n.Name, n.UsedCPU, n.CPUMilli, n.UsedMem, n.MemMiB)
		for _, g := range n.GPUs {
			fmt.Fprintf(&b, "  %s %s usable=%t whole=%t shares=%d milli=%d mem=%d/%d\n", g.UUID, g.Model, g.Usable, g.Whole, g.Shares, g.UsedMilli, g.UsedMemory, g.Memory)
		}
	}
	return b.String()
}
