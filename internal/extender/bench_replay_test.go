package extender

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement/simulate"
)

// BenchmarkFilterReplay is the extender's side of the live placement benchmark at 4,852 nodes
// (`make bench-placement NODE_COPIES=4`, test/e2e/placement_bench_test.go) without the cluster: the
// openb default trace's 1,213 nodes listed four times (their GPU models, CPU and memory), empty at
// the start, and its GPU pods in the seed-42 arrival order (streamPod: model restrictions dropped),
// one Filter call per pod through the HTTP handler with every node's name (nodeCacheCapable,
// --filter-pick-one, the warmer running as tessera-extender runs it), the choice bound after each
// call and nothing deleted, so the cluster fills as the live replay's does. unwarmed runs without the
// warmer (so without staged snapshots): deterministic, its choices (TESSERA_BENCH_CHOICES=<file>
// writes them to <file>.<sub-benchmark>) compare two builds' placement decisions. Op i is the trace's
// i-th GPU pod: -benchtime 1500x replays the arrivals a short live run replays. Pods are paced one
// per 40 ms (the live rate at 4,852 nodes is 20-25 pods/s), so the warmer works between calls as
// beside a real scheduler, or back to back (the warmer then competes with every call).
// Every cost of the live filter's handler is in the numbers except the machine's other load: new
// request shapes, shape snapshots rebuilt while few pods are known, the warmer's refills.
func BenchmarkFilterReplay(b *testing.B) {
	nodes, stream := traceStream(b, "replay")
	for _, c := range []struct {
		name   string
		period time.Duration
		warm   bool
		// newOrder sends the names in a new order each call (streamNewOrder: rotated, in chunks), as the live scheduler does.
		newOrder bool
	}{{"paced-25hz", 40 * time.Millisecond, true, false}, {"back-to-back", 0, true, false}, {"back-to-back-new-order", 0, true, true},
		{"unwarmed", 0, false, false}} {
		b.Run(c.name, func(b *testing.B) {
			if c.newOrder {
				streamNewOrder = rand.New(rand.NewPCG(42, 37))
				defer func() { streamNewOrder = nil }()
			}
			x, names := replayCluster(b, nodes, 4)
			x.PickOne = true
			if c.warm {
				x.State.changes.start()
				ctx, cancel := context.WithCancel(context.Background())
				warmer := make(chan struct{})
				go func() { defer close(warmer); x.RunWarmer(ctx) }()
				defer func() { cancel(); <-warmer }()
			}
			if path := os.Getenv("TESSERA_BENCH_CHOICES"); path != "" && b.N > 1 {
				f, err := os.Create(path + "." + c.name)
				if err != nil {
					b.Fatal(err)
				}
				defer f.Close()
				streamChoices = f
				defer func() { streamChoices = nil }()
			}
			next := 0
			var placed []types.UID
			streamOpsFilling(b, x, x.Handler(nil), names, stream, &next, &placed, c.period)
		})
	}
}

// replayCluster is an extender whose state holds nodes listed copies times (names <node>-c<k>),
// with each node's GPUs (of its model), CPU and memory.
func replayCluster(b *testing.B, nodes []simulate.Node, copies int) (*Extender, []string) {
	x := newTestExtender(b, api.PolicyTessera)
	var names []string
	for k := range copies {
		for i, n := range nodes {
			id := k*len(nodes) + i
			name := fmt.Sprintf("%s-c%d", n.Name, k)
			node := testNode(testInventory(name, id, n.GPUs, n.Model), nil)
			node.Status.Allocatable = corev1.ResourceList{
				corev1.ResourceCPU:    *resource.NewMilliQuantity(n.CPUMilli, resource.DecimalSI),
				corev1.ResourceMemory: *resource.NewQuantity(n.MemMiB<<20, resource.BinarySI),
			}
			x.State.UpsertNode(node)
			names = append(names, name)
		}
	}
	return x, names
}

// streamOpsFilling is streamOps without deletions: the bound pods stay, as in the live replay.
func streamOpsFilling(b *testing.B, x *Extender, h http.Handler, names []string, stream []*corev1.Pod, next *int, placed *[]types.UID, period time.Duration) {
	streamOps(b, x, h, names, stream, next, placed, 0, 0, period, false)
}
