package simulate

import (
	"fmt"
	"slices"
	"testing"
)

// TestNodeOrderPerSeed checks the reference's protocol: every seed sees the nodes in its own
// permutation (ties fall differently), the same seed always in the same one.
func TestNodeOrderPerSeed(t *testing.T) {
	var nodes []Node
	for i := range 50 {
		nodes = append(nodes, Node{Name: fmt.Sprintf("n%02d", i), CPUMilli: 1000, GPUs: 1, Model: "A"})
	}
	c := NewCluster(nodes, nil)
	names := func(seed uint64) []string {
		var out []string
		for _, n := range c.buildNodes(seed) {
			out = append(out, n.Name)
		}
		return out
	}
	a, b := names(42), names(43)
	if slices.Equal(a, b) {
		t.Fatal("seeds 42 and 43 order the nodes the same")
	}
	if !slices.Equal(a, names(42)) {
		t.Fatal("one seed gives two orders")
	}
	sorted := slices.Clone(a)
	slices.Sort(sorted)
	for i, n := range sorted {
		if n != nodes[i].Name {
			t.Fatalf("not a permutation of the nodes: %v", a)
		}
	}
}

// TestCheckpointAsReference: the reference averages the allocation ratio (rounded to 2 decimals) of
// the arrivals whose arrived workload rounds to the point, and falls back to +-1 of it.
func TestCheckpointAsReference(t *testing.T) {
	k := checkpoint{at: 100}
	k.record(99.4, 90)     // rounds to 99: not this point
	k.record(99.6, 95.004) // 100: 95.00
	k.record(100.49, 95.5) // 100
	k.record(100.6, 96)    // 101: not this point
	if u, ok := k.unallocated(); !ok || u != 100-95.25 {
		t.Fatalf("unallocated %v %v, want %v", u, ok, 100-95.25)
	}
	k = checkpoint{at: 100}
	k.record(98.8, 90) // 99, within +-1
	k.record(101.2, 92)
	if u, ok := k.unallocated(); !ok || u != 9 {
		t.Fatalf("fallback unallocated %v %v, want 9", u, ok)
	}
}

// TestArrivalsInflateAsReference: resampling stops at the first sampled pod whose GPU request would
// take the total past inflate x capacity (tuneUpPods).
func TestArrivalsInflateAsReference(t *testing.T) {
	c := NewCluster([]Node{{Name: "n", GPUs: 10, Model: "A"}}, []Pod{{Name: "a", NumGPU: 1, GPUMilli: 1000}, {Name: "b", NumGPU: 1, GPUMilli: 300}})
	for seed := range uint64(20) {
		var total int
		for _, p := range c.Arrivals(seed, 1.3) {
			total += p.GPURequest()
		}
		if total > 13000 || total < 13000-1000 {
			t.Fatalf("seed %d: arrived GPU request %d, want within (12000, 13000]", seed, total)
		}
	}
}

// TestRunReportsPackingFloor: the run reports, at the 100% checkpoint, the packing floor of the
// shares placed by then, and what they really leave free is never below it.
func TestRunReportsPackingFloor(t *testing.T) {
	var nodes []Node
	for i := range 4 {
		nodes = append(nodes, Node{Name: fmt.Sprintf("n%d", i), CPUMilli: 64000, MemMiB: 1 << 20, GPUs: 2, Model: "A"})
	}
	// 600s never share a GPU: each leaves 400 free whatever the policy.
	pods := []Pod{{Name: "s", CPUMilli: 1000, NumGPU: 1, GPUMilli: 600}, {Name: "w", CPUMilli: 1000, NumGPU: 1, GPUMilli: 1000}}
	c := NewCluster(nodes, pods)
	for _, policy := range []string{"tessera", "fgd"} {
		res, err := c.Run(policy, 42, 1.3)
		if err != nil {
			t.Fatal(err)
		}
		floor, partial := res.Free100["floor"], res.Free100["partial"]
		if floor == 0 || floor%400 != 0 || partial < floor {
			t.Fatalf("%s: floor %d, partial %d: want a positive multiple of 400, at most partial", policy, floor, partial)
		}
	}
}

// TestRunProtectsRestrictedModels: a fifth of the GPUs are T4 and pods restricted to T4 ask for a
// fifth of the request. Unrestricted pods must leave the T4 GPUs to them (the model pressure), so
// that at 100% arrived next to nothing is unallocated, under the paper's protocol and with shapes
// learned online; the restricted pods fail only where their own model is full.
func TestRunProtectsRestrictedModels(t *testing.T) {
	var nodes []Node
	for i := range 10 {
		nodes = append(nodes, Node{Name: fmt.Sprintf("t4-%d", i), CPUMilli: 64000, MemMiB: 1 << 20, GPUs: 2, Model: "T4"},
			Node{Name: fmt.Sprintf("g2-%d", i), CPUMilli: 96000, MemMiB: 1 << 20, GPUs: 8, Model: "G2"})
	}
	var pods []Pod
	for i := range 10 {
		p := Pod{Name: fmt.Sprintf("p%d", i), CPUMilli: 4000, MemMiB: 1024, NumGPU: 1, GPUMilli: 1000}
		if i < 2 {
			p.Models = []string{"T4"}
		}
		pods = append(pods, p)
	}
	for _, oracle := range []bool{true, false} {
		c := NewCluster(nodes, pods)
		if oracle {
			c.UseOracleShapes()
		}
		var worst float64
		for seed := uint64(42); seed < 46; seed++ {
			res, err := c.Run("tessera", seed, 1.3)
			if err != nil {
				t.Fatal(err)
			}
			worst = max(worst, res.Unallocated[len(res.Unallocated)-1])
		}
		t.Logf("oracle shapes %t: worst unallocated at 100%%: %.2f", oracle, worst)
		if worst > 3 {
			t.Errorf("oracle shapes %t: %.2f%% unallocated at 100%% (seeds 42..45), want at most 3", oracle, worst)
		}
	}
}
