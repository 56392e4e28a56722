package simulate

import (
	"fmt"
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
		"spec-request=1.5":    "at most 1",
	} {
		if _, err := ParseVariant(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: error %v, want one saying %q", in, err, want)
		}
	}
}

// TestVarySpecRequest: unrestricted GPU pods are restricted, each to the allowed models of one of
// the list's own restricted pods, until restricted pods are the share of GPU pods asked (and no
// further); CPU-only pods and the other fields stay; a list without restricted pods is refused.
func TestVarySpecRequest(t *testing.T) {
	var pods []Pod
	for i := range 100 {
		p := Pod{Name: fmt.Sprintf("p%d", i), CPUMilli: 4000, NumGPU: 1, GPUMilli: 300 + 7*i}
		switch {
		case i < 5:
			p.Models = []string{"T4"}
		case i < 10:
			p.Models = []string{"V100M16", "V100M32"}
		case i >= 90:
			p.NumGPU, p.GPUMilli = 0, 0 // CPU-only
		}
		pods = append(pods, p)
	}
	v, err := ParseVariant("spec-request=0.3")
	if err != nil {
		t.Fatal(err)
	}
	if err := v.applies(pods); err != nil {
		t.Fatal(err)
	}
	out := Vary(pods, nil, v, 1)
	restricted := 0
	added := map[string]int{} // newly restricted pods by allowed set
	for i, p := range out {
		q := pods[i]
		if p.Name != q.Name || p.CPUMilli != q.CPUMilli || p.NumGPU != q.NumGPU || p.GPUMilli != q.GPUMilli {
			t.Fatalf("pod %d changed beyond its models: %+v -> %+v", i, q, p)
		}
		if len(q.Models) > 0 && !reflect.DeepEqual(p.Models, q.Models) {
			t.Fatalf("restricted pod %d changed models: %v -> %v", i, q.Models, p.Models)
		}
		if p.GPURequest() == 0 && len(p.Models) > 0 {
			t.Fatalf("CPU-only pod %d restricted", i)
		}
		if len(p.Models) > 0 {
			restricted++
			m := strings.Join(p.Models, "|")
			if m != "T4" && m != "V100M16|V100M32" {
				t.Fatalf("pod %d restricted to %s, not to a set of the list's", i, m)
			}
			if len(q.Models) == 0 {
				added[m]++
			}
		}
	}
	if restricted != 27 { // 30% of the 90 GPU pods
		t.Fatalf("%d of 90 GPU pods restricted, want 27", restricted)
	}
	if added["T4"] < 3 || added["V100M16|V100M32"] < 3 { // drawn from the list's restricted pods, half each
		t.Fatalf("newly restricted pods by set %v: want both of the list's sets drawn", added)
	}
	if !reflect.DeepEqual(out, Vary(pods, nil, v, 1)) {
		t.Fatal("one seed gave two lists")
	}
	for i := range pods {
		pods[i].Models = nil
	}
	if err := v.applies(pods); err == nil || !strings.Contains(err.Error(), "gpu_spec") {
		t.Fatalf("a list without restricted pods: %v, want a refusal naming gpu_spec", err)
	}
}
