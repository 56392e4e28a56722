package extender

import (
	"os"
	"regexp"
	"strings"
	"testing"

	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// The model restriction docs/install.md shows works as written: it names models as the node label
// spells them (NVML's "NVIDIA A100-SXM4-80GB" is labelled NVIDIA-A100-SXM4-80GB), and a pod
// carrying it fits a node with such GPUs and no other.
func TestDocumentedGPUModelExample(t *testing.T) {
	doc, err := os.ReadFile("../../docs/install.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(api.AnnotationGPUModel + `: "([^"]+)"`).FindSubmatch(doc)
	if m == nil {
		t.Fatalf("docs/install.md shows no %s example", api.AnnotationGPUModel)
	}
	example := string(m[1])
	x := newTestExtender(t, api.PolicyTessera)
	x.State.UpsertNode(testNode(testInventory("a100", 1, 2, "NVIDIA A100-SXM4-80GB"), nil))
	x.State.UpsertNode(testNode(testInventory("h100", 2, 2, "NVIDIA H100 80GB HBM3"), nil))
	pod := sharePod("model", 1, 1, 0)
	pod.Annotations[api.AnnotationGPUModel] = example
	names := []string{"a100", "h100"}
	res := x.Filter(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names})
	if res.NodeNames == nil || strings.Join(*res.NodeNames, ",") != "a100" {
		t.Errorf("pod with %s=%q (docs/install.md) fits %v, want [a100] (failed %v)", api.AnnotationGPUModel, example, res.NodeNames, res.FailedNodes)
	}
	if !strings.Contains(example, api.GPUModelLabelValue("NVIDIA A100-SXM4-80GB")) {
		t.Errorf("the documented example %q does not name the A100 80GB as its node label spells it", example)
	}
}
