package placement

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"
)

// naiveShapeFrag is the fragmentation of one shape as frag.go GetNodePodFrag states it, one GPU
// test per shape and GPU (what fragPlan computes by parts and derives for after-states).
func naiveShapeFrag(n *NodeState, r *Request, total int, hostMem bool) int {
	if !r.WantsGPU() {
		return total
	}
	if n.CPUMilli > 0 && n.UsedCPU+r.CPUMilli > n.CPUMilli {
		return total
	}
	if hostMem && n.MemMiB > 0 && n.UsedMem+r.MemMiB > n.MemMiB {
		return total
	}
	c := &r.Containers[0]
	fit, rest := 0, 0
	for i := range n.GPUs {
		g := &n.GPUs[i]
		ok := shareFits(g, r, c)
		if c.Whole > 0 {
			ok = g.FreeWhole() && r.modelAllowed(g.Model)
		}
		if ok {
			fit++
		} else {
			rest += g.FreeMilli()
		}
	}
	if fit < c.Whole+c.Shares {
		return total
	}
	return rest
}

// naiveFragmentation is measure m shape by shape, as the measures' comments define them.
func naiveFragmentation(n *NodeState, shapes []Shape, m measure) float64 {
	total := n.FreeMilli()
	if total == 0 {
		return 0
	}
	f := 0.0
	floor := 0.0
	fed := m == measureFed || m == measureFedNoFloor
	// tessera's measures weigh each GPU shape by 1/Reach, the GPU shapes' total weight kept.
	var raw, scaled float64
	for i := range shapes {
		if shapes[i].Req.WantsGPU() {
			w := shapes[i].Weight
			raw += w
			if shapes[i].Reach > 0 {
				w /= shapes[i].Reach
			}
			scaled += w
		}
	}
	if m == measureFed {
		floor = stranded(n, shapes, total)
	}
	for i := range shapes {
		r := &shapes[i].Req
		if fed && (!r.WantsGPU() || !canUseModel(n, r)) {
			continue
		}
		v := float64(naiveShapeFrag(n, r, total, fed))
		if fed {
			v = max(floor, v)
		}
		w := shapes[i].Weight
		if fed {
			if shapes[i].Reach > 0 {
				w /= shapes[i].Reach
			}
			w *= raw / scaled
		}
		f += w * v
	}
	return f
}

// allMeasures are the fragmentation measures policies score by.
var allMeasures = []measure{measureFGD, measureFed, measureFedNoFloor}

func randomPlanNode(rng *rand.Rand) *NodeState {
	n := &NodeState{CPUMilli: 64000, MemMiB: 1 << 20, UsedCPU: int64(rng.IntN(64000)), UsedMem: int64(rng.IntN(1 << 20))}
	n.GPUs = randomGPUs(rng, "A", "B")
	if rng.IntN(4) > 0 { // as servers and the simulator build them; the rest takes the unnumbered-model path
		n.Prepare()
	}
	return n
}

func randomPlanShapes(rng *rand.Rand) []Shape {
	var shapes []Shape
	for range 2 + rng.IntN(12) {
		r := Request{CPUMilli: int64(1000 * rng.IntN(24)), MemMiB: int64(rng.IntN(1 << 17))}
		switch rng.IntN(4) {
		case 0: // CPU-only
		case 1:
			r.Containers = []ContainerShape{{Whole: 1 + rng.IntN(4)}}
		case 2: // by memory percent; sometimes no compute (memory only: a GPU with none free passes)
			r.Containers = []ContainerShape{{Shares: 1 + rng.IntN(2), Milli: 100 * rng.IntN(4), MemoryPercent: 10 * (1 + rng.IntN(5))}}
		default:
			r.Containers = []ContainerShape{{Shares: 1, Milli: 100 * (1 + rng.IntN(9)), Memory: int64(1+rng.IntN(8)) << 30}}
		}
		if rng.IntN(4) == 0 {
			r.Models = []string{"B"}
		}
		if len(r.Containers) == 0 {
			r.Containers = []ContainerShape{{}}
		}
		sh := Shape{Req: r, Weight: rng.Float64()}
		if rng.IntN(2) == 0 { // a shape only some nodes could host (tessera weighs it by 1/Reach)
			sh.Reach = 0.05 + 0.95*rng.Float64()
		}
		shapes = append(shapes, sh)
	}
	return shapes
}

// TestFragPlanMatchesPerShape: fragmentation by parts, and after-states derived by re-testing only
// the GPUs a placement touches, equal the per-shape computation exactly (bit for bit), before and
// after every candidate placement, with and without the state cache.
func TestFragPlanMatchesPerShape(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	for iter := 0; iter < 3000; iter++ {
		n := randomPlanNode(rng)
		shapes := randomPlanShapes(rng)
		for _, m := range allMeasures {
			if got, want := fragmentation(n, shapes, m), naiveFragmentation(n, shapes, m); got != want {
				t.Fatalf("iter %d measure %d: plan %v, per shape %v", iter, m, got, want)
			}
		}
		r := &shapes[rng.IntN(len(shapes))].Req
		cands, u := Candidates(n, r)
		if u != nil {
			continue
		}
		var cache *FragCache
		if rng.IntN(2) == 0 {
			cache, n.TypeID = NewFragCache(), 1
		}
		sc := &ScoreContext{Shapes: shapes, Cache: cache}
		for i := range cands {
			for _, m := range allMeasures {
				before, after := sc.fragBeforeAfter(m, n, r, &cands[i])
				if want := naiveFragmentation(n, shapes, m); before != want {
					t.Fatalf("iter %d cand %d measure %d: before %v, want %v", iter, i, m, before, want)
				}
				if want := naiveFragmentation(sc.afterState(n, r, &cands[i]), shapes, m); after != want {
					t.Fatalf("iter %d cand %d measure %d: after %v, want %v", iter, i, m, after, want)
				}
			}
		}
	}
}

// TestCachedNodeStats: a node's part stats remembered in the fragmentation cache (and read from it
// for the node's next request) give the same after-states as stats computed afresh, over passes
// that revisit every node with other requests in between.
func TestCachedNodeStats(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	shapes := randomPlanShapes(rng)
	for len(shapes) < 8 {
		shapes = append(shapes, randomPlanShapes(rng)...)
	}
	nodes := make([]*NodeState, 60)
	for i := range nodes {
		nodes[i] = randomPlanNode(rng)
		nodes[i].TypeID = i + 1 // each its own hardware
	}
	sc := &ScoreContext{Shapes: shapes, Cache: NewFragCache()}
	for pass := range 3 {
		for _, n := range nodes {
			r := &shapes[rng.IntN(len(shapes))].Req
			cands, u := Candidates(n, r)
			if u != nil {
				continue
			}
			for i := range cands {
				_, after := sc.fragBeforeAfter(measureFed, n, r, &cands[i])
				if want := naiveFragmentation(sc.afterState(n, r, &cands[i]), shapes, measureFed); after != want {
					t.Fatalf("pass %d node %s cand %d: after %v, want %v", pass, n.Name, i, after, want)
				}
			}
		}
	}
}

// TestFitMasksSharedAcrossGoroutines: one plan scored from several goroutines at once, as the
// server's workers do, publishing GPU states' fit masks as they go; every node's fragmentation
// equals the per-shape computation (a mask reused for a GPU state it does not describe fails this).
func TestFitMasksSharedAcrossGoroutines(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	shapes := randomPlanShapes(rng)
	for len(shapes) < 12 {
		shapes = append(shapes, randomPlanShapes(rng)...)
	}
	pl := compileFragPlan(shapes)
	nodes := make([]*NodeState, 400)
	for i := range nodes {
		nodes[i] = randomPlanNode(rng)
		nodes[i].Prepare()
	}
	errs := make(chan string, 4)
	for w := range 4 {
		go func() {
			fm := &fitMasks{pl: pl}
			st := make([]partStats, len(pl.parts))
			for k := range 3 * len(nodes) {
				n := nodes[(k*(w+1))%len(nodes)]
				pl.stats(n, st, fm)
				for _, m := range allMeasures {
					if got, want := pl.frag(n, st, m), naiveFragmentation(n, shapes, m); got != want {
						errs <- fmt.Sprintf("worker %d node %d measure %d: %v, per shape %v", w, k, m, got, want)
						return
					}
				}
			}
			errs <- ""
		}()
	}
	for range 4 {
		if e := <-errs; e != "" {
			t.Fatal(e)
		}
	}
	if m := pl.masks.Load(); m == nil || len(*m) < publishMin {
		t.Fatalf("the goroutines published no shared fit masks (%v)", m)
	}
}

// TestRequestDigestCoversEveryField: changing any field placement reads changes the digest (a field
// added to Request or ContainerShape without a case here fails the test), and the pod's Key does not.
func TestRequestDigestCoversEveryField(t *testing.T) {
	base := func() *Request {
		return &Request{Key: "ns/a", CPUMilli: 1000, MemMiB: 2048, Models: []string{"A100"}, Class: "training", Policy: "tessera",
			Containers: []ContainerShape{{Name: "main", Whole: 0, Shares: 1, Memory: 1 << 30, MemoryPercent: 0, Milli: 300,
				MIG: map[string]int{"1g.10gb": 1}, Mdev: map[string]int{"nvidia-1": 1}}}}
	}
	changes := map[string]func(r *Request){
		"CPUMilli":                 func(r *Request) { r.CPUMilli++ },
		"MemMiB":                   func(r *Request) { r.MemMiB++ },
		"Models":                   func(r *Request) { r.Models = []string{"A100", "H100"} },
		"ExcludeModels":            func(r *Request) { r.ExcludeModels = []string{"T4"} },
		"Class":                    func(r *Request) { r.Class = "inference" },
		"Policy":                   func(r *Request) { r.Policy = "fgd" },
		"Containers":               func(r *Request) { r.Containers = append(r.Containers, ContainerShape{Name: "side"}) },
		"Containers.Name":          func(r *Request) { r.Containers[0].Name = "other" },
		"Containers.Whole":         func(r *Request) { r.Containers[0].Whole = 1 },
		"Containers.Shares":        func(r *Request) { r.Containers[0].Shares = 2 },
		"Containers.Memory":        func(r *Request) { r.Containers[0].Memory = 2 << 30 },
		"Containers.MemoryPercent": func(r *Request) { r.Containers[0].MemoryPercent = 50 },
		"Containers.Milli":         func(r *Request) { r.Containers[0].Milli = 400 },
		"Containers.MIG":           func(r *Request) { r.Containers[0].MIG["1g.10gb"] = 2 },
		"Containers.Mdev":          func(r *Request) { r.Containers[0].Mdev = map[string]int{"nvidia-2": 1} },
	}
	for _, typ := range []reflect.Type{reflect.TypeFor[Request](), reflect.TypeFor[ContainerShape]()} {
		for f := range typ.Fields() {
			name := f.Name
			if typ == reflect.TypeFor[ContainerShape]() {
				name = "Containers." + name
			}
			if _, ok := changes[name]; !ok && name != "Key" {
				t.Errorf("field %s has no digest case: add it to Digest and here", name)
			}
		}
	}
	d0 := base().Digest()
	for name, change := range changes {
		r := base()
		change(r)
		if r.Digest() == d0 {
			t.Errorf("changing %s leaves the digest as it was", name)
		}
	}
	r := base()
	r.Key = "ns/b"
	if r.Digest() != d0 {
		t.Error("the pod's key changes the digest: pods of one shape would not share outcomes")
	}
	// Map order must not matter.
	a, b := base(), base()
	a.Containers[0].MIG = map[string]int{"1g.10gb": 1, "2g.20gb": 1, "3g.40gb": 2}
	b.Containers[0].MIG = map[string]int{"3g.40gb": 2, "2g.20gb": 1, "1g.10gb": 1}
	if a.Digest() != b.Digest() {
		t.Error("equal MIG maps give different digests")
	}
}
