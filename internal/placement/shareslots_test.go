package placement

import (
	"strings"
	"testing"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// slotNode is a node of two 40 GiB GPUs whose agent offers per share tokens per GPU.
func slotNode(per int) *NodeState {
	inv := &api.NodeInventory{APIVersion: api.Version, Node: "n", SharesPerGPU: per}
	for i := range 2 {
		inv.GPUs = append(inv.GPUs, api.GPU{UUID: "GPU-" + string(rune('a'+i)), Index: i, Model: "A100", MemoryBytes: 40 << 30,
			ComputeCapability: "8.0", Healthy: true})
	}
	return NewNodeState(inv, nil)
}

// smallShare is a share far from filling a GPU's compute or memory: only the share count can stop it.
func smallShare(containers int) *Request {
	r := &Request{}
	for range containers {
		r.Containers = append(r.Containers, ContainerShape{Name: "c", Shares: 1, Milli: 10, Memory: 1 << 30})
	}
	return r
}

func shareOn(gpu int) *Placement {
	return &Placement{Devices: []Device{{GPU: gpu, Milli: 10, Memory: 1 << 30}}}
}

// TestShareSlotLimit: a GPU holding the SharesPerGPU shares its agent offers takes no more (the
// agent refuses the next container), however much compute and memory it has left; the next GPU
// does, and releasing a share frees its slot again.
func TestShareSlotLimit(t *testing.T) {
	n := slotNode(2)
	if n.GPUs[0].MaxShares != 2 {
		t.Fatalf("MaxShares = %d, want the inventory's SharesPerGPU 2", n.GPUs[0].MaxShares)
	}
	one := smallShare(1)
	n.Apply(one, shareOn(0))
	n.Apply(one, shareOn(0))
	gpus := func(cands []Placement) []int {
		var out []int
		for _, p := range cands {
			out = append(out, p.Devices[0].GPU)
		}
		return out
	}
	cands, u := Candidates(n, one)
	if u != nil || len(cands) != 1 || cands[0].Devices[0].GPU != 1 {
		t.Fatalf("with GPU 0 at its limit: candidates on GPUs %v (%v), want only GPU 1", gpus(cands), u)
	}
	if Fits(n, one, shareOn(0)) {
		t.Fatal("Fits accepts a share on a GPU at its share limit")
	}
	// Two shares of one container (multiShare) need two GPUs with a slot.
	if _, u := Candidates(n, &Request{Containers: []ContainerShape{{Name: "c", Shares: 2, Milli: 10, Memory: 1 << 30}}}); u == nil {
		t.Fatal("two shares placed although only GPU 1 has a slot")
	}
	n.Apply(one, shareOn(1))
	n.Apply(one, shareOn(1))
	_, u = Candidates(n, one)
	if u == nil || !strings.Contains(u.Msg, "most shares the node offers per GPU (2)") {
		t.Fatalf("all GPUs at their limit: unfit %v, want a reason naming the limit of 2", u)
	}
	n.Release(one, shareOn(0))
	if cands, u := Candidates(n, one); u != nil || len(cands) != 1 || cands[0].Devices[0].GPU != 0 {
		t.Fatalf("after a release on GPU 0: candidates on GPUs %v (%v), want GPU 0", gpus(cands), u)
	}
	if !Fits(n, one, shareOn(0)) {
		t.Fatal("Fits refuses the slot a release freed")
	}
}

// TestShareSlotLimitAcrossContainers: shares of several containers on one GPU each take a slot
// (greedy and Fits count them together).
func TestShareSlotLimitAcrossContainers(t *testing.T) {
	n := slotNode(1)
	n.GPUs = n.GPUs[:1]
	n.Prepare()
	two := smallShare(2)
	if cands, u := Candidates(n, two); u == nil {
		t.Fatalf("two containers' shares placed on one GPU offering one slot: %v", cands)
	}
	both := &Placement{Devices: []Device{{Container: 0, GPU: 0, Milli: 10, Memory: 1 << 30}, {Container: 1, GPU: 0, Milli: 10, Memory: 1 << 30}}}
	if Fits(n, two, both) {
		t.Fatal("Fits accepts two shares on a GPU with one slot")
	}
}

// TestShareSlotsNotInterchangeable: two GPUs of equal usage but different slots left are both
// offered (a single-share candidate list that merged them would score one for the other).
func TestShareSlotsNotInterchangeable(t *testing.T) {
	n := slotNode(3)
	n.Apply(&Request{}, &Placement{Devices: []Device{{GPU: 0, Milli: 20, Memory: 2 << 30}}})
	n.Apply(&Request{}, &Placement{Devices: []Device{{GPU: 1, Milli: 10, Memory: 1 << 30}}})
	n.Apply(&Request{}, &Placement{Devices: []Device{{GPU: 1, Milli: 10, Memory: 1 << 30}}})
	if cands, u := Candidates(n, smallShare(1)); u != nil || len(cands) != 2 {
		t.Fatalf("got %d candidates (%v), want one per GPU", len(cands), u)
	}
}

// TestNoShareLimitByDefault: a node state without a limit (the simulator's) takes any number of shares.
func TestNoShareLimitByDefault(t *testing.T) {
	n := twoGPUNode()
	for range 50 {
		n.Apply(&Request{}, &Placement{Devices: []Device{{GPU: 0, Milli: 1}}})
	}
	if cands, u := Candidates(n, &Request{Containers: []ContainerShape{{Name: "c", Shares: 1, Milli: 1, Memory: 1 << 30}}}); u != nil || len(cands) != 2 {
		t.Fatalf("got %d candidates (%v), want both GPUs", len(cands), u)
	}
}
