package simulate

import (
	"fmt"
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
}

// ParseVariant reads "spec=0.5,multigpu=0.3,share=0.4,cpu=1,multigpu-request=0.4,spec-request=0.2".
func ParseVariant(s string) (Variant, error) {
	var v Variant
	for kv := range strings.SplitSeq(s, ",") {
		if kv = strings.TrimSpace(kv); kv == "" {
			continue
		}
		k, val, _ := strings.Cut(kv, "=")
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
		default:
			return v, fmt.Errorf("variant %q: unknown name (spec, multigpu, share, cpu, multigpu-request, spec-request)", kv)
		}
	}
	return v, nil
}

// VaryBy derives the variant spec names (ParseVariant) from pods, as tessera-sim --vary and the
// placement benchmark do (seed 1), or says why it cannot.
func VaryBy(pods []Pod, nodes []Node, spec string) ([]Pod, error) {
	v, err := ParseVariant(spec)
	if err != nil {
		return nil, err
	}
	if err := v.applies(pods); err != nil {
		return nil, err
	}
	return Vary(pods, nodes, v, 1), nil
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
