package simulate

import (
	"reflect"
	"strings"
	"testing"
)

// TestVaryMultiGPURequest: copies of the list's own multi-GPU pods are added until they ask for the
// share of the GPU request asked (and no further than the last copy needed), the original pods come
// first and unchanged, and a seed always gives the same list.
func TestVaryMultiGPURequest(t *testing.T) {
	var pods []Pod
	for i := range 90 {
		pods = append(pods, Pod{Name: "s", CPUMilli: 4000, NumGPU: 1, GPUMilli: 200 + 5*i})
	}
	pods = append(pods, Pod{Name: "w", CPUMilli: 8000, NumGPU: 1, GPUMilli: 1000},
		Pod{Name: "m4", CPUMilli: 32000, NumGPU: 4, GPUMilli: 1000}, Pod{Name: "m8", CPUMilli: 88000, NumGPU: 8, GPUMilli: 1000})
	nodes := []Node{{Name: "n", CPUMilli: 96000, GPUs: 8, Model: "G2"}}
	v, err := ParseVariant("multigpu-request=0.5")
	if err != nil {
		t.Fatal(err)
	}
	out := Vary(pods, nodes, v, 1)
	if !reflect.DeepEqual(out[:len(pods)], pods) {
		t.Fatal("the original pods changed")
	}
	var total, multi, last int
	for i, p := range out {
		total += p.GPURequest()
		if p.NumGPU > 1 {
			multi += p.GPURequest()
		}
		if i >= len(pods) {
			if p.NumGPU < 2 || !strings.Contains(p.Name, "-copy") {
				t.Fatalf("added pod %+v: want a copy of a multi-GPU pod", p)
			}
			last = p.GPURequest()
		}
	}
	if len(out) == len(pods) {
		t.Fatal("nothing added")
	}
	if share := float64(multi) / float64(total); share < 0.5 || float64(multi-last)/float64(total-last) >= 0.5 {
		t.Fatalf("multi-GPU share %.3f: want at least 0.5, and below it before the last copy", share)
	}
	if !reflect.DeepEqual(out, Vary(pods, nodes, v, 1)) {
		t.Fatal("one seed gave two lists")
	}
}

func TestParseVariantRefuses(t *testing.T) {
	for in, want := range map[string]string{
		"multigpu-request=1":  "below 1",
		"multigpu-requests=1": "unknown name",
		"spec=-1":             "non-negative",
	} {
		if _, err := ParseVariant(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: error %v, want one saying %q", in, err, want)
		}
	}
}
