// Package simulate replays an openb cluster trace (Alibaba cluster-trace-gpu-v2023, published with
// Weng et al., "Beware of Fragmentation", USENIX ATC 2023) through the extender's placement engine:
// the same Candidates and policies that filter, prioritize and bind run in the server.
package simulate

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/tessera-gpu/tessera/internal/placement"
)

// Node is one row of openb_node_list_gpu_node.csv.
type Node struct {
	Name     string
	CPUMilli int64
	MemMiB   int64
	GPUs     int
	Model    string
}

// Pod is one row of an openb pod list.
type Pod struct {
	Name     string
	CPUMilli int64
	MemMiB   int64
	NumGPU   int
	GPUMilli int
	// Models is the gpu_spec column split on "|" (nil: any model).
	Models []string
}

// GPURequest is the pod's GPU request in per-mille (num_gpu x gpu_milli).
func (p *Pod) GPURequest() int { return p.NumGPU * p.GPUMilli }

// Request converts the pod to the engine's request: gpu_milli < 1000 is one share with that compute
// (GPU memory is not in the trace, so shares take none), otherwise num_gpu whole GPUs.
func (p *Pod) Request() *placement.Request {
	r := &placement.Request{CPUMilli: p.CPUMilli, MemMiB: p.MemMiB, Models: p.Models}
	switch {
	case p.NumGPU == 0 || p.GPUMilli == 0:
	case p.GPUMilli < placement.MilliPerGPU:
		r.Containers = []placement.ContainerShape{{Name: "main", Shares: p.NumGPU, Milli: p.GPUMilli}}
	default:
		r.Containers = []placement.ContainerShape{{Name: "main", Whole: p.NumGPU}}
	}
	return r
}

// readCSV returns the rows of a CSV file as maps keyed by the header.
func readCSV(path string, required []string) ([]map[string]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open trace: %w", err)
	}
	defer f.Close()
	cr := csv.NewReader(f)
	header, err := cr.Read()
	if err != nil {
		return nil, fmt.Errorf("read header of %s: %w", path, err)
	}
	col := map[string]int{}
	for i, h := range header {
		col[strings.TrimSpace(h)] = i
	}
	for _, r := range required {
		if _, ok := col[r]; !ok {
			return nil, fmt.Errorf("%s: missing column %q (have %v)", path, r, header)
		}
	}
	var rows []map[string]string
	for line := 2; ; line++ {
		rec, err := cr.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%s line %d: %w", path, line, err)
		}
		m := make(map[string]string, len(col))
		for name, i := range col {
			if i < len(rec) {
				m[name] = strings.TrimSpace(rec[i])
			}
		}
		rows = append(rows, m)
	}
	return rows, nil
}

func atoi(path string, line int, row map[string]string, key string) (int64, error) {
	v, err := strconv.ParseInt(row[key], 10, 64)
	if err != nil || v < 0 {
		return 0, fmt.Errorf("%s row %d: column %s: want a non-negative integer, got %q", path, line, key, row[key])
	}
	return v, nil
}

// LoadNodes reads a node list.
func LoadNodes(path string) ([]Node, error) {
	rows, err := readCSV(path, []string{"sn", "cpu_milli", "memory_mib", "gpu", "model"})
	if err != nil {
		return nil, err
	}
	out := make([]Node, 0, len(rows))
	for i, row := range rows {
		n := Node{Name: row["sn"], Model: row["model"]}
		var g int64
		for key, dst := range map[string]*int64{"cpu_milli": &n.CPUMilli, "memory_mib": &n.MemMiB, "gpu": &g} {
			if *dst, err = atoi(path, i+1, row, key); err != nil {
				return nil, err
			}
		}
		n.GPUs = int(g)
		out = append(out, n)
	}
	return out, nil
}

// LoadPods reads a pod list; gpu_spec is optional.
func LoadPods(path string) ([]Pod, error) {
	rows, err := readCSV(path, []string{"name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"})
	if err != nil {
		return nil, err
	}
	out := make([]Pod, 0, len(rows))
	for i, row := range rows {
		p := Pod{Name: row["name"]}
		var ng, gm int64
		for key, dst := range map[string]*int64{"cpu_milli": &p.CPUMilli, "memory_mib": &p.MemMiB, "num_gpu": &ng, "gpu_milli": &gm} {
			if *dst, err = atoi(path, i+1, row, key); err != nil {
				return nil, err
			}
		}
		if gm > placement.MilliPerGPU || (gm < placement.MilliPerGPU && ng > 1) {
			return nil, fmt.Errorf("%s row %d: gpu_milli %d with num_gpu %d: shares below a whole GPU come one per pod", path, i+1, gm, ng)
		}
		p.NumGPU, p.GPUMilli = int(ng), int(gm)
		if spec := row["gpu_spec"]; spec != "" {
			p.Models = strings.Split(spec, "|")
		}
		out = append(out, p)
	}
	return out, nil
}
