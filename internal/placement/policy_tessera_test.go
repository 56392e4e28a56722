package placement

import (
	"math"
	"testing"
)

// restrictedMix has pods restricted to a GPU model in proportion to the models' GPUs (one 2-GPU T4
// node, one 8-GPU G2 node: T4-only 0.1, G2-only 0.4), beside unrestricted 1- and 2-GPU pods.
func restrictedMix() []Shape {
	whole1 := Request{CPUMilli: 4000, Containers: []ContainerShape{{Whole: 1}}}
	whole2 := Request{CPUMilli: 8000, Containers: []ContainerShape{{Whole: 2}}}
	t4, g2 := whole1, whole1
	t4.Models, g2.Models = []string{"T4"}, []string{"G2"}
	return []Shape{{Req: whole1, Weight: 0.4}, {Req: whole2, Weight: 0.1}, {Req: t4, Weight: 0.1}, {Req: g2, Weight: 0.4}}
}

// TestRestrictedShapesStayOffOtherModels pins tessera's measure on a node of a model that some
// shapes may not use: those shapes are no part of it (FGD counts the node's whole free compute as
// their fragment). A T4 node with one free GPU: only the 2-GPU shape (0.1) cannot use it, so 100;
// FGD also counts the G2-only shape's 0.4 x 1000.
func TestRestrictedShapesStayOffOtherModels(t *testing.T) {
	n := katNode{64000, 4000, "T4", []int{-1, 0}}.state()
	if got := NodeFragmentation(n, restrictedMix()); math.Abs(got-500) > 1e-9 {
		t.Fatalf("fgd: %g, want 500 (the 2-GPU shape's 0.1 and the G2-only shape's 0.4 of 1000)", got)
	}
	if got := NodeFragmentationFed(n, restrictedMix()); math.Abs(got-100) > 1e-9 {
		t.Fatalf("tessera: %g, want 100 (the 2-GPU shape's 0.1 x 1000; the G2-only shape cannot come here)", got)
	}
}

// TestRestrictedShapesDoNotPullPods: an unrestricted 1-GPU pod, an empty 2-GPU T4 node and a G2
// node with one GPU left. Filling the G2 node's last GPU leaves no fragment; breaking the T4 node
// leaves one GPU that the 2-GPU shape cannot use. FGD still sends the pod to the T4 node, because
// filling it shrinks the "fragment" the G2-only pods see there (0.4 of the pod's GPU), though they
// can never use that node: with restrictions spread over the models like this, that steers
// unrestricted pods onto the small models and starves the pods restricted to them. tessera fills
// the G2 node, whichever node comes first.
func TestRestrictedShapesDoNotPullPods(t *testing.T) {
	r := Request{CPUMilli: 4000, Containers: []ContainerShape{{Whole: 1}}}
	for _, c := range []struct {
		policy string
		want   string
	}{{"tessera", "g2"}, {"fgd", "t4"}} {
		eng, err := NewEngine(c.policy)
		if err != nil {
			t.Fatal(err)
		}
		for _, t4First := range []bool{true, false} {
			t4 := katNode{64000, 0, "T4", []int{0, 0}}.state()
			g2 := katNode{96000, 28000, "G2", []int{-1, -1, -1, -1, -1, -1, -1, 0}}.state()
			t4.Name, g2.Name = "t4", "g2"
			nodes := []*NodeState{g2, t4}
			if t4First {
				nodes = []*NodeState{t4, g2}
			}
			i, _ := eng.Pick(&ScoreContext{Shapes: restrictedMix()}, nodes, &r, nil)
			if i < 0 || nodes[i].Name != c.want {
				t.Errorf("%s (T4 node first: %t): picked %v, want %s", c.policy, t4First, i, c.want)
			}
		}
	}
}

// TestShareScoredWithoutFloor: a CPU-hungry share (500 compute, 12 CPUs), a CPU-short 4-GPU node
// whose half-used GPU it would fill exactly, and an empty 8-GPU node. Scored with the stranded floor,
// the short node loses (the share's CPU strands more of its free compute than the share takes), so
// the share would open a fresh GPU on the empty node and two GPUs would stay half empty; a share is
// scored without the floor and fills the half-used GPU, whichever node comes first. A whole GPU is
// still scored with the floor: between an 8-GPU node whose free CPU feeds only part of its free
// GPUs and the empty node, where FGD's terms tie, it goes to the empty node even when the short one
// comes first. In a cluster that runs out of CPU or memory before its GPUs (HostBound) the share is
// scored with the floor too, and goes to the empty node.
func TestShareScoredWithoutFloor(t *testing.T) {
	share := Request{CPUMilli: 12000, Containers: []ContainerShape{{Shares: 1, Milli: 500}}}
	whole := katShapes["whole1"]
	node := func(name string, k katNode) *NodeState {
		n := k.state()
		n.Name = name
		return n
	}
	shareShort := katNode{48000, 22000, "V100M16", []int{-1, 500, 0, 0}}
	wholeShort := katNode{96000, 66000, "V100M16", []int{-1, 0, 0, 0, 0, 0, 0, 0}}
	// The share case matters: with the floor, the empty node scores higher.
	eng, err := NewEngine("tessera")
	if err != nil {
		t.Fatal(err)
	}
	score := func(m measure, n *NodeState) float64 {
		sc := &ScoreContext{Shapes: katMix()}
		p, _, u := eng.Evaluate(sc, n, &share)
		if u != nil {
			t.Fatalf("%s: %v", n.Name, u)
		}
		before, after := sc.fragBeforeAfter(m, n, &share, &p)
		return squash(before - after)
	}
	short, empty := node("short", shareShort), node("empty", katNodes["empty8"])
	if s, e := score(measureFed, short), score(measureFed, empty); s >= e {
		t.Fatalf("with the floor the short node scores %v, the empty one %v: the case no longer tells the measures apart", s, e)
	}
	for _, shortFirst := range []bool{true, false} {
		for _, c := range []struct {
			r         *Request
			short     katNode
			hostBound bool
			want      string
		}{{&share, shareShort, false, "short"}, {&whole, wholeShort, false, "empty"}, {&share, shareShort, true, "empty"}} {
			ns := []*NodeState{node("short", c.short), node("empty", katNodes["empty8"])}
			if !shortFirst {
				ns[0], ns[1] = ns[1], ns[0]
			}
			i, p := eng.Pick(&ScoreContext{Shapes: katMix(), HostBound: c.hostBound}, ns, c.r, nil)
			if i < 0 || ns[i].Name != c.want {
				t.Errorf("%d whole, %d shares (short node first: %t, host-bound cluster: %t): picked %v, want the %s node",
					c.r.Containers[0].Whole, c.r.Containers[0].Shares, shortFirst, c.hostBound, i, c.want)
			} else if c.want == "short" && p.Devices[0].GPU != 1 {
				t.Errorf("share (short node first: %t): GPU %d, want the half-used GPU 1", shortFirst, p.Devices[0].GPU)
			}
		}
	}
}
