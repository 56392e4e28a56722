package extender

import (
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// TestSecurityQuotaOverflow: a namespace whose counted use sits near int64's end is over its quota
// for any more; the check compares what is left and never wraps the sum negative.
func TestSecurityQuotaOverflow(t *testing.T) {
	q := &corev1.ResourceQuota{ObjectMeta: metav1.ObjectMeta{Name: "mem", Namespace: "ns"},
		Spec: corev1.ResourceQuotaSpec{Hard: corev1.ResourceList{"requests." + api.ResourceShareMemory: resource.MustParse("100Gi")}}}
	r := &placement.Request{Containers: []placement.ContainerShape{{Name: "c", Shares: 1, Memory: 2 << 30, Milli: 100}}}
	if why := CheckQuota([]*corev1.ResourceQuota{q}, map[string]int64{api.ResourceShareMemory: 10 << 30}, r); why != "" {
		t.Errorf("12 GiB of a 100 GiB quota refused: %s", why)
	}
	for _, used := range []int64{98<<30 + 1, math.MaxInt64 - 1<<30} {
		why := CheckQuota([]*corev1.ResourceQuota{q}, map[string]int64{api.ResourceShareMemory: used}, r)
		if !strings.Contains(why, "ResourceQuota ns/mem: requests.tessera.dev/vgpu-memory would be") {
			t.Errorf("%d bytes used: %q, want the quota exceeded", used, why)
		}
	}
}

// TestNamespaceUsageFollowsThePods: the namespaces' usage kept as pods come and go is, after every
// step of random sequences of the State's writers (bound pods added, updated with another request
// or another namespace, terminated and deleted; reservations made, replaced, dropped and expired),
// what summing every pod's requestQuantities gives.
func TestNamespaceUsageFollowsThePods(t *testing.T) {
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 37))
		x := newTestExtender(t, api.PolicyTessera)
		now := time.Unix(1e9, 0)
		x.State.now = func() time.Time { return now }
		for i := range 4 {
			x.State.UpsertNode(testNode(testInventory(fmt.Sprintf("n%d", i), i, 8, "T4"), nil))
		}
		pod := func(k int) *corev1.Pod {
			var p *corev1.Pod
			if rng.IntN(2) == 0 {
				p = wholePod(fmt.Sprintf("p%d", k), 1+rng.IntN(2))
			} else {
				p = sharePod(fmt.Sprintf("p%d", k), 1, 1+rng.IntN(4), 5+rng.IntN(40))
			}
			p.Namespace = fmt.Sprintf("ns%d", rng.IntN(3))
			return p
		}
		bind := func(p *corev1.Pod) *corev1.Pod {
			node := rng.IntN(4)
			req, err := RequestFromPod(p, x.Class)
			if err != nil {
				t.Fatal(err)
			}
			var devs []api.DeviceAssignment
			for g, c := 0, req.Containers[0]; g < c.Whole; g++ {
				devs = append(devs, api.DeviceAssignment{UUID: gpuUUID(node, rng.IntN(8)), Whole: true})
			}
			if c := req.Containers[0]; c.Shares > 0 {
				devs = append(devs, api.DeviceAssignment{UUID: gpuUUID(node, rng.IntN(8)), MemoryBytes: c.Memory, CoresPercent: int(c.Milli / 10)})
			}
			return assigned(p, fmt.Sprintf("n%d", node), devs...)
		}
		for step := range 300 {
			k := rng.IntN(12)
			uid := types.UID(fmt.Sprintf("uid-p%d", k))
			op := ""
			switch rng.IntN(7) {
			case 0, 1:
				op = "bind"
				x.State.UpsertPod(bind(pod(k)), x.Class)
			case 2:
				op = "terminate"
				p := bind(pod(k))
				p.Status.Phase = corev1.PodSucceeded
				x.State.UpsertPod(p, x.Class)
			case 3:
				op = "delete"
				x.State.DeletePod(uid)
			case 4:
				op = "reserve"
				p := pod(k)
				req, err := RequestFromPod(p, x.Class)
				if err != nil {
					t.Fatal(err)
				}
				node := rng.IntN(4)
				a := &api.PodAssignment{APIVersion: api.Version, Node: fmt.Sprintf("n%d", node), Containers: []api.ContainerAssignment{{Name: "main",
					Devices: []api.DeviceAssignment{{UUID: gpuUUID(node, rng.IntN(8)), Whole: true}}}}}
				x.State.reserve(uid, req.Key, p.Namespace, req, a)
			case 5:
				op = "unreserve"
				x.State.unreserve(uid)
			case 6:
				op = "expire"
				now = now.Add(DefaultTTL / 3)
				x.State.ExpireReservations()
			}
			want := map[string]map[string]int64{}
			x.State.mu.RLock()
			for _, p := range x.State.pods {
				if p.req == nil {
					continue
				}
				if want[p.namespace] == nil {
					want[p.namespace] = map[string]int64{}
				}
				for r, v := range requestQuantities(p.req) {
					want[p.namespace][r] += v
				}
			}
			x.State.mu.RUnlock()
			for _, ns := range []string{"ns0", "ns1", "ns2"} {
				w := want[ns]
				maps.DeleteFunc(w, func(_ string, v int64) bool { return v == 0 })
				if got := x.State.namespaceUsage(ns); !maps.Equal(got, w) && len(got)+len(w) > 0 {
					t.Fatalf("seed %d step %d (%s p%d): %s uses %v, the pods sum to %v", seed, step, op, k, ns, got, w)
				}
			}
		}
	}
}
