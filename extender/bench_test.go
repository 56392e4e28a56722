package extender

import (
	"fmt"
	"sort"
	"testing"
	"time"

	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	"github.com/tessera-gpu/tessera/api"
)

// benchCluster is 5,000 nodes x 8 GPUs, half full: on each node GPUs 0-2 are whole-owned and GPU 3
// carries two 30% shares (4 of 8 GPUs' worth in use).
func benchCluster(b *testing.B) (*Extender, []string) {
	x := newTestExtender(b, api.PolicyTessera)
	names := make([]string, 5000)
	for i := range names {
		names[i] = fmt.Sprintf("node-%05d", i)
		x.State.UpsertNode(testNode(testInventory(names[i], i, 8, "A100"), nil))
		devs := []api.DeviceAssignment{{UUID: gpuUUID(i, 0), Whole: true}, {UUID: gpuUUID(i, 1), Whole: true}, {UUID: gpuUUID(i, 2), Whole: true}}
		x.State.UpsertPod(assigned(wholePod(fmt.Sprintf("w%d", i), 3), names[i], devs...), x.Class)
		for s := 0; s < 2; s++ {
			p := assigned(sharePod(fmt.Sprintf("s%d-%d", i, s), 1, 4, 30), names[i], api.DeviceAssignment{UUID: gpuUUID(i, 3), MemoryBytes: 4 << 30, CoresPercent: 30})
			x.State.UpsertPod(p, x.Class)
		}
	}
	return x, names
}

func reportP99(b *testing.B, d []time.Duration) {
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	b.ReportMetric(float64(d[len(d)*99/100].Microseconds())/1000, "p99-ms")
	b.ReportMetric(float64(d[len(d)/2].Microseconds())/1000, "p50-ms")
}

// BenchmarkFilterPrioritize is one scheduling cycle's extender work for a share pod: filter then
// prioritize over all 5,000 nodes.
func BenchmarkFilterPrioritize(b *testing.B) {
	x, names := benchCluster(b)
	pod := sharePod("new", 2, 8, 40)
	var d []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		fr := x.Filter(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names})
		if _, err := x.Prioritize(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: fr.NodeNames}); err != nil {
			b.Fatal(err)
		}
		d = append(d, time.Since(start))
	}
	reportP99(b, d)
}

// BenchmarkBindDecision is bind's own work without API calls: place on a node rebuilt from its
// assignments, and build the annotation.
func BenchmarkBindDecision(b *testing.B) {
	x, names := benchCluster(b)
	req, _ := RequestFromPod(sharePod("new", 2, 8, 40), x.Class)
	inv := testInventory(names[0], 0, 8, "A100")
	var d []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		n := NewNodeState(inv, nil)
		p := Placement{Devices: []Device{{GPU: 0, Whole: true}, {GPU: 1, Whole: true}, {GPU: 2, Whole: true}, {GPU: 3, Milli: 600, Memory: 8 << 30}}}
		n.Apply(&Request{}, &p)
		pl, _, u := x.Engine.Evaluate(x.State.Shapes().ScoreContext(), n, req)
		if u != nil {
			b.Fatal(u)
		}
		if _, err := api.EncodeAssignment(BuildAssignment(n, req, &pl)); err != nil {
			b.Fatal(err)
		}
		d = append(d, time.Since(start))
	}
	reportP99(b, d)
}
