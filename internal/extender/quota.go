package extender

import (
	"fmt"
	"sort"
	"strings"

	corev1 "k8s.io/api/core/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// requestQuantities is what a request charges against ResourceQuota, by resource name: whole GPUs,
// shares, and each share's memory and cores summed over shares.
func requestQuantities(r *placement.Request) map[string]int64 {
	out := map[string]int64{}
	for _, c := range r.Containers {
		if c.Whole > 0 {
			out[api.ResourceGPU] += int64(c.Whole)
		}
		if c.Shares > 0 {
			out[api.ResourceShare] += int64(c.Shares)
			out[api.ResourceShareMemory] += int64(c.Shares) * c.Memory
			out[api.ResourceShareCores] += int64(c.Shares) * int64(c.Milli/10)
		}
	}
	return out
}

// CheckQuota checks a request against the namespace's ResourceQuotas on the GPU resources
// ("requests.<name>" or "<name>" hard limits), counting what the namespace's placed pods hold.
// The API server's quota admission charges pods at creation; this check charges placement, so a
// quota lowered after creation, or pods created before it, cannot push the namespace over at bind.
// It returns a user-facing reason, or "" when the request fits.
func CheckQuota(quotas []*corev1.ResourceQuota, used map[string]int64, r *placement.Request) string {
	want := requestQuantities(r)
	var over []string
	for _, q := range quotas {
		for name, hard := range q.Spec.Hard {
			res := strings.TrimPrefix(string(name), "requests.")
			w, ok := want[res]
			if !ok || !api.IsTesseraResource(res) {
				continue
			}
			if !api.FitsWithin(used[res], w, hard.Value()) {
				over = append(over, fmt.Sprintf("ResourceQuota %s/%s: %s would be %d, hard limit %d", q.Namespace, q.Name, name, used[res]+w, hard.Value()))
			}
		}
	}
	if len(over) == 0 {
		return ""
	}
	sort.Strings(over)
	return "namespace quota exceeded: " + strings.Join(over, "; ")
}
