package simulate

import (
	"fmt"
	"reflect"
	"regexp"
	"slices"
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

// TestParseClusterVariant: the cluster's names are read beside the pods' and bad values are refused
// with the reason.
func TestParseClusterVariant(t *testing.T) {
	v, err := ParseVariant("split=0.7, multigpu-request=0.3,host=0.5,nodes=0.4,merge=1,model=G2")
	if err != nil {
		t.Fatal(err)
	}
	want := Variant{Split: 0.7, MultiGPURequest: 0.3, Host: 0.5, Nodes: 0.4, Merge: 1, Model: "G2"}
	if !reflect.DeepEqual(v, want) {
		t.Fatalf("got %+v, want %+v", v, want)
	}
	for in, want := range map[string]string{
		"split=1.5":  "at most 1",
		"merge=2":    "at most 1",
		"nodes=0":    "above 0",
		"nodes=1.2":  "at most 1",
		"host=0":     "above 0",
		"host=-1":    "non-negative",
		"host=x":     "non-negative number",
		"model=":     "name a GPU model",
		"splits=0.5": "cluster: split",
	} {
		if _, err := ParseVariant(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: error %v, want one saying %q", in, err, want)
		}
	}
}

// nodeName is a DNS-1123 subdomain (a Kubernetes node name), short of the length limit.
var nodeName = regexp.MustCompile(`^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$`)

// TestVaryCluster: each cluster variant derives the nodes it names (known answers on a small list),
// keeps the GPU capacity where it only reshapes (split, merge, host), is deterministic, and refuses a
// model the list lacks; pod variants then draw models from the varied cluster.
func TestVaryCluster(t *testing.T) {
	var nodes []Node
	for i := range 10 {
		nodes = append(nodes, Node{Name: fmt.Sprintf("g%02d", i), CPUMilli: 96000, MemMiB: 393216, GPUs: 8, Model: "G2"})
	}
	for i := range 6 {
		nodes = append(nodes, Node{Name: fmt.Sprintf("t%02d", i), CPUMilli: 104000, MemMiB: 524288, GPUs: 2, Model: "T4"})
	}
	nodes = append(nodes, Node{Name: "v", CPUMilli: 8000, MemMiB: 32768, GPUs: 1, Model: "V100M16"})
	gpus := func(ns []Node) (g int, cpu int64) {
		for _, n := range ns {
			g += n.GPUs
			cpu += n.CPUMilli
		}
		return
	}
	count := func(ns []Node, gpus int, model string) (k int) {
		for _, n := range ns {
			if n.GPUs == gpus && n.Model == model {
				k++
			}
		}
		return
	}
	g0, cpu0 := gpus(nodes)
	for _, tc := range []struct {
		spec  string
		check func(t *testing.T, out []Node)
	}{
		{"split=0.7", func(t *testing.T, out []Node) {
			if count(out, 8, "G2") != 3 || count(out, 2, "G2") != 28 || len(out) != 17+21 {
				t.Fatalf("split=0.7 of 10 8-GPU nodes: want 3 left and 28 2-GPU nodes, got %v", out)
			}
			for _, n := range out {
				if n.GPUs == 2 && n.Model == "G2" && (n.CPUMilli != 24000 || n.MemMiB != 98304 || !strings.Contains(n.Name, "-s")) {
					t.Fatalf("split node %+v: want a quarter of 96 CPUs and 384 GiB, named <sn>-sK", n)
				}
			}
			if g, cpu := gpus(out); g != g0 || cpu != cpu0 {
				t.Fatalf("split changed the capacity: %d GPUs %d CPU, want %d %d", g, cpu, g0, cpu0)
			}
		}},
		{"merge=1", func(t *testing.T, out []Node) {
			if count(out, 4, "T4") != 3 || count(out, 2, "T4") != 0 || count(out, 1, "V100M16") != 1 {
				t.Fatalf("merge=1: want the 6 T4 nodes as 3 4-GPU nodes and the lone V100 kept, got %v", out)
			}
			for _, n := range out {
				if n.Model == "T4" && (n.CPUMilli != 208000 || n.MemMiB != 1048576 || !strings.Contains(n.Name, "-m-")) {
					t.Fatalf("merged node %+v: want twice a T4 node's CPU and memory, named <a>-m-<b>", n)
				}
			}
			if g, cpu := gpus(out); g != g0 || cpu != cpu0 {
				t.Fatalf("merge changed the capacity: %d GPUs %d CPU, want %d %d", g, cpu, g0, cpu0)
			}
		}},
		{"host=0.5", func(t *testing.T, out []Node) {
			for i, n := range out {
				if n.CPUMilli != nodes[i].CPUMilli/2 || n.MemMiB != nodes[i].MemMiB/2 || n.GPUs != nodes[i].GPUs {
					t.Fatalf("host=0.5: %+v from %+v", n, nodes[i])
				}
			}
		}},
		{"nodes=0.5", func(t *testing.T, out []Node) {
			if len(out) != 9 { // round(8.5)
				t.Fatalf("nodes=0.5 of 17: %d kept, want 9", len(out))
			}
			if !slices.IsSortedFunc(out, func(a, b Node) int { return strings.Compare(a.Name, b.Name) }) {
				t.Fatal("subsample not in name order")
			}
		}},
		{"model=T4", func(t *testing.T, out []Node) {
			if len(out) != 6 || count(out, 2, "T4") != 6 {
				t.Fatalf("model=T4: %v", out)
			}
		}},
		{"split=1,host=0.5", func(t *testing.T, out []Node) {
			if count(out, 2, "G2") != 40 || out[0].CPUMilli != 12000 {
				t.Fatalf("split=1,host=0.5 (composed): %v", out[:2])
			}
		}},
	} {
		t.Run(tc.spec, func(t *testing.T) {
			v, err := ParseVariant(tc.spec)
			if err != nil {
				t.Fatal(err)
			}
			out, err := VaryCluster(nodes, v, 1)
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, out)
			for _, n := range out { // the placement benchmark creates them as Kubernetes nodes
				if !nodeName.MatchString(n.Name) {
					t.Fatalf("node name %q is not a valid Kubernetes node name", n.Name)
				}
			}
			again, _ := VaryCluster(nodes, v, 1)
			if !reflect.DeepEqual(out, again) {
				t.Fatal("one seed gave two clusters")
			}
		})
	}
	if _, _, err := VaryClusterBy(nodes, nil, "model=A100"); err == nil || !strings.Contains(err.Error(), "G2, T4, V100M16") {
		t.Fatalf("model=A100: %v, want a refusal listing the models", err)
	}
	// Pod variants draw models from the varied cluster: on model=T4 every spec'd pod gets T4.
	pods := []Pod{{Name: "a", CPUMilli: 1000, NumGPU: 1, GPUMilli: 1000}, {Name: "b", CPUMilli: 1000, NumGPU: 1, GPUMilli: 500}}
	vn, vp, err := VaryClusterBy(nodes, pods, "model=T4,spec=1")
	if err != nil {
		t.Fatal(err)
	}
	if len(vn) != 6 || !reflect.DeepEqual(vp[0].Models, []string{"T4"}) || !reflect.DeepEqual(vp[1].Models, []string{"T4"}) {
		t.Fatalf("model=T4,spec=1: pods %+v, want every pod restricted to T4", vp)
	}
}
