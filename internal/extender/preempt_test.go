package extender

import (
	"testing"

	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestPreemptKeepsOnlyNodesWhereVictimsFreeTheRightGPU: two shares hold 60% of GPU 0 and GPU 1 on a
// 2-GPU node; evicting the share on GPU 0 alone frees no whole GPU, evicting both does.
func TestPreemptKeepsOnlyNodesWhereVictimsFreeTheRightGPU(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	for i, n := range []string{"n1", "n2"} {
		x.State.UpsertNode(testNode(testInventory(n, i+1, 2, "T4"), nil))
	}
	var victims []string
	for i, n := range []string{"n1", "n2"} {
		for g := range 2 {
			p := assigned(sharePod(n+"-s"+string(rune('0'+g)), 1, 2, 60), n,
				api.DeviceAssignment{UUID: gpuUUID(i+1, g), MemoryBytes: 2 << 30, CoresPercent: 60})
			x.State.UpsertPod(p, x.Class)
			victims = append(victims, string(p.UID))
		}
	}
	args := &extenderv1.ExtenderPreemptionArgs{Pod: wholePod("big", 1), NodeNameToMetaVictims: map[string]*extenderv1.MetaVictims{
		"n1": {Pods: []*extenderv1.MetaPod{{UID: victims[0]}}},                    // frees GPU 0 only
		"n2": {Pods: []*extenderv1.MetaPod{{UID: victims[2]}, {UID: victims[3]}}}, // frees both GPUs
	}}
	res := x.Preempt(args)
	if _, ok := res.NodeNameToMetaVictims["n2"]; !ok {
		t.Fatalf("n2's victims free two GPUs, node dropped: %v", res.NodeNameToMetaVictims)
	}
	if _, ok := res.NodeNameToMetaVictims["n1"]; !ok {
		t.Fatalf("n1's victim frees GPU 0, node dropped: %v", res.NodeNameToMetaVictims)
	}
	args.Pod = wholePod("bigger", 2)
	res = x.Preempt(args)
	if _, ok := res.NodeNameToMetaVictims["n1"]; ok {
		t.Fatal("n1 kept: evicting one share frees one GPU, the preemptor needs two")
	}
	if _, ok := res.NodeNameToMetaVictims["n2"]; !ok {
		t.Fatal("n2 dropped although its victims free both GPUs")
	}
}
