package extender

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// BenchmarkDecodeNames decodes a filter request naming 4,852 known nodes and resolves the names to
// the State's nodes (what a filter call does before it evaluates any): the same list each call
// (remembered) or a new order each call, as kube-scheduler sends the nodes its parallel Filter
// passed (their order differs from call to call, so no remembered list matches). One worker, as on
// one CPU.
func BenchmarkDecodeNames(b *testing.B) {
	x := newTestExtender(b, api.PolicyTessera)
	var names []string
	for i := range 4852 {
		name := fmt.Sprintf("%04d-openb-node-%04d-c%d", i, i%1213, i/1213)
		x.State.UpsertNode(testNode(testInventory(name, i, 1, "T4"), nil))
		names = append(names, name)
	}
	const orders = 8
	var bodies []string
	rng := rand.New(rand.NewPCG(1, 2))
	for range orders {
		rng.Shuffle(len(names), func(i, j int) { names[i], names[j] = names[j], names[i] })
		bodies = append(bodies, `{"Pod":{"metadata":{"name":"p"}},"NodeNames":["`+strings.Join(names, `","`)+`"]}`)
	}
	for _, c := range []struct {
		name  string
		every int
	}{{"same-list", 0}, {"new-order", 1}} {
		b.Run(c.name, func(b *testing.B) {
			for i := range b.N {
				body := bodies[0]
				if c.every > 0 {
					body = bodies[i%orders]
				}
				var args extenderv1.ExtenderArgs
				rec := httptest.NewRecorder()
				release, ok := x.decodeArgs(rec, httptest.NewRequest(http.MethodPost, "/filter", strings.NewReader(body)), &args)
				if !ok || len(*args.NodeNames) != len(names) {
					b.Fatalf("decode: %s", rec.Body.String())
				}
				seen := 0
				x.State.viewIndexed(*args.NodeNames, 1, func(_, _, slot int, _ *placement.NodeState, _ string) {
					if slot >= 0 {
						seen++
					}
				})
				if seen != len(names) {
					b.Fatalf("%d of %d names resolved", seen, len(names))
				}
				release()
			}
		})
	}
}
