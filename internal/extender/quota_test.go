package extender

import (
	"math"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

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
