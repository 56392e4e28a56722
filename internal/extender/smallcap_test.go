package extender

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// TestSecuritySmallCapRefused: a share whose memory cap is below what vcuda charges one CUDA context
// on the GPU (api.ContextOverheadBytes: 320 MiB on 7.x, 512 MiB on 9.x) could create no context at
// all, so the extender refuses it on that GPU, unresolvably and naming the overhead, and a placement
// made earlier onto such a GPU no longer fits.
func TestSecuritySmallCapRefused(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	x.State.UpsertNode(testNode(testInventory("v100", 1, 2, "V100M16"), nil)) // 7.0: 320 MiB
	h := testInventory("h100", 2, 2, "H100")
	for i := range h.GPUs {
		h.GPUs[i].ComputeCapability = "9.0" // 512 MiB
	}
	x.State.UpsertNode(testNode(h, nil))
	names := []string{"h100", "v100"}
	mem := func(name, q string) *corev1.Pod {
		return testPod(name, corev1.ResourceList{api.ResourceShare: resource.MustParse("1"), api.ResourceShareMemory: resource.MustParse(q)})
	}
	pct := testPod("pct", corev1.ResourceList{api.ResourceShare: resource.MustParse("1"), api.ResourceShareMemoryPercent: resource.MustParse("2")})
	cases := []struct {
		pod   *corev1.Pod
		fit   string
		unres map[string]string // node -> substring of its reason
	}{
		{mem("tiny", "256Mi"), "", map[string]string{
			"v100": "asks for 256 MiB per share, below the 320 MiB a CUDA context takes on this node's GPUs",
			"h100": "asks for 256 MiB per share, below the 512 MiB a CUDA context takes on this node's GPUs (vcuda could not create one); ask for at least 512Mi of tessera.dev/vgpu-memory"}},
		{mem("small", "400Mi"), "v100", map[string]string{"h100": "below the 512 MiB"}},
		{pct, "v100", map[string]string{"h100": "asks for 2% of a GPU's memory per share (327 MiB here), below the 512 MiB"}},
		{mem("enough", "512Mi"), "h100,v100", nil},
	}
	for _, tc := range cases {
		t.Run(tc.pod.Name, func(t *testing.T) {
			res := x.Filter(&extenderv1.ExtenderArgs{Pod: tc.pod, NodeNames: &names})
			if res.Error != "" || res.NodeNames == nil || strings.Join(*res.NodeNames, ",") != tc.fit {
				t.Fatalf("fit = %v, want %q (failed %v / %v, error %q)", res.NodeNames, tc.fit, res.FailedNodes, res.FailedAndUnresolvableNodes, res.Error)
			}
			for node, want := range tc.unres {
				if got := res.FailedAndUnresolvableNodes[node]; !strings.Contains(got, want) || res.FailedNodes[node] != "" {
					t.Errorf("node %s: unresolvable reason %q (resolvable %q), want it to contain %q", node, got, res.FailedNodes[node], want)
				}
			}
		})
	}

	// A node with one GPU of each: a 400 MiB share goes only onto the 7.0 GPU, and two such shares
	// (on different GPUs) do not fit.
	mixed := testInventory("mixed", 3, 2, "V100M16")
	mixed.GPUs[1].ComputeCapability = "9.0"
	m := placement.NewNodeState(mixed, nil)
	one := &placement.Request{Containers: []placement.ContainerShape{{Name: "main", Shares: 1, Memory: 400 << 20}}}
	ps, u := placement.Candidates(m, one)
	if u != nil || len(ps) == 0 {
		t.Fatalf("a 400 MiB share on the mixed node: %v", u)
	}
	for _, p := range ps {
		if p.Devices[0].GPU != 0 {
			t.Errorf("a 400 MiB share offered on GPU %d (9.0: 512 MiB a context)", p.Devices[0].GPU)
		}
	}
	one.Containers[0].Shares = 2
	if ps, u := placement.Candidates(m, one); u == nil {
		t.Errorf("two 400 MiB shares placed on the mixed node: %v", ps)
	}

	// A placement chosen before (a Filter's hold) is checked again at bind: a 256 MiB share on an
	// H100 does not fit, 512 MiB does.
	n := placement.NewNodeState(h, nil)
	r := &placement.Request{Containers: []placement.ContainerShape{{Name: "main", Shares: 1, Memory: 256 << 20}}}
	if placement.Fits(n, r, &placement.Placement{Devices: []placement.Device{{GPU: 0, Memory: 256 << 20}}}) {
		t.Error("Fits: a 256 MiB share on a 9.0 GPU fits")
	}
	r.Containers[0].Memory = 512 << 20
	if !placement.Fits(n, r, &placement.Placement{Devices: []placement.Device{{GPU: 0, Memory: 512 << 20}}}) {
		t.Error("Fits: a 512 MiB share on a 9.0 GPU does not fit")
	}
}
