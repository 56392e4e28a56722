package placement

import (
	"encoding/binary"
	"maps"
	"slices"
	"strings"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// ContainerShape is the GPU need of one container in placement units.
type ContainerShape struct {
	Name string
	// Whole is the number of exclusive GPUs.
	Whole int
	// Shares is the number of shares, each on a different GPU.
	Shares int
	// Memory is each share's memory cap in bytes; MemoryPercent the same in percent of its GPU.
	Memory        int64
	MemoryPercent int
	// Milli is each share's reserved compute, per-mille (0 = nothing reserved).
	Milli int
	MIG   map[string]int
	Mdev  map[string]int
}

// shareMemoryOn is the memory one share takes on a GPU of gpuMemory bytes.
func (c *ContainerShape) shareMemoryOn(gpuMemory int64) int64 {
	if c.MemoryPercent > 0 {
		return gpuMemory * int64(c.MemoryPercent) / 100
	}
	return c.Memory
}

// Request is a pod's placement request.
type Request struct {
	// Key is namespace/name (empty in the simulator).
	Key        string
	Containers []ContainerShape
	// CPUMilli and MemMiB are hard constraints where the node tracks them (the simulator).
	CPUMilli, MemMiB int64
	// Models restricts the pod to GPUs of these models (nil: any).
	Models []string
	// ExcludeModels keeps the pod off GPUs of these models (nil: none), whatever Models says.
	ExcludeModels []string
	// Class is the workload class (api.WorkloadExperiment/Training/Inference or "").
	Class string
	// Policy overrides the engine's default policy ("" = default).
	Policy string
}

// GPUMilli is the GPU compute the request takes, per-mille: 1000 per whole GPU plus each share's compute.
func (r *Request) GPUMilli() int {
	s := 0
	for _, c := range r.Containers {
		s += c.Whole*MilliPerGPU + c.Shares*c.Milli
	}
	return s
}

// WantsGPU reports whether the request places any whole GPU or share.
func (r *Request) WantsGPU() bool {
	for _, c := range r.Containers {
		if c.Whole > 0 || c.Shares > 0 {
			return true
		}
	}
	return false
}

// sharesOnly reports whether the request places shares and no whole GPU.
func (r *Request) sharesOnly() bool {
	shares := false
	for _, c := range r.Containers {
		if c.Whole > 0 {
			return false
		}
		shares = shares || c.Shares > 0
	}
	return shares
}

// modelAllowed reports whether a GPU model satisfies the request's model constraint: one of
// Models (when any is named) and none of ExcludeModels. A pod names models as the node label spells
// them or as NVML does (api.GPUModelMatches).
func (r *Request) modelAllowed(model string) bool {
	return (len(r.Models) == 0 || api.GPUModelMatchesAny(r.Models, model)) &&
		(len(r.ExcludeModels) == 0 || !api.GPUModelMatchesAny(r.ExcludeModels, model))
}

// includedModels are the models the request names to include less those it excludes: the model
// pressure's demand (a pod that only excludes models asks for no model's room in particular).
func (r *Request) includedModels() []string {
	if len(r.ExcludeModels) == 0 {
		return r.Models
	}
	var in []string
	for _, m := range r.Models {
		if !slices.ContainsFunc(r.ExcludeModels, func(x string) bool { return api.SameGPUModel(x, m) }) {
			in = append(in, m)
		}
	}
	return in
}

// modelRestricted reports whether the request names models to include or exclude.
func (r *Request) modelRestricted() bool { return len(r.Models) > 0 || len(r.ExcludeModels) > 0 }

// modelConstraint spells the request's model constraint for messages and keys.
func (r *Request) modelConstraint() string {
	s := strings.Join(r.Models, "|")
	if len(r.ExcludeModels) > 0 {
		if s != "" {
			s += " "
		}
		s += "not " + strings.Join(r.ExcludeModels, "|")
	}
	return s
}

// Digest is an exact encoding of everything placement reads of the request (not its Key): two
// requests with one digest place and score the same way on the same node and shapes, so outcomes
// can be remembered per digest (the extender's evaluation memo).
func (r *Request) Digest() string {
	b := make([]byte, 0, 64)
	str := func(s string) { b = binary.AppendUvarint(b, uint64(len(s))); b = append(b, s...) }
	num := func(v int64) { b = binary.AppendVarint(b, v) }
	counts := func(m map[string]int) {
		num(int64(len(m)))
		for _, k := range slices.Sorted(maps.Keys(m)) {
			str(k)
			num(int64(m[k]))
		}
	}
	num(r.CPUMilli)
	num(r.MemMiB)
	str(r.Class)
	str(r.Policy)
	num(int64(len(r.Models)))
	for _, m := range r.Models {
		str(m)
	}
	num(int64(len(r.ExcludeModels)))
	for _, m := range r.ExcludeModels {
		str(m)
	}
	num(int64(len(r.Containers)))
	for i := range r.Containers {
		c := &r.Containers[i]
		str(c.Name) // Unfit messages name the container
		num(int64(c.Whole))
		num(int64(c.Shares))
		num(c.Memory)
		num(int64(c.MemoryPercent))
		num(int64(c.Milli))
		counts(c.MIG)
		counts(c.Mdev)
	}
	return string(b)
}
