package placement

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
)

func twoGPUNode() *NodeState {
	n := &NodeState{Name: "n", CPUMilli: 8000, MemMiB: 1 << 14}
	for i := range 2 {
		n.GPUs = append(n.GPUs, GPUState{Index: i, Model: "T4", Usable: true, Memory: 16 << 30})
	}
	return n
}

// TestReleaseUndoesApply: Release is Apply's inverse even when a state briefly counts two holders of
// one whole GPU (the extender's state did, and releasing one holder freed the GPU the other held).
func TestReleaseUndoesApply(t *testing.T) {
	n := twoGPUNode()
	p := Placement{Devices: []Device{{GPU: 0, Whole: true}}}
	n.Apply(&Request{}, &p)
	n.Apply(&Request{}, &p)
	n.Release(&Request{}, &p)
	if n.GPUs[0].FreeWhole() {
		t.Fatal("GPU 0 is free while one of its two holders is still applied")
	}
	n.Release(&Request{}, &p)
	if !n.GPUs[0].FreeWhole() {
		t.Fatal("GPU 0 is held after both holders were released")
	}
}

// TestFits checks a given placement against the node as it is now.
func TestFits(t *testing.T) {
	whole := &Request{Containers: []ContainerShape{{Name: "c", Whole: 1}}, CPUMilli: 1000}
	share := &Request{Containers: []ContainerShape{{Name: "c", Shares: 1, Milli: 600, Memory: 8 << 30}}}
	onGPU0 := &Placement{Devices: []Device{{GPU: 0, Whole: true}}}
	share0 := &Placement{Devices: []Device{{GPU: 0, Milli: 600, Memory: 8 << 30}}}
	cases := []struct {
		name  string
		setup func(n *NodeState)
		r     *Request
		p     *Placement
		want  bool
	}{
		{"free whole GPU", func(*NodeState) {}, whole, onGPU0, true},
		{"whole GPU taken", func(n *NodeState) { n.Apply(&Request{}, onGPU0) }, whole, onGPU0, false},
		{"whole GPU in share mode", func(n *NodeState) { n.Apply(&Request{}, share0) }, whole, onGPU0, false},
		{"GPU unhealthy", func(n *NodeState) { n.GPUs[0].Usable = false }, whole, onGPU0, false},
		{"model not allowed", func(*NodeState) {}, &Request{Containers: whole.Containers, Models: []string{"A100"}}, onGPU0, false},
		{"model excluded", func(*NodeState) {}, &Request{Containers: whole.Containers, ExcludeModels: []string{"T4"}}, onGPU0, false},
		{"another model excluded", func(*NodeState) {}, &Request{Containers: whole.Containers, ExcludeModels: []string{"A100"}}, onGPU0, true},
		{"included and another excluded", func(*NodeState) {}, &Request{Containers: whole.Containers, Models: []string{"T4"}, ExcludeModels: []string{"A100"}}, onGPU0, true},
		{"CPU spent", func(n *NodeState) { n.UsedCPU = 7500 }, whole, onGPU0, false},
		{"wrong device count", func(*NodeState) {}, &Request{Containers: []ContainerShape{{Name: "c", Whole: 2}}}, onGPU0, false},
		{"share without room", func(n *NodeState) { n.Apply(&Request{}, share0) }, share, share0, false},
		{"share on a fresh GPU", func(*NodeState) {}, share, share0, true},
		{"share on a whole GPU", func(n *NodeState) { n.Apply(&Request{}, onGPU0) }, share, share0, false},
		{"GPU out of range", func(*NodeState) {}, whole, &Placement{Devices: []Device{{GPU: 2, Whole: true}}}, false},
	}
	for _, c := range cases {
		n := twoGPUNode()
		c.setup(n)
		if got := Fits(n, c.r, c.p); got != c.want {
			t.Errorf("%s: Fits = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestUnfitNamesTheResource: a MIG or mdev shortfall names the resource the pod asked for, as the
// user wrote it (an attribute profile's "+" is "." in the resource name).
func TestUnfitNamesTheResource(t *testing.T) {
	n := twoGPUNode()
	for _, c := range []struct {
		shape ContainerShape
		want  string
	}{
		{ContainerShape{Name: "c", MIG: map[string]int{"1g.10gb+me": 1}}, "asks for 1 nvidia.com/mig-1g.10gb.me,"},
		{ContainerShape{Name: "c", Mdev: map[string]int{"A100-4C": 2}}, "asks for 2 tessera.dev/mdev-A100-4C,"},
	} {
		_, u := Candidates(n, &Request{Containers: []ContainerShape{c.shape}})
		if u == nil || !strings.Contains(u.Msg, c.want) {
			t.Errorf("unfit = %v, want it to contain %q", u, c.want)
		}
	}
}

// TestUsageDigest: the usage digest of a tracked node is a function of its usage: placements and
// CPU/memory applied in any order and released again give the digest back, equal usage reached
// different ways gives equal digests, and different usage gives different ones; scratch copies are
// not tracked (their digest says nothing).
func TestUsageDigest(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	type step struct {
		r Request
		p Placement
	}
	draw := func() step {
		var s step
		s.r.CPUMilli, s.r.MemMiB = int64(rng.IntN(4))*500, int64(rng.IntN(3))*1024
		for g := range 2 {
			switch rng.IntN(3) {
			case 0:
				s.p.Devices = append(s.p.Devices, Device{GPU: g, Whole: true})
			case 1:
				s.p.Devices = append(s.p.Devices, Device{GPU: g, Milli: 100 * (1 + rng.IntN(5)), Memory: int64(1+rng.IntN(4)) << 30})
			}
		}
		return s
	}
	usage := func(n *NodeState) string { // everything the digest stands for
		return fmt.Sprint(n.UsedCPU, n.UsedMem, n.GPUs[0].wholeApplied, n.GPUs[0].Shares, n.GPUs[0].UsedMilli, n.GPUs[0].UsedMemory,
			n.GPUs[1].wholeApplied, n.GPUs[1].Shares, n.GPUs[1].UsedMilli, n.GPUs[1].UsedMemory)
	}
	seen := map[uint64]string{}
	record := func(n *NodeState) {
		u := usage(n)
		if prev, ok := seen[n.UsageDigest()]; ok && prev != u {
			t.Fatalf("digest %x for usage %s and %s", n.UsageDigest(), prev, u)
		}
		seen[n.UsageDigest()] = u
	}
	for iter := range 300 {
		a, b := twoGPUNode(), twoGPUNode()
		a.TrackUsage()
		b.TrackUsage()
		if a.UsageDigest() != 0 {
			t.Fatalf("fresh node digest %x, want 0", a.UsageDigest())
		}
		steps := []step{draw(), draw(), draw()}
		for _, s := range steps {
			a.Apply(&s.r, &s.p)
			record(a)
		}
		extra := int64(rng.IntN(3)) * 250
		a.AddUse(extra, 0)
		record(a)
		for _, i := range rng.Perm(len(steps)) { // same usage, another order
			b.Apply(&steps[i].r, &steps[i].p)
			record(b)
		}
		b.AddUse(extra, 0)
		if a.UsageDigest() != b.UsageDigest() {
			t.Fatalf("iter %d: same usage %s, digests %x and %x", iter, usage(a), a.UsageDigest(), b.UsageDigest())
		}
		if c := a.Clone(); c.tracked {
			t.Fatal("a clone is tracked")
		}
		a.AddUse(-extra, 0)
		for _, i := range rng.Perm(len(steps)) {
			a.Release(&steps[i].r, &steps[i].p)
			record(a)
		}
		if a.UsageDigest() != 0 {
			t.Fatalf("iter %d: everything released, digest %x, want 0", iter, a.UsageDigest())
		}
	}
	if len(seen) < 100 {
		t.Fatalf("only %d distinct usages drawn: the test proves little", len(seen))
	}
}
