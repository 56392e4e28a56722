package main

import (
	"fmt"
	"io"
	"sort"

	"github.com/tessera-gpu/tessera/internal/agent"
	"github.com/tessera-gpu/tessera/vcuda"
)

// writeMetrics renders the Prometheus text format by hand: a handful of gauges do not need a client library.
// readRegion returns a container's accounting region, read without trusting it (nri.Plugin.ReadRegion).
type readRegion func(containerID string) ([]byte, error)

func writeMetrics(w io.Writer, a *agent.Agent, regionPath readRegion) {
	inv := a.Inventory()
	usage := a.Ledger().Usage()
	fmt.Fprintln(w, "# HELP tessera_gpu_memory_bytes Memory of each GPU.\n# TYPE tessera_gpu_memory_bytes gauge")
	for _, g := range inv.GPUs {
		fmt.Fprintf(w, "tessera_gpu_memory_bytes{uuid=%q,index=\"%d\",model=%q} %d\n", g.UUID, g.Index, g.Model, g.MemoryBytes)
	}
	fmt.Fprintln(w, "# HELP tessera_gpu_healthy 1 if the GPU is healthy.\n# TYPE tessera_gpu_healthy gauge")
	for _, g := range inv.GPUs {
		fmt.Fprintf(w, "tessera_gpu_healthy{uuid=%q} %d\n", g.UUID, b2i(g.Healthy))
	}
	uuids := make([]string, 0, len(usage))
	for u := range usage {
		uuids = append(uuids, u)
	}
	sort.Strings(uuids)
	fmt.Fprintln(w, "# HELP tessera_gpu_shares Shares held on each GPU.\n# TYPE tessera_gpu_shares gauge")
	for _, u := range uuids {
		fmt.Fprintf(w, "tessera_gpu_shares{uuid=%q} %d\n", u, usage[u].Shares)
	}
	fmt.Fprintln(w, "# HELP tessera_gpu_shared_memory_bytes Memory given out as share caps on each GPU.\n# TYPE tessera_gpu_shared_memory_bytes gauge")
	for _, u := range uuids {
		fmt.Fprintf(w, "tessera_gpu_shared_memory_bytes{uuid=%q} %d\n", u, usage[u].MemoryBytes)
	}
	fmt.Fprintln(w, "# HELP tessera_gpu_whole 1 if the GPU is held whole.\n# TYPE tessera_gpu_whole gauge")
	for _, u := range uuids {
		fmt.Fprintf(w, "tessera_gpu_whole{uuid=%q} %d\n", u, b2i(usage[u].Whole))
	}
	writeContainerMetrics(w, a, regionPath)
	fmt.Fprintf(w, "# HELP tessera_ledger_entries Containers holding GPU devices.\n# TYPE tessera_ledger_entries gauge\ntessera_ledger_entries %d\n", len(a.Ledger().Entries()))
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// writeContainerMetrics reports what vcuda measured in each share container's accounting region:
// memory in use against the cap, and how long the compute limiter held launches back.
func writeContainerMetrics(w io.Writer, a *agent.Agent, read readRegion) {
	type row struct {
		labels string
		g      vcuda.RegionGPU
	}
	var rows []row
	for _, e := range a.Ledger().Entries() {
		if len(e.Devices) == 0 || e.Devices[0].Whole {
			continue
		}
		data, err := read(e.ContainerID)
		if err != nil {
			continue // the container is gone, or its region is not a regular file
		}
		r, err := vcuda.ParseRegion(data)
		if err != nil {
			continue // no CUDA process has run in the container yet, or it wrote garbage
		}
		for _, g := range r.GPUs {
			rows = append(rows, row{fmt.Sprintf("namespace=%q,pod=%q,container=%q,uuid=%q", e.Namespace, e.Pod, e.Container, g.UUID), g})
		}
	}
	for _, m := range []struct {
		name, help, kind string
		value            func(vcuda.RegionGPU) float64
	}{
		{"tessera_container_gpu_memory_used_bytes", "GPU memory the container's processes hold (vcuda).", "gauge", func(g vcuda.RegionGPU) float64 { return float64(g.Used) }},
		{"tessera_container_gpu_memory_cap_bytes", "The container's GPU memory cap.", "gauge", func(g vcuda.RegionGPU) float64 { return float64(g.MemCap) }},
		{"tessera_container_gpu_throttled_seconds_total", "Time kernel launches waited for the compute limiter.", "counter", func(g vcuda.RegionGPU) float64 { return float64(g.ThrottledNs) / 1e9 }},
		{"tessera_container_gpu_oom_total", "Allocations vcuda refused at the cap.", "counter", func(g vcuda.RegionGPU) float64 { return float64(g.OOMEvents) }},
	} {
		fmt.Fprintf(w, "# HELP %s %s\n# TYPE %s %s\n", m.name, m.help, m.name, m.kind)
		for _, r := range rows {
			fmt.Fprintf(w, "%s{%s} %g\n", m.name, r.labels, m.value(r.g))
		}
	}
}
