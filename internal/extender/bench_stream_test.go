package extender

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"sort"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
	"github.com/tessera-gpu/tessera/internal/placement/simulate"
)

// streamTrace is the openb default trace (../shared/data beside the checkout; the benchmark fails
// without it, it does not skip).
const streamTrace = "../../../shared/data/openb/"

// BenchmarkSchedulingStream is the extender's side of scheduling a stream of pods on a 5,000-node x
// 8-GPU cluster (96 CPUs and 768 GiB per node) through its HTTP handler, as the kube-scheduler drives
// it with the chart's settings (nodeCacheCapable, --filter-pick-one). The pods are the openb default
// trace's GPU pods in the seed-42 arrival order (its 126 request shapes with their CPU and memory;
// shares get GPU memory in proportion to their compute, GPU-model restrictions are dropped as the
// cluster has one model). Untimed, the cluster is first filled to half its GPU compute with the same
// pods on random nodes, so nearly every node is in its own state and the typical shapes are the
// trace's. Then one op is one pod's Filter over every node (JSON in and out); Prioritize is not
// called, as the scheduler skips scoring when one node is feasible. After each Filter the choice is
// bound (the assigned pod reaches the state as the informer would deliver it) and the oldest pod is
// deleted, so the load stays where it is and every op sees the last binds and deletions. Every cost
// is in the numbers: request shapes met for the first time, shape snapshots rebuilt as the counts
// drift, memo evictions, and the warmer's background evaluations (warm.go; cpu-ms/op is the whole
// process's CPU, the warmer's included).
//
// steady-unwarmed and paced-40hz-unwarmed run without the warmer (--warm-memo=false); steady with it,
// pods back to back (the warmer competes with every call for the two cores); paced-40hz with it, one
// pod every 25 ms (the live benchmark schedules 26-35 pods/s with this extender; the kube-scheduler
// spends ~20 ms in its own Filter plugins per pod at 4,852 nodes), so the warmer works between calls
// as it would beside a real scheduler; new-snapshot-unwarmed rebuilds the typical-shape snapshot
// before each pod (newSnapshot), so the memo and the fragmentation cache start empty: every node is
// evaluated cold (the warmer, which refills the tables of the shapes used most after a new snapshot,
// would be kept busy by a snapshot per pod, so it does not run there).
func BenchmarkSchedulingStream(b *testing.B) {
	_, stream := traceStream(b, "stream")
	x := newTestExtender(b, api.PolicyTessera)
	names := uniformNodes(x, "node-%05d", 5000, 8, "96", "768Gi")
	var placed []types.UID
	rng := rand.New(rand.NewPCG(42, 5000))
	next := 0
	for milli, want := 0, 5000*8*placement.MilliPerGPU/2; milli < want; next++ {
		pod := stream[next%len(stream)].DeepCopy()
		pod.UID = types.UID(fmt.Sprintf("fill-%d", next))
		req, _ := RequestFromPod(pod, x.Class)
		for try := 0; try < 8; try++ {
			if node := names[rng.IntN(len(names))]; streamBind(x, pod, node) == nil {
				placed = append(placed, pod.UID)
				milli += req.GPUMilli()
				break
			}
		}
	}
	x.PickOne = true
	h := x.Handler(nil)
	// steady: after 2,000 pods untimed (the memo has met the trace's shapes, as in an extender that
	// has been running).
	b.Run("steady-unwarmed", func(b *testing.B) { streamOps(b, x, h, names, stream, &next, &placed, 2000, 0, 0, true) })
	b.Run("paced-40hz-unwarmed", func(b *testing.B) {
		streamOps(b, x, h, names, stream, &next, &placed, 200, 0, 25*time.Millisecond, true)
	})
	b.Run("new-snapshot-unwarmed", func(b *testing.B) { streamOps(b, x, h, names, stream, &next, &placed, 0, 1, 0, true) })
	x.State.changes.start()
	ctx, cancel := context.WithCancel(context.Background())
	warmer := make(chan struct{})
	go func() { defer close(warmer); x.RunWarmer(ctx) }()
	defer func() { cancel(); <-warmer }()
	b.Run("steady", func(b *testing.B) { streamOps(b, x, h, names, stream, &next, &placed, 2000, 0, 0, true) })
	b.Run("paced-40hz", func(b *testing.B) {
		streamOps(b, x, h, names, stream, &next, &placed, 200, 0, 25*time.Millisecond, true)
	})
	// A mix that drifts: a new shape snapshot every 40 pods (once a second at 40 Hz), staged while
	// the warmer fills it (the default), or serving at once (StageSnapshots off).
	b.Run("paced-40hz-drifting", func(b *testing.B) {
		streamOps(b, x, h, names, stream, &next, &placed, 200, 40, 25*time.Millisecond, true)
	})
	b.Run("paced-40hz-drifting-unstaged", func(b *testing.B) {
		x.State.Shapes().StageSnapshots(false)
		defer x.State.Shapes().StageSnapshots(true)
		streamOps(b, x, h, names, stream, &next, &placed, 200, 40, 25*time.Millisecond, true)
	})
}

// streamChoices, when set, gets each op's choice ("op pod node" lines): two builds' choices compared
// show whether a change moved a placement decision (BenchmarkFilterReplay/unwarmed is deterministic:
// no warmer, so no timing decides which snapshot serves a call).
var streamChoices io.Writer

// streamNewOrder, when set, sends each op's node names in a new order (untimed), as kube-scheduler's
// Filter sends the nodes that passed it: its node list from a rotating start, in chunks of
// sqrt(nodes) its parallel workers finish in no set order (schedulerOrder). No remembered list
// matches.
var streamNewOrder *rand.Rand

// schedulerOrder is names as kube-scheduler's Filter may send them: from a random start, cut in
// chunks of about sqrt(len) (its parallelizer's chunk size at 16 workers) put in a random order.
func schedulerOrder(rng *rand.Rand, names []string) []string {
	k := rng.IntN(len(names))
	rotated := append(slices.Clone(names[k:]), names[:k]...)
	size := max(1, int(math.Sqrt(float64(len(names)))))
	var chunks [][]string
	for i := 0; i < len(rotated); i += size {
		chunks = append(chunks, rotated[i:min(i+size, len(rotated))])
	}
	rng.Shuffle(len(chunks), func(i, j int) { chunks[i], chunks[j] = chunks[j], chunks[i] })
	return slices.Concat(chunks...)
}

// streamOps times b.N pods of the stream from *next on, after warmup pods untimed; resnapEvery > 0
// rebuilds the typical-shape snapshot before every resnapEvery-th pod (newSnapshot); a period paces
// the pods (one per period, warm-up included); churn deletes the oldest pod after each bind.
func streamOps(b *testing.B, x *Extender, h http.Handler, names []string, stream []*corev1.Pod, next *int, placed *[]types.UID, warmup, resnapEvery int, period time.Duration, churn bool) {
	var due time.Time
	pace := func() {
		if period <= 0 {
			return
		}
		b.StopTimer()
		if due.IsZero() {
			due = time.Now()
		}
		due = due.Add(period)
		time.Sleep(time.Until(due))
		b.StartTimer()
	}
	unschedulable := 0
	namesJSON, err := json.Marshal(names)
	if err != nil {
		b.Fatal(err)
	}
	var body []byte
	rec := &benchRecorder{}
	one := func() time.Duration {
		i := *next
		*next++
		pod := stream[i%len(stream)].DeepCopy()
		pod.UID = types.UID(fmt.Sprintf("%s-%d", pod.Name, i))
		x.State.markPending(pod, x.Class) // Filter holds its choice, as for the informer's pods
		if streamNewOrder != nil {
			if namesJSON, err = json.Marshal(schedulerOrder(streamNewOrder, names)); err != nil {
				b.Fatal(err)
			}
		}
		body = argsBody(b, body, pod, namesJSON)
		if resnapEvery > 0 && i%resnapEvery == 0 {
			newSnapshot(x, i/resnapEvery)
		}
		rec.reset()
		start := time.Now()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/filter", bytes.NewReader(body)))
		took := time.Since(start)
		b.StopTimer()
		fr := keptNodes(b, rec.body.Bytes())
		if rec.code != http.StatusOK || fr.Error != "" {
			b.Fatalf("filter: %d %s", rec.code, rec.body.String())
		}
		if fr.NodeNames == nil || len(*fr.NodeNames) == 0 {
			unschedulable++
		} else {
			if streamChoices != nil {
				fmt.Fprintf(streamChoices, "%d %s %s\n", i, pod.Name, (*fr.NodeNames)[0])
			}
			if err := streamBind(x, pod, (*fr.NodeNames)[0]); err != nil {
				b.Fatal(err)
			}
			*placed = append(*placed, pod.UID)
			if churn {
				x.State.DeletePod((*placed)[0])
				*placed = (*placed)[1:]
			}
		}
		b.StartTimer()
		return took
	}
	for range warmup {
		pace()
		one()
	}
	r0, e0 := x.Evaluations()
	c0 := x.eval.Counts()
	t0 := c0.Twinned
	unschedulable = 0
	d := make([]time.Duration, 0, b.N)
	runtime.GC()
	cpu0 := cpuTime()
	b.ResetTimer()
	for range b.N {
		pace()
		d = append(d, one())
	}
	b.StopTimer()
	reportP99(b, d, cpuTime()-cpu0)
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	b.ReportMetric(float64(d[len(d)*999/1000].Microseconds())/1000, "p99.9-ms")
	b.ReportMetric(float64(d[len(d)-1].Microseconds())/1000, "max-ms")
	b.ReportMetric(float64(unschedulable)/float64(b.N), "unschedulable/op")
	r1, e1 := x.Evaluations()
	b.ReportMetric(float64(r1-r0)/float64(max(1, r1-r0+e1-e0)), "remembered-frac")
	c1 := x.eval.Counts()
	b.ReportMetric(float64(c1.Twinned-t0)/float64(b.N), "twinned/op")
	// Nodes bounded inside calls (pick-one's first pass where the memo had nothing: a shape's table
	// emptied by a new snapshot, or a shape never seen) and outcomes the warmer computed off the
	// request path.
	b.ReportMetric(float64(c1.Bounded-c0.Bounded)/float64(b.N), "bounded/op")
	b.ReportMetric(float64(c1.Warmed-c0.Warmed)/float64(b.N), "warmed/op")
}

// streamBind binds pod to node as the extender's bind would decide it (the policy's placement on
// the node) and hands the assigned pod to the state, as the informer would.
func streamBind(x *Extender, pod *corev1.Pod, node string) error {
	req, err := RequestFromPod(pod, x.Class)
	if err != nil {
		return err
	}
	x.State.unreserve(pod.UID)
	var a *api.PodAssignment
	sc := x.State.Shapes().ScoreContext()
	x.State.View([]string{node}, func(_ string, n *placement.NodeState, _ string) {
		if p, _, u := x.Engine.EvaluateOn(sc, n, req); u == nil {
			a = BuildAssignment(n, req, &p)
		}
	})
	if a == nil {
		return fmt.Errorf("bind %s: node %s does not fit", pod.Name, node)
	}
	raw, err := api.EncodeAssignment(a)
	if err != nil {
		return err
	}
	pod.Annotations[api.AnnotationAssignment] = string(raw)
	pod.Labels[api.LabelAssignedNode] = node
	pod.Spec.NodeName = node
	x.State.UpsertPod(pod, x.Class)
	return nil
}

// traceStream loads the openb default trace: its nodes, and its GPU pods in the seed-42 arrival
// order as pods named <prefix>-<arrival>.
func traceStream(b *testing.B, prefix string) ([]simulate.Node, []*corev1.Pod) {
	nodes, err := simulate.LoadNodes(streamTrace + "openb_node_list_gpu_node.csv")
	if err != nil {
		b.Fatal(err)
	}
	pods, err := simulate.LoadPods(streamTrace + "openb_pod_list_default.csv")
	if err != nil {
		b.Fatal(err)
	}
	var stream []*corev1.Pod
	for i, p := range simulate.NewCluster(nodes, pods).Arrivals(42, 1.3) {
		if p.NumGPU > 0 {
			stream = append(stream, streamPod(fmt.Sprintf("%s-%05d", prefix, i), &p))
		}
	}
	return nodes, stream
}

// streamPod is a trace pod as a Kubernetes pod: whole GPUs, or one share with the trace's compute
// and GPU memory in proportion to it (the trace has no GPU memory column), plus CPU and memory.
func streamPod(name string, p *simulate.Pod) *corev1.Pod {
	var pod *corev1.Pod
	if p.GPUMilli >= 1000 {
		pod = wholePod(name, p.NumGPU)
	} else {
		pod = sharePod(name, 1, max(1, (p.GPUMilli*16+999)/1000), max(1, p.GPUMilli/10))
	}
	pod.Spec.Containers[0].Resources.Requests = corev1.ResourceList{
		corev1.ResourceCPU:    *resource.NewMilliQuantity(p.CPUMilli, resource.DecimalSI),
		corev1.ResourceMemory: *resource.NewQuantity(p.MemMiB<<20, resource.BinarySI),
	}
	return pod
}
