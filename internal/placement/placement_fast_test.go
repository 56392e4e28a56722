package placement

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// TestFastPathsMatchGreedy checks that the allocation-free paths (several shares of one container,
// arena memory, no explanation) choose exactly what the general greedy placer chooses.
func TestFastPathsMatchGreedy(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var a arena
	for iter := 0; iter < 2000; iter++ {
		n := &NodeState{CPUMilli: 64000, MemMiB: 1 << 20}
		n.GPUs = randomGPUs(rng, "A")
		r := &Request{Containers: []ContainerShape{{Name: "c", Shares: 2 + rng.IntN(3), Milli: 100 * rng.IntN(10), Memory: int64(1+rng.IntN(4)) << 30}}}
		if checkStatic(n, r, true) != nil {
			continue // greedy is only reached past the static checks
		}
		want, wu := greedy(n, r, true)
		a.reset()
		got, gu := candidates(&a, n, r, false)
		if (wu == nil) != (gu == nil) {
			t.Fatalf("iter %d: fit differs: greedy %v, fast %v", iter, wu, gu)
		}
		if len(want) != len(got) {
			t.Fatalf("iter %d: %d candidates from greedy, %d from the fast path", iter, len(want), len(got))
		}
		for i := range want {
			if !slices.Equal(want[i].Devices, got[i].Devices) {
				t.Fatalf("iter %d candidate %d: greedy %v, fast %v", iter, i, want[i].Devices, got[i].Devices)
			}
		}
		if _, u := Candidates(n, r); (u == nil) != (wu == nil) || (u != nil && u.Msg != wu.Msg) {
			t.Fatalf("iter %d: explained unfit %v, greedy %v", iter, u, wu)
		}
	}
}

// TestShapeSnapshots checks that the typical shapes follow the counts while few pods are known and
// are refreshed in steps of refreshFraction afterwards, with a fresh cache per snapshot.
func TestShapeSnapshots(t *testing.T) {
	st := NewShapeStats()
	a := &Request{Containers: []ContainerShape{{Whole: 1}}}
	b := &Request{Containers: []ContainerShape{{Shares: 1, Milli: 500}}}
	st.Observe(a, 1)
	if ts := st.Typical(); len(ts) != 1 || ts[0].Weight != 1 {
		t.Fatalf("typical after one pod: %+v", ts)
	}
	for range 199 {
		st.Observe(a, 1)
	}
	sc := st.ScoreContext()
	st.Observe(b, 1) // 1 change of 201: below 2%, the snapshot stays
	if sc2 := st.ScoreContext(); len(sc2.Shapes) != 1 || sc2.Cache != sc.Cache {
		t.Fatalf("snapshot refreshed after a change below refreshFraction: %+v", sc2.Shapes)
	}
	for range 10 {
		st.Observe(b, 1)
	}
	sc3 := st.ScoreContext()
	if len(sc3.Shapes) != 2 || sc3.Cache == sc.Cache {
		t.Fatalf("snapshot not refreshed after 11 changes of 211: %+v", sc3.Shapes)
	}
	// Churn that keeps the mix (a pod leaves, one of its shape arrives) moves nothing, however much.
	for range 100 {
		st.Observe(a, -1)
		st.Observe(a, 1)
	}
	if sc4 := st.ScoreContext(); sc4.Cache != sc3.Cache {
		t.Fatal("snapshot rebuilt by churn that left the counts where they were")
	}
	// A net shift of more than 2% does rebuild it.
	for range 5 {
		st.Observe(a, -1)
		st.Observe(b, 1)
	}
	if sc5 := st.ScoreContext(); sc5.Cache == sc3.Cache {
		t.Fatal("snapshot kept after the counts moved by 10 of 211")
	}
}

// TestStagedSnapshots: with staging on, a rebuilt snapshot waits (scoring keeps the serving one)
// until it is promoted by its number, or stageLimit after the first one was staged; a newer rebuild
// replaces the staged one without restarting that clock; staging off promotes at once.
func TestStagedSnapshots(t *testing.T) {
	st := NewShapeStats()
	clock := time.Unix(1000, 0)
	st.now = func() time.Time { return clock }
	st.StageSnapshots(true)
	a := &Request{Containers: []ContainerShape{{Whole: 1}}}
	b := &Request{Containers: []ContainerShape{{Shares: 1, Milli: 500}}}
	st.Observe(a, 100)
	sc := st.ScoreContext() // the first snapshot serves at once
	if len(sc.Shapes) != 1 || st.StagedScoreContext() != nil {
		t.Fatalf("first snapshot: %+v, staged %v", sc.Shapes, st.StagedScoreContext())
	}
	st.Observe(b, 10)
	staged := st.StagedScoreContext()
	if staged == nil || len(staged.Shapes) != 2 || staged.Snapshot <= sc.Snapshot {
		t.Fatalf("no staged snapshot after the counts drifted: %+v", staged)
	}
	if now := st.ScoreContext(); now.Cache != sc.Cache || len(st.Typical()) != 1 {
		t.Fatal("the staged snapshot serves before it was promoted")
	}
	clock = clock.Add(stageLimit / 2)
	st.Observe(b, 10) // rebuilt again: replaces the staged one
	restaged := st.StagedScoreContext()
	if restaged == nil || restaged.Snapshot <= staged.Snapshot {
		t.Fatalf("second drift not staged: %+v", restaged)
	}
	if st.Promote(staged.Snapshot) {
		t.Fatal("promoted a staged snapshot that a newer one replaced")
	}
	if !st.Promote(restaged.Snapshot) || st.ScoreContext().Cache != restaged.Cache || st.StagedScoreContext() != nil {
		t.Fatal("Promote did not make the staged snapshot serve")
	}
	// Not promoted in time: the serving snapshot moves on by itself, stageLimit after the first
	// staging (a restaging does not restart the clock).
	st.Observe(a, 10)
	first := st.StagedScoreContext()
	clock = clock.Add(stageLimit - time.Millisecond)
	st.Observe(a, 10)
	last := st.StagedScoreContext()
	if st.ScoreContext().Cache == last.Cache || first.Snapshot == last.Snapshot {
		t.Fatal("promoted before stageLimit")
	}
	clock = clock.Add(time.Millisecond)
	if st.ScoreContext().Cache != last.Cache {
		t.Fatal("a staged snapshot still waits after stageLimit")
	}
	st.Observe(b, 20)
	waiting := st.StagedScoreContext()
	st.StageSnapshots(false)
	if waiting == nil || st.ScoreContext().Cache != waiting.Cache {
		t.Fatal("turning staging off left the staged snapshot waiting")
	}
}

// TestAfterKey checks the incremental state key against the key of the applied state, and that
// tessera and fgd score the same through it as through a full copy.
func TestAfterKey(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for iter := 0; iter < 3000; iter++ {
		n := &NodeState{CPUMilli: 64000, MemMiB: 1 << 20, UsedCPU: int64(rng.IntN(32000)), TypeID: 1}
		n.GPUs = randomGPUs(rng, "A")
		var r *Request
		if rng.IntN(2) == 0 {
			r = &Request{CPUMilli: 4000, Containers: []ContainerShape{{Name: "c", Shares: 1 + rng.IntN(2), Milli: 100 * rng.IntN(10), Memory: int64(1+rng.IntN(4)) << 30}}}
		} else {
			r = &Request{CPUMilli: 8000, Containers: []ContainerShape{{Name: "c", Whole: 1 + rng.IntN(2)}}}
		}
		cands, u := Candidates(n, r)
		if u != nil {
			continue
		}
		sc := &ScoreContext{}
		for i := range cands {
			var before, want fragKey
			sc.stateKey(7, n, &before)
			sc.stateKey(7, sc.afterState(n, r, &cands[i]), &want)
			afterKey(&before, n, r, &cands[i])
			if before != want {
				t.Fatalf("iter %d: incremental key %+v, applied %+v", iter, before, want)
			}
			if a, b := gpuTightnessAfter(n, &cands[i]), gpuTightness(sc.afterState(n, r, &cands[i]), &cands[i]); a != b {
				t.Fatalf("iter %d: tightness %v, want %v", iter, a, b)
			}
		}
	}
}

// TestClosestSetFastMatchesSlow checks the allocation-light closestSet against the original.
func TestClosestSetFastMatchesSlow(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for iter := 0; iter < 500; iter++ {
		g := 2 + rng.IntN(15)
		n := &NodeState{Dist: make([][]int, g)}
		for i := range n.Dist {
			n.Dist[i] = make([]int, g)
		}
		for i := 0; i < g; i++ {
			for j := i + 1; j < g; j++ {
				d := 1 + rng.IntN(5)
				n.Dist[i][j], n.Dist[j][i] = d, d
			}
		}
		var free []int
		for i := 0; i < g; i++ {
			if rng.IntN(3) > 0 {
				free = append(free, i)
			}
		}
		if len(free) < 2 {
			continue
		}
		k := 1 + rng.IntN(len(free))
		want := closestSetSlow(n, free, k)
		if got := closestSet(n, free, k); k > 1 && k < len(free) && !slices.Equal(got, want) {
			t.Fatalf("iter %d: closestSet %v, original %v", iter, got, want)
		}
	}
}

// randomGPUs draws 1-8 GPUs of 16 GiB, one in ten unusable, each free, held whole or carrying 1-3
// shares; the model is drawn per GPU when there are several.
func randomGPUs(rng *rand.Rand, models ...string) []GPUState {
	var gpus []GPUState
	for g := 0; g < 1+rng.IntN(8); g++ {
		model := models[0]
		if len(models) > 1 {
			model = models[rng.IntN(len(models))]
		}
		gs := GPUState{Index: g, Model: model, Usable: rng.IntN(10) > 0, Memory: 16 << 30}
		switch rng.IntN(3) {
		case 0:
			gs.Whole = true
		case 1:
			gs.Shares = 1 + rng.IntN(3)
			gs.UsedMilli = 100 * rng.IntN(11) // up to full: no compute left
			gs.UsedMemory = int64(rng.IntN(12)) << 30
		}
		gpus = append(gpus, gs)
	}
	return gpus
}
