package v1

import (
	"strings"
	"testing"
)

func TestGPUModelLabelValue(t *testing.T) {
	for model, want := range map[string]string{
		"NVIDIA A100-SXM4-40GB":       "NVIDIA-A100-SXM4-40GB",
		"Tesla V100-SXM2-16GB":        "Tesla-V100-SXM2-16GB",
		"NVIDIA GeForce RTX 4090 (x)": "NVIDIA-GeForce-RTX-4090--x",
		" .weird ü ":                  "weird",
		strings.Repeat("A", 70):       strings.Repeat("A", 63),
		"V100M16":                     "V100M16",
	} {
		if got := GPUModelLabelValue(model); got != want {
			t.Errorf("GPUModelLabelValue(%q) = %q, want %q", model, got, want)
		}
	}
}

// A pod may name a model as NVML does or as the node label spells it; nothing else matches.
func TestGPUModelMatches(t *testing.T) {
	for _, c := range []struct {
		want, model string
		ok          bool
	}{
		{"NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", true},
		{"NVIDIA-A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", true},
		{"A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", false},
		{"NVIDIA-A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB", false},
		{"nvidia-a100-sxm4-40gb", "NVIDIA A100-SXM4-40GB", false},
	} {
		if got := GPUModelMatches(c.want, c.model); got != c.ok {
			t.Errorf("GPUModelMatches(%q, %q) = %v, want %v", c.want, c.model, got, c.ok)
		}
	}
	if n := testing.AllocsPerRun(100, func() { GPUModelMatches("NVIDIA-H100-80GB-HBM3", "NVIDIA A100-SXM4-40GB") }); n != 0 {
		t.Errorf("GPUModelMatches allocates %v times per call, want 0 (placement calls it per GPU)", n)
	}
}

func TestSameGPUModel(t *testing.T) {
	for _, c := range []struct {
		a, b string
		want bool
	}{
		{"NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3", true},
		{"Tesla-T4", "Tesla T4", true},
		{"NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-SXM4-80GB", false},
		{"tesla-t4", "Tesla-T4", false}, // case matters, as in the label
	} {
		if got := SameGPUModel(c.a, c.b); got != c.want {
			t.Errorf("SameGPUModel(%q, %q) = %v, want %v", c.a, c.b, got, c.want)
		}
	}
}
