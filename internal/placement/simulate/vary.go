package simulate

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
)

// Variant derives a trace the policies were not designed on from a public one (issue 14: tessera
// must beat FGD on traces it has never seen). Each field is the share of GPU pods changed that way.
type Variant struct {
	// Spec restricts pods to one or two GPU models (drawn by the models' GPU counts).
	Spec float64
	// MultiGPU turns pods into 2-, 4- or 8-GPU pods.
	MultiGPU float64
	// Share turns whole-GPU pods into shares (compute drawn from the trace's shares).
	Share float64
	// CPU multiplies GPU pods' CPU requests by 1+CPU (CPU-heavy pods).
	CPU float64
	// MultiGPURequest adds copies of the trace's own multi-GPU pods, drawn at random, until multi-GPU
	// pods ask for this share of the GPU request: how the paper's multigpuX traces are made
	// (openb_pod_list_multigpu20.csv is the default list plus 172 such copies: 20.4% of its GPU
	// request is multi-GPU pods, 7.3% of the default's). Not a share of GPU pods, unlike the others.
	MultiGPURequest float64
	// SpecRequest restricts more of the list's GPU pods, drawn at random, each to the allowed models
	// of one of the list's own restricted pods, also drawn at random, until restricted pods are this
	// share of the GPU pods: how the paper's gpuspecX traces are made (a random sample of GPU pods,
	// whole and shares alike, gets a gpu_spec from the trace's own; openb_pod_list_gpuspec10.csv has
	// 10.2% of its GPU pods restricted, mostly to T4). The list must have restricted pods (Vary
	// returns it unchanged otherwise; tessera-sim refuses).
	SpecRequest float64

	// The cluster's shape (VaryCluster), applied before the pods' so that spec draws from the
	// varied cluster's models. Model keeps only the nodes of one GPU model; Nodes keeps that share of
	// the nodes, drawn at random; Split turns that share of the 8-GPU nodes into four 2-GPU nodes
	// each, with a quarter of the CPU and memory; Merge joins that share of the nodes with at most 4
	// GPUs, in pairs of the same hardware, into nodes of twice the GPUs, CPU and memory; Host scales
	// every node's CPU and memory (0: unchanged; 0.5 halves them, a CPU-starved cluster).
	Model               string
	Nodes, Split, Merge float64
	Host                float64
}

// variantNames lists what ParseVariant reads, for its refusals.
const variantNames = "pods: spec, multigpu, share, cpu, multigpu-request, spec-request; cluster: split, merge, host, nodes, model"

// ParseVariant reads "spec=0.5,multigpu=0.3,share=0.4,cpu=1,multigpu-request=0.4,spec-request=0.2"
// and the cluster's "split=0.7,merge=0.5,host=0.5,nodes=0.5,model=G2".
func ParseVariant(s string) (Variant, error) {
	var v Variant
	for kv := range strings.SplitSeq(s, ",") {
		if kv = strings.TrimSpace(kv); kv == "" {
			continue
		}
		k, val, _ := strings.Cut(kv, "=")
		if k == "model" {
			if val = strings.TrimSpace(val); val == "" {
				return v, fmt.Errorf("variant %q: name a GPU model of the node list (model=G2)", kv)
			}
			v.Model = val
			continue
		}
		f, err := strconv.ParseFloat(val, 64)
		if err != nil || f < 0 {
			return v, fmt.Errorf("variant %q: want name=non-negative number", kv)
		}
		switch k {
		case "spec":
			v.Spec = f
		case "multigpu":
			v.MultiGPU = f
		case "share":
			v.Share = f
		case "cpu":
			v.CPU = f
		case "multigpu-request":
			if f >= 1 {
				return v, fmt.Errorf("variant %q: a share of the GPU request, below 1", kv)
			}
			v.MultiGPURequest = f
		case "spec-request":
			if f > 1 {
				return v, fmt.Errorf("variant %q: a share of the GPU pods, at most 1", kv)
			}
			v.SpecRequest = f
		case "split", "merge":
			if f > 1 {
				return v, fmt.Errorf("variant %q: a share of the nodes, at most 1", kv)
			}
			if k == "split" {
				v.Split = f
			} else {
				v.Merge = f
			}
		case "nodes":
			if f == 0 || f > 1 {
				return v, fmt.Errorf("variant %q: the share of the nodes kept, above 0 and at most 1", kv)
			}
			v.Nodes = f
		case "host":
			if f == 0 {
				return v, fmt.Errorf("variant %q: a factor on every node's CPU and memory, above 0", kv)
			}
			v.Host = f
		default:
			return v, fmt.Errorf("variant %q: unknown name (%s)", kv, variantNames)
		}
	}
	return v, nil
}

// VaryClusterBy derives the variant spec names (ParseVariant) from the cluster and then from the
// pods on the varied cluster, as tessera-sim --vary and the placement benchmark do (seed 1), or says why it
// cannot.
func VaryClusterBy(nodes []Node, pods []Pod, spec string) ([]Node, []Pod, error) {
	v, err := ParseVariant(spec)
	if err != nil {
		return nil, nil, err
	}
	if nodes, err = VaryCluster(nodes, v, 1); err != nil {
		return nil, nil, err
	}
	if err := v.applies(pods); err != nil {
		return nil, nil, err
	}
	return nodes, Vary(pods, nodes, v, 1), nil
}

func (v Variant) changesCluster() bool {
	return v.Model != "" || v.Nodes > 0 || v.Split > 0 || v.Merge > 0 || v.Host > 0
}

// VaryCluster returns a changed copy of nodes (deterministic for a seed): Model, then Nodes, Split,
// Merge and Host, or says why v cannot be made of them (a model the list lacks, a cluster left
// without nodes or GPUs).
func VaryCluster(nodes []Node, v Variant, seed uint64) ([]Node, error) {
	if !v.changesCluster() {
		return nodes, nil
	}
	rng := rand.New(rand.NewPCG(seed, 0xc1a55))
	out := slices.Clone(nodes)
	if v.Model != "" {
		var models []string
		out = slices.DeleteFunc(out, func(n Node) bool {
			if !slices.Contains(models, n.Model) {
				models = append(models, n.Model)
			}
			return n.Model != v.Model
		})
		if len(out) == 0 {
			slices.Sort(models)
			return nil, fmt.Errorf("model=%s: no node of that model (the list has %s)", v.Model, strings.Join(models, ", "))
		}
	}
	if v.Nodes > 0 {
		rng.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
		out = out[:int(math.Round(v.Nodes*float64(len(out))))]
		slices.SortFunc(out, func(a, b Node) int { return strings.Compare(a.Name, b.Name) })
	}
	out = splitNodes(out, v.Split, rng)
	out = mergeNodes(out, v.Merge, rng)
	if v.Host > 0 {
		for i := range out {
			out[i].CPUMilli = int64(math.Round(v.Host * float64(out[i].CPUMilli)))
			out[i].MemMiB = int64(math.Round(v.Host * float64(out[i].MemMiB)))
		}
	}
	gpus := 0
	for _, n := range out {
		gpus += n.GPUs
	}
	if gpus == 0 {
		return nil, fmt.Errorf("variant leaves %d nodes and no GPU: keep more nodes (nodes=F) or another model", len(out))
	}
	return out, nil
}

// pick returns share (rounded) of the nodes that are eligible, drawn by rng, as a set of indexes.
func pick(nodes []Node, share float64, rng *rand.Rand, eligible func(Node) bool) map[int]bool {
	var idx []int
	for i, n := range nodes {
		if eligible(n) {
			idx = append(idx, i)
		}
	}
	rng.Shuffle(len(idx), func(i, j int) { idx[i], idx[j] = idx[j], idx[i] })
	out := map[int]bool{}
	for _, i := range idx[:int(math.Round(share*float64(len(idx))))] {
		out[i] = true
	}
	return out
}

// splitNodes turns share of the 8-GPU nodes into four 2-GPU nodes each ("<name>-s0".."-s3"), each
// with a quarter of the CPU and memory.
func splitNodes(nodes []Node, share float64, rng *rand.Rand) []Node {
	if share == 0 {
		return nodes
	}
	chosen := pick(nodes, share, rng, func(n Node) bool { return n.GPUs == 8 })
	out := make([]Node, 0, len(nodes)+3*len(chosen))
	for i, n := range nodes {
		if !chosen[i] {
			out = append(out, n)
			continue
		}
		for k := range 4 {
			out = append(out, Node{Name: fmt.Sprintf("%s-s%d", n.Name, k), CPUMilli: n.CPUMilli / 4, MemMiB: n.MemMiB / 4, GPUs: 2, Model: n.Model})
		}
	}
	return out
}

// mergeNodes joins share of the nodes with at most 4 GPUs, in pairs of the same hardware (drawn by
// rng within each hardware type; an odd one out stays), into one node "<a>-m-<b>" with the sum of
// both (a valid Kubernetes node name where a and b are: the placement benchmark creates them).
func mergeNodes(nodes []Node, share float64, rng *rand.Rand) []Node {
	if share == 0 {
		return nodes
	}
	chosen := pick(nodes, share, rng, func(n Node) bool { return n.GPUs > 0 && n.GPUs <= 4 })
	byType := map[string][]int{}
	var types []string
	for i, n := range nodes { // in list order, so pairs are deterministic for a seed
		if !chosen[i] {
			continue
		}
		k := fmt.Sprintf("%d/%s/%d/%d", n.GPUs, n.Model, n.CPUMilli, n.MemMiB)
		if byType[k] == nil {
			types = append(types, k)
		}
		byType[k] = append(byType[k], i)
	}
	partner := map[int]int{} // first of a pair -> second; second -> -1
	for _, k := range types {
		ids := byType[k]
		for j := 0; j+1 < len(ids); j += 2 {
			partner[ids[j]], partner[ids[j+1]] = ids[j+1], -1
		}
	}
	out := make([]Node, 0, len(nodes))
	for i, n := range nodes {
		p, ok := partner[i]
		switch {
		case !ok:
			out = append(out, n)
		case p >= 0:
			m := nodes[p]
			out = append(out, Node{Name: n.Name + "-m-" + m.Name, CPUMilli: n.CPUMilli + m.CPUMilli, MemMiB: n.MemMiB + m.MemMiB, GPUs: n.GPUs + m.GPUs, Model: n.Model})
		}
	}
	return out
}

// applies reports why v cannot be made of pods (nil: it can): spec-request draws the allowed models
// from the list's own restricted pods.
func (v Variant) applies(pods []Pod) error {
	if v.SpecRequest > 0 && !slices.ContainsFunc(pods, func(p Pod) bool { return p.GPURequest() > 0 && len(p.Models) > 0 }) {
		return fmt.Errorf("spec-request draws allowed models from the pod list's restricted pods, and it has none (no gpu_spec): use a list such as openb_pod_list_gpuspec10.csv")
	}
	return nil
}

// Vary returns a changed copy of pods (deterministic for a seed).
func Vary(pods []Pod, nodes []Node, v Variant, seed uint64) []Pod {
	rng := rand.New(rand.NewPCG(seed, 0xa11ce))
	gpusOf := map[string]int{}
	for _, n := range nodes {
		gpusOf[n.Model] += n.GPUs
	}
	models := make([]string, 0, len(gpusOf))
	total := 0
	for m, g := range gpusOf {
		models = append(models, m)
		total += g
	}
	slices.Sort(models)
	drawModel := func() string {
		k := rng.IntN(total)
		for _, m := range models {
			if k -= gpusOf[m]; k < 0 {
				return m
			}
		}
		return models[len(models)-1]
	}
	var shares []int
	for _, p := range pods {
		if p.NumGPU == 1 && p.GPUMilli > 0 && p.GPUMilli < 1000 {
			shares = append(shares, p.GPUMilli)
		}
	}
	out := slices.Clone(pods)
	for i := range out {
		p := &out[i]
		if p.GPURequest() == 0 {
			continue
		}
		p.Models = slices.Clone(p.Models)
		if rng.Float64() < v.Share && p.GPUMilli == 1000 && len(shares) > 0 {
			p.NumGPU, p.GPUMilli = 1, shares[rng.IntN(len(shares))]
		} else if rng.Float64() < v.MultiGPU {
			p.NumGPU, p.GPUMilli = []int{2, 4, 8}[rng.IntN(3)], 1000
			p.CPUMilli *= int64(p.NumGPU) / 2
		}
		if rng.Float64() < v.Spec {
			p.Models = []string{drawModel()}
			if rng.IntN(2) == 0 {
				if m := drawModel(); m != p.Models[0] {
					p.Models = append(p.Models, m)
				}
			}
		}
		p.CPUMilli += int64(v.CPU * float64(p.CPUMilli))
	}
	return addMultiGPU(restrictMore(out, v.SpecRequest, rng), v.MultiGPURequest, rng)
}

// restrictMore restricts unrestricted GPU pods, drawn by rng, to the models of restricted pods of
// the list, drawn by rng, while restricted pods are less than share of the GPU pods.
func restrictMore(pods []Pod, share float64, rng *rand.Rand) []Pod {
	var sets [][]string
	var free []int // unrestricted GPU pods
	gpuPods := 0
	for i, p := range pods {
		if p.GPURequest() == 0 {
			continue
		}
		gpuPods++
		if len(p.Models) > 0 {
			sets = append(sets, p.Models)
		} else {
			free = append(free, i)
		}
	}
	for restricted := len(sets); len(sets) > 0 && len(free) > 0 && float64(restricted) < share*float64(gpuPods); restricted++ {
		k := rng.IntN(len(free))
		pods[free[k]].Models = slices.Clone(sets[rng.IntN(len(sets))])
		free[k] = free[len(free)-1]
		free = free[:len(free)-1]
	}
	return pods
}

// addMultiGPU appends copies of pods' multi-GPU pods, drawn by rng, while multi-GPU pods ask for less
// than share of the GPU request.
func addMultiGPU(pods []Pod, share float64, rng *rand.Rand) []Pod {
	var multi []Pod
	var total, fromMulti float64
	for _, p := range pods {
		total += float64(p.GPURequest())
		if p.NumGPU > 1 && p.GPUMilli >= 1000 {
			multi = append(multi, p)
			fromMulti += float64(p.GPURequest())
		}
	}
	for n := 0; len(multi) > 0 && fromMulti < share*total; n++ {
		p := multi[rng.IntN(len(multi))]
		p.Name = fmt.Sprintf("%s-copy%d", p.Name, n)
		p.Models = slices.Clone(p.Models)
		pods = append(pods, p)
		total += float64(p.GPURequest())
		fromMulti += float64(p.GPURequest())
	}
	return pods
}
