package main

import (
	"fmt"
	"io"
	"sort"

	"github.com/tessera-gpu/tessera/agent"
)

// writeMetrics renders the Prometheus text format by hand: a handful of gauges do not need a client library.
func writeMetrics(w io.Writer, a *agent.Agent) {
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
	fmt.Fprintf(w, "# HELP tessera_ledger_entries Containers holding GPU devices.\n# TYPE tessera_ledger_entries gauge\ntessera_ledger_entries %d\n", len(a.Ledger().Entries()))
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}
