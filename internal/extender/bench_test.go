package extender

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"runtime"
	"sort"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// benchCluster is 5,000 nodes x 8 GPUs, half full. uniform: on each node GPUs 0-2 are whole-owned
// and GPU 3 carries two 30% shares (4 of 8 GPUs' worth in use; every node in the same state).
// varied: each node holds 0-6 whole GPUs and 1-3 shared GPUs with 1-3 shares of 5-45% compute and
// 1-4 GiB each, a share that would take its GPU past 100% compute left out (about 4 of 8 GPUs'
// worth in use on average, nearly every node in its own state).
// alloc, when set, is every node's allocatable CPU and memory (placement then tracks them).
func benchCluster(b *testing.B, varied bool, alloc corev1.ResourceList) (*Extender, []string) {
	x := newTestExtender(b, api.PolicyTessera)
	names := make([]string, 5000)
	rng := rand.New(rand.NewPCG(5000, 8))
	for i := range names {
		names[i] = fmt.Sprintf("node-%05d", i)
		node := testNode(testInventory(names[i], i, 8, "A100"), nil)
		node.Status.Allocatable = alloc
		x.State.UpsertNode(node)
		whole, shared, shares, cores, mem := 3, 1, 2, 30, 4
		if varied {
			whole, shared = rng.IntN(7), 1+rng.IntN(3)
			shared = min(shared, 8-whole)
		}
		var devs []api.DeviceAssignment
		for g := 0; g < whole; g++ {
			devs = append(devs, api.DeviceAssignment{UUID: gpuUUID(i, g), Whole: true})
		}
		if whole > 0 {
			x.State.UpsertPod(assigned(wholePod(fmt.Sprintf("w%d", i), whole), names[i], devs...), x.Class)
		}
		for g := whole; g < whole+shared; g++ {
			if varied {
				shares = 1 + rng.IntN(3)
			}
			used := 0
			for s := 0; s < shares; s++ {
				if varied {
					cores, mem = 5+rng.IntN(41), 1+rng.IntN(4)
				}
				if used+cores > 100 {
					continue // the extender would not have placed it: no GPU over 100% compute
				}
				used += cores
				p := assigned(sharePod(fmt.Sprintf("s%d-%d-%d", i, g, s), 1, mem, cores), names[i],
					api.DeviceAssignment{UUID: gpuUUID(i, g), MemoryBytes: int64(mem) << 30, CoresPercent: cores})
				x.State.UpsertPod(p, x.Class)
			}
		}
	}
	return x, names
}

var benchClusters = map[bool]*struct {
	once  sync.Once
	x     *Extender
	names []string
}{false: {}, true: {}}

// sharedBenchCluster builds each benchCluster once per test binary (it takes seconds).
func sharedBenchCluster(b *testing.B, varied bool) (*Extender, []string) {
	c := benchClusters[varied]
	c.once.Do(func() { c.x, c.names = benchCluster(b, varied, nil) })
	return c.x, c.names
}

// cpuTime is the process's user+system CPU time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// reportP99 reports wall-clock percentiles of the timed operations and the process CPU time per
// operation (less sensitive than wall time to other load on a shared machine).
func reportP99(b *testing.B, d []time.Duration, cpu time.Duration) {
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	b.ReportMetric(float64(d[len(d)*99/100].Microseconds())/1000, "p99-ms")
	b.ReportMetric(float64(d[len(d)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(cpu.Microseconds())/1000/float64(len(d)), "cpu-ms/op")
}

// benchPods are the pod shapes a scheduling cycle is measured for.
var benchPods = []struct {
	name string
	pod  func() *corev1.Pod
}{
	{"share2x40", func() *corev1.Pod { return sharePod("new", 2, 8, 40) }},
	{"share1x40", func() *corev1.Pod { return sharePod("new", 1, 8, 40) }},
	{"whole1", func() *corev1.Pod { return wholePod("new", 1) }},
	{"whole4", func() *corev1.Pod { return wholePod("new", 4) }},
}

// BenchmarkFilterPrioritize is one scheduling cycle's extender work for one pod: filter then
// prioritize over all 5,000 nodes (nodeCacheCapable: node names only), without HTTP, the evaluation
// memo cleared before each op so that every node is evaluated; the fragmentation cache stays warm
// (no real call sees that: BenchmarkFilterPrioritizeHTTP's new-shape and new-snapshot modes are the
// cold cases, BenchmarkSchedulingStream the steady state). Run with -benchtime 200x or more for a
// meaningful p99.
func BenchmarkFilterPrioritize(b *testing.B) {
	for _, varied := range []bool{false, true} {
		x, names := sharedBenchCluster(b, varied)
		for _, bp := range benchPods {
			b.Run(map[bool]string{false: "uniform", true: "varied"}[varied]+"/"+bp.name, func(b *testing.B) {
				pod := bp.pod()
				var d []time.Duration
				runtime.GC()
				cpu0 := cpuTime()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					x.eval.Reset() // every node evaluated (the memo only: see above)
					start := time.Now()
					fr := x.Filter(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names})
					if _, err := x.Prioritize(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: fr.NodeNames}); err != nil {
						b.Fatal(err)
					}
					d = append(d, time.Since(start))
				}
				reportP99(b, d, cpuTime()-cpu0)
			})
		}
	}
}

// BenchmarkFilterPrioritizeHTTP is the extender's side of one scheduling cycle through its HTTP
// handler: decoding the JSON requests (pod and 5,000 node names for filter, the kept names for
// prioritize), the work, and encoding the replies. The scheduler's own JSON work is not timed.
//
// pick-one is the chart's setting (--filter-pick-one): Filter keeps the policy's node and holds it,
// Prioritize scores one node; all-fitting keeps every fitting node and prioritizes them all. Modes:
//   - warm: the next pod of a shape; only the nodes that changed since (the pod's own hold, with
//     pick-one) are evaluated again.
//   - new-shape: every op a shape the extender has never seen (shares 1-2 x 1-12 GiB x 5-95%
//     compute): no remembered outcome, and no state after a placement in the fragmentation cache.
//   - new-snapshot: the typical-shape snapshot is rebuilt before every op (one shape's count moved
//     by more than 2% of all pods), so the memo and the fragmentation cache start empty.
//   - new-snapshot-warmed (pick-one): as new-snapshot, staged, and the warmer's pass (untimed, one
//     shape's table: WarmShapes 1) before the op, which is a shape never seen: what the first such
//     pod after a rebuild costs beside the warmer.
func BenchmarkFilterPrioritizeHTTP(b *testing.B) {
	x, names := sharedBenchCluster(b, true)
	for _, pickOne := range []bool{true, false} {
		for _, mode := range []string{"warm", "new-shape", "new-snapshot", "new-snapshot-warmed"} {
			if mode == "new-snapshot-warmed" && !pickOne {
				continue
			}
			b.Run(map[bool]string{false: "all-fitting", true: "pick-one"}[pickOne]+"/"+mode, func(b *testing.B) {
				x.PickOne = pickOne
				defer func() { x.PickOne = false }()
				benchHTTP(b, x, names, mode)
			})
		}
	}
}

// argsBody writes into dst the extender arguments of pod over the node names namesJSON (a JSON
// array marshalled once: 5,000 names are 80 KB a benchmark would otherwise allocate per op).
func argsBody(b *testing.B, dst []byte, pod *corev1.Pod, namesJSON []byte) []byte {
	podJSON, err := json.Marshal(pod)
	if err != nil {
		b.Fatal(err)
	}
	return append(append(append(append(append(dst[:0], `{"pod":`...), podJSON...), `,"nodenames":`...), namesJSON...), '}')
}

// keptNodes reads a filter reply's kept nodes and error (not its maps of refused nodes: the
// benchmark's garbage is not the extender's).
func keptNodes(b *testing.B, reply []byte) (fr struct {
	NodeNames *[]string
	Error     string
}) {
	if err := json.Unmarshal(reply, &fr); err != nil {
		b.Fatalf("filter reply %.200s: %v", reply, err)
	}
	return fr
}

// benchRecorder is an http.ResponseWriter that keeps its buffers from call to call, so that the
// benchmarks' own allocations (httptest.ResponseRecorder grows a fresh body per call: ~100 KB for a
// filter reply) do not add garbage collections a real server would not have.
type benchRecorder struct {
	header http.Header
	body   bytes.Buffer
	code   int
}

func (r *benchRecorder) reset() {
	if r.header == nil {
		r.header = http.Header{}
	}
	clear(r.header)
	r.body.Reset()
	r.code = http.StatusOK
}

func (r *benchRecorder) Header() http.Header         { return r.header }
func (r *benchRecorder) Write(p []byte) (int, error) { return r.body.Write(p) }
func (r *benchRecorder) WriteHeader(code int)        { r.code = code }

// newSnapshot makes the next call rebuild the typical-shape snapshot (op i of a run): a shape outside
// the cluster's mix (3 whole GPUs, no CPU) gains 2.5% of all pods' count on even ops and loses it on
// odd ones, as a drifting mix would.
func newSnapshot(x *Extender, i int) {
	bump, _ := RequestFromPod(wholePod("bump", 3), x.Class)
	step := 1 + x.State.Shapes().Total()/40
	if i%2 == 1 {
		step = -step
	}
	x.State.Shapes().Observe(bump, step)
}

// benchShapePod is the i-th of 2,184 share pods of distinct request shapes (cycled): every filter
// starts the pod's earlier hold over (all pods are named "new").
func benchShapePod(i int) *corev1.Pod {
	i %= 2 * 12 * 91
	return sharePod("new", 1+i%2, 1+i/2%12, 5+i/24)
}

func benchHTTP(b *testing.B, x *Extender, names []string, mode string) {
	h := x.Handler(nil)
	namesJSON, err := json.Marshal(names)
	if err != nil {
		b.Fatal(err)
	}
	var fbody []byte
	rec := &benchRecorder{}
	call := func(path string, body []byte) *benchRecorder {
		rec.reset()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body)))
		if rec.code != http.StatusOK {
			b.Fatalf("%s: %d %s", path, rec.code, rec.body.String())
		}
		return rec
	}
	pod := sharePod("new", 2, 8, 40)
	if mode == "new-snapshot-warmed" {
		x.State.Shapes().StageSnapshots(true) // as RunWarmer does
		x.WarmShapes = 1
		defer func() { x.State.Shapes().StageSnapshots(false); x.WarmShapes = 0 }()
	}
	var d []time.Duration
	var pbody []byte
	runtime.GC()
	cpu0 := cpuTime()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		switch mode {
		case "new-shape":
			pod = benchShapePod(i)
		case "new-snapshot":
			newSnapshot(x, i)
		case "new-snapshot-warmed":
			newSnapshot(x, i)
			x.warmOnce(context.Background())
			pod = benchShapePod(i)
		}
		x.State.markPending(pod, x.Class) // Filter holds its choice, as for the informer's pods
		fbody = argsBody(b, fbody, pod, namesJSON)
		b.StartTimer()
		start := time.Now()
		call("/filter", fbody)
		took := time.Since(start)
		b.StopTimer()
		fr := keptNodes(b, rec.body.Bytes())
		if fr.NodeNames == nil || len(*fr.NodeNames) == 0 {
			b.Fatalf("op %d: no node fits %v: %s", i, pod.Spec.Containers[0].Resources.Limits, fr.Error)
		}
		nj, _ := json.Marshal(*fr.NodeNames)
		pbody = argsBody(b, pbody, pod, nj)
		b.StartTimer()
		start = time.Now()
		call("/prioritize", pbody)
		d = append(d, took+time.Since(start))
	}
	b.StopTimer()
	reportP99(b, d, cpuTime()-cpu0)
}

// BenchmarkBindDecision is bind's own work without API calls: place on a node rebuilt from its
// assignments, and build the annotation.
func BenchmarkBindDecision(b *testing.B) {
	x, names := sharedBenchCluster(b, true)
	req, _ := RequestFromPod(sharePod("new", 2, 8, 40), x.Class)
	inv := testInventory(names[0], 0, 8, "A100")
	var d []time.Duration
	cpu0 := cpuTime()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		n := placement.NewNodeState(inv, nil)
		p := placement.Placement{Devices: []placement.Device{{GPU: 0, Whole: true}, {GPU: 1, Whole: true}, {GPU: 2, Whole: true}, {GPU: 3, Milli: 600, Memory: 8 << 30}}}
		n.Apply(&placement.Request{}, &p)
		pl, _, u := x.Engine.Evaluate(x.State.Shapes().ScoreContext(), n, req)
		if u != nil {
			b.Fatal(u)
		}
		if _, err := api.EncodeAssignment(BuildAssignment(n, req, &pl)); err != nil {
			b.Fatal(err)
		}
		d = append(d, time.Since(start))
	}
	reportP99(b, d, cpuTime()-cpu0)
}
