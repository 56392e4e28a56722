package main

import (
	"strconv"
	"strings"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// mixedModels is tessera.dev/gpu-model on a node with GPUs of several models.
const mixedModels = "mixed"

// fixedGPULabels are the GPU label keys every published set has a say on (absent ones are
// removed), besides api.LabelPrefixModelCount's; the -node-restriction admission policy lets the
// agent write these and no other label.
var fixedGPULabels = []string{api.LabelGPUModel, api.LabelGPUCount, api.LabelGPUMemory, api.LabelGPUComputeMajor, api.LabelGPUComputeMinor, api.LabelMIGCapable, api.LabelDriverVersion, api.LabelCUDAVersion}

// gpuNodeLabels are the labels describing the node's GPUs: every model present (not GPU 0's
// alone), the smallest memory and lowest compute capability, whether any GPU supports MIG.
func gpuNodeLabels(inv *api.NodeInventory, migCapable func(uuid string) bool) map[string]string {
	if len(inv.GPUs) == 0 {
		return map[string]string{}
	}
	l := map[string]string{api.LabelGPUCount: strconv.Itoa(len(inv.GPUs)), api.LabelMIGCapable: "false"}
	if v := api.GPUModelLabelValue(inv.DriverVersion); v != "" {
		l[api.LabelDriverVersion] = v
	}
	if v := api.GPUModelLabelValue(inv.CUDAVersion); v != "" {
		l[api.LabelCUDAVersion] = v
	}
	models := map[string]int{}
	minMem := int64(-1)
	ccMajor, ccMinor := -1, -1
	for _, g := range inv.GPUs {
		models[api.GPUModelLabelValue(g.Model)]++
		if minMem < 0 || g.MemoryBytes < minMem {
			minMem = g.MemoryBytes
		}
		if maj, mnr, ok := parseCC(g.ComputeCapability); ok && (ccMajor < 0 || maj < ccMajor || maj == ccMajor && mnr < ccMinor) {
			ccMajor, ccMinor = maj, mnr
		}
		if migCapable(g.UUID) {
			l[api.LabelMIGCapable] = "true"
		}
	}
	for m, n := range models {
		if m != "" {
			l[api.LabelPrefixModelCount+m] = strconv.Itoa(n)
		}
	}
	if len(models) == 1 {
		for m := range models {
			l[api.LabelGPUModel] = m
		}
	} else {
		l[api.LabelGPUModel] = mixedModels
	}
	l[api.LabelGPUMemory] = strconv.FormatInt(minMem>>20, 10)
	if ccMajor >= 0 {
		l[api.LabelGPUComputeMajor], l[api.LabelGPUComputeMinor] = strconv.Itoa(ccMajor), strconv.Itoa(ccMinor)
	}
	return l
}

func parseCC(cc string) (int, int, bool) {
	a, b, ok := strings.Cut(cc, ".")
	maj, err1 := strconv.Atoi(a)
	mnr, err2 := strconv.Atoi(b)
	return maj, mnr, ok && err1 == nil && err2 == nil
}

// labelsPatch is the labels part of a merge patch that makes the Node's Tessera GPU labels want:
// keys of ours the Node has (current) or may have and want lacks are removed (null).
func labelsPatch(want, current map[string]string) map[string]any {
	p := map[string]any{}
	for _, k := range fixedGPULabels {
		p[k] = nil
	}
	for k := range current {
		if strings.HasPrefix(k, api.LabelPrefixModelCount) {
			p[k] = nil
		}
	}
	for k, v := range want {
		p[k] = v
	}
	return p
}
