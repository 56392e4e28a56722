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

// The exclusion docs/install.md shows works as written, alone and beside an inclusion, on the
// model names real GPUs report; a model named in both is refused with the reason, and a node whose
// models are all excluded says so.
func TestGPUModelIncludeExclude(t *testing.T) {
	doc, err := os.ReadFile("../../docs/install.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(api.AnnotationGPUModelExclude + `: "([^"]+)"`).FindSubmatch(doc)
	if m == nil {
		t.Fatalf("docs/install.md shows no %s example", api.AnnotationGPUModelExclude)
	}
	exclude := string(m[1])
	x := newTestExtender(t, api.PolicyTessera)
	for i, n := range []struct{ name, model string }{
		{"a100-40", "NVIDIA A100-SXM4-40GB"}, {"a100-80", "NVIDIA A100-SXM4-80GB"}, {"h100", "NVIDIA H100 80GB HBM3"}, {"t4", "Tesla T4"},
	} {
		x.State.UpsertNode(testNode(testInventory(n.name, i+1, 2, n.model), nil))
	}
	names := []string{"a100-40", "a100-80", "h100", "t4"}
	filter := func(include, exclude string) *extenderv1.ExtenderFilterResult {
		pod := sharePod("model-"+strings.ReplaceAll(include+exclude, "|", "-"), 1, 1, 0)
		if include != "" {
			pod.Annotations[api.AnnotationGPUModel] = include
		}
		if exclude != "" {
			pod.Annotations[api.AnnotationGPUModelExclude] = exclude
		}
		return x.Filter(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names})
	}
	fits := func(res *extenderv1.ExtenderFilterResult) string {
		if res.NodeNames == nil {
			return ""
		}
		return strings.Join(*res.NodeNames, ",")
	}
	for _, c := range []struct{ include, exclude, want string }{
		{"", exclude, "a100-40,a100-80"},
		{"", "NVIDIA H100 80GB HBM3", "a100-40,a100-80,t4"}, // NVML's spelling
		{"NVIDIA-A100-SXM4-80GB|NVIDIA-H100-80GB-HBM3", "Tesla-T4", "a100-80,h100"},
	} {
		if res := filter(c.include, c.exclude); fits(res) != c.want {
			t.Errorf("include %q exclude %q: fits %q, want %q (failed %v, error %q)", c.include, c.exclude, fits(res), c.want, res.FailedNodes, res.Error)
		}
	}
	res := filter("", exclude)
	if why := res.FailedAndUnresolvableNodes["h100"]; !strings.Contains(why, "not "+exclude) || !strings.Contains(why, "NVIDIA H100 80GB HBM3") {
		t.Errorf("h100's reason %q does not name the exclusion and the node's model", why)
	}
	res = filter("NVIDIA-A100-SXM4-80GB|Tesla-T4", "Tesla T4")
	if why := res.FailedAndUnresolvableNodes["t4"]; fits(res) != "" || !strings.Contains(why, "Tesla-T4") || !strings.Contains(why, api.AnnotationGPUModelExclude) {
		t.Errorf("a model in both annotations: fits %q, reason %q; want it refused naming the model and the annotations", fits(res), why)
	}
}
