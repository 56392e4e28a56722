package placement

import "testing"

// TestHostBoundFollowsCapacity: the snapshot says the cluster is host-bound once its CPU per GPU
// falls below what the GPU pods' mix asks (whole-GPU pods of 12 CPUs per GPU), and a change of
// that verdict makes a new snapshot (so that remembered outcomes of the old one are not reused).
func TestHostBoundFollowsCapacity(t *testing.T) {
	st := NewShapeStats()
	whole := Request{CPUMilli: 12000, Containers: []ContainerShape{{Whole: 1}}}
	for range 10 {
		st.Observe(&whole, 1)
	}
	rich := katNode{96000, 0, "A", []int{0, 0, 0, 0, 0, 0, 0, 0}}.state() // 12 CPUs per GPU: exactly the mix
	st.AddNodeFree(rich, 1)
	sc := st.ScoreContext()
	if sc.HostBound {
		t.Fatal("a cluster with the CPU per GPU the mix asks is not host-bound")
	}
	poor := katNode{32000, 0, "A", []int{0, 0, 0, 0}}.state() // 8 CPUs per GPU
	st.AddNodeFree(poor, 1)
	sc2 := st.ScoreContext()
	if !sc2.HostBound || sc2.Snapshot == sc.Snapshot {
		t.Fatalf("with a CPU-poor node added: host-bound %t, snapshot %d (was %d); want host-bound in a new snapshot", sc2.HostBound, sc2.Snapshot, sc.Snapshot)
	}
	st.AddNodeFree(poor, -1)
	if sc3 := st.ScoreContext(); sc3.HostBound || sc3.Snapshot == sc2.Snapshot {
		t.Fatalf("with the CPU-poor node gone: host-bound %t, snapshot %d (was %d)", sc3.HostBound, sc3.Snapshot, sc2.Snapshot)
	}
	// Usage moves nothing: the verdict reads capacity.
	half := katNode{96000, 90000, "A", []int{-1, -1, -1, -1, 0, 0, 0, 0}}.state()
	st.AddNodeFree(rich, -1)
	st.AddNodeFree(half, 1)
	if st.ScoreContext().HostBound {
		t.Fatal("host-bound after a node's usage changed; only capacity counts")
	}
}
