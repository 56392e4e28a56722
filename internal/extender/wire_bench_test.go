package extender

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// BenchmarkDecodeNames decodes a filter request naming 4,852 known nodes and resolves the names to
// the State's nodes (what a filter call does before it evaluates any): the same list each call
// (remembered), a shuffled order each call, or as kube-scheduler sends the nodes its Filter passed:
// its node list from a rotating start (rotated), in chunks of 69 in the order its parallel workers
// finish them (chunks). The -cold cases evict the CPU caches before each call (untimed), as the
// warmer and the informers do between live calls. One worker, as on one CPU.
func BenchmarkDecodeNames(b *testing.B) {
	x := newTestExtender(b, api.PolicyTessera)
	var base []string
	for i := range 4852 {
		name := fmt.Sprintf("%04d-openb-node-%04d-c%d", i, i%1213, i/1213)
		x.State.UpsertNode(testNode(testInventory(name, i, 1, "T4"), nil))
		base = append(base, name)
	}
	const orders = 8
	rng := rand.New(rand.NewPCG(1, 2))
	bodies := func(order string) []string {
		var out []string
		for range orders {
			var names []string
			if order == "chunks" {
				names = schedulerOrder(rng, base) // chunks of 69 at 4,852 nodes
			} else {
				k := rng.IntN(len(base))
				names = append(slices.Clone(base[k:]), base[:k]...)
			}
			if order == "shuffled" {
				rng.Shuffle(len(names), func(i, j int) { names[i], names[j] = names[j], names[i] })
			}
			out = append(out, `{"Pod":{"metadata":{"name":"p"}},"NodeNames":["`+strings.Join(names, `","`)+`"]}`)
		}
		return out
	}
	evict := make([]byte, 64<<20)
	for _, c := range []struct {
		name, order string
		same, cold  bool
	}{{"same-list", "rotated", true, false}, {"new-order", "shuffled", false, false}, {"rotated", "rotated", false, false},
		{"chunks", "chunks", false, false}, {"new-order-cold", "shuffled", false, true}, {"rotated-cold", "rotated", false, true}} {
		list := bodies(c.order)
		b.Run(c.name, func(b *testing.B) {
			for i := range b.N {
				body := list[i%orders]
				if c.same {
					body = list[0]
				}
				if c.cold {
					b.StopTimer()
					for j := 0; j < len(evict); j += 64 {
						evict[j]++
					}
					b.StartTimer()
				}
				var args extenderv1.ExtenderArgs
				rec := httptest.NewRecorder()
				release, ok := x.decodeArgs(rec, httptest.NewRequest(http.MethodPost, "/filter", strings.NewReader(body)), &args)
				if !ok || len(*args.NodeNames) != len(base) {
					b.Fatalf("decode: %s", rec.Body.String())
				}
				seen := 0
				x.State.viewIndexed(*args.NodeNames, 1, func(_, _, slot int, _ *placement.NodeState, _ string) {
					if slot >= 0 {
						seen++
					}
				})
				if seen != len(base) {
					b.Fatalf("%d of %d names resolved", seen, len(base))
				}
				release()
			}
		})
	}
}
