package e2e

import (
	"fmt"
	"math"
	"strconv"

	"github.com/tessera-gpu/tessera/internal/placement/simulate"
)

// replicateNodes scales a trace's node list for the placement benchmark (TESSERA_BENCH_NODE_COPIES):
// every node appears copies times, copy 0 under its own serial and copy c under "<sn>-c<c>", so a
// scaled cluster has the trace's hardware mix and the paper's protocol (sort by name, permute per
// seed) applies to it unchanged. copies <= 1 returns the list as it is. A copy's name that collides
// with another node's is an error: the live cluster names nodes by serial.
func replicateNodes(nodes []simulate.Node, copies int) ([]simulate.Node, error) {
	if copies <= 1 {
		return nodes, nil
	}
	out := make([]simulate.Node, 0, len(nodes)*copies)
	seen := make(map[string]bool, len(nodes)*copies)
	for _, n := range nodes {
		for c := range copies {
			cp := n
			if c > 0 {
				cp.Name = fmt.Sprintf("%s-c%d", n.Name, c)
			}
			if seen[cp.Name] {
				return nil, fmt.Errorf("node copies: name %q occurs twice (rename the trace's serials or use NODE_COPIES=1)", cp.Name)
			}
			seen[cp.Name] = true
			out = append(out, cp)
		}
	}
	return out, nil
}

// benchNodeName is the live name of the node at position pos of the seed's order among total
// nodes: "%04d-<sn>" as the reference simulator names it, the number widened when total needs more
// digits, so that the smallest name (kube-scheduler's and the extender's tie-break) is the first in
// the order as it is in the simulator's list.
func benchNodeName(pos, total int, sn string) string {
	width := max(4, len(strconv.Itoa(total-1)))
	return fmt.Sprintf("%0*d-%s", width, pos, sn)
}

// arrivedLoad is the GPU request arrived and allocated so far, in percent of capacity, for a replay
// described as UnallocatedAt takes it.
func arrivedLoad(capacity int64, request []int, placed []bool) (arrivedPct, allocatedPct float64) {
	var arrived, allocated int64
	for i, r := range request {
		arrived += int64(r)
		if placed[i] {
			allocated += int64(r)
		}
	}
	return 100 * float64(arrived) / float64(capacity), 100 * float64(allocated) / float64(capacity)
}

// reached100 says whether a replay's arrivals went past the 100% arrived point, so that
// UnallocatedAt's last checkpoint is the paper's number: the arrived load rounds above 100 (every
// arrival that rounds to 100 was replayed), or the replay is the whole arrival list.
func reached100(arrivedPct float64, whole bool) bool {
	return whole || math.RoundToEven(arrivedPct) > 100
}

// placementLine is the benchmark's result line for one policy. A replay that reached the 100%
// point prints tessera-sim's line (policy=<name> unallocated_gpu_pct_at_100=<x.xx>) plus pods/s;
// one stopped before it (TESSERA_BENCH_ARRIVALS) says so and prints the load it reached instead,
// never a number at 100% it did not measure.
func placementLine(policy string, unallocated []float64, arrivedPct, allocatedPct, podsPerSec float64, seed uint64, nodes, replayed, arrivals int) string {
	what := fmt.Sprintf("%d arrivals", arrivals)
	if replayed < arrivals {
		what = fmt.Sprintf("first %d of %d arrivals", replayed, arrivals)
	}
	if reached100(arrivedPct, replayed >= arrivals) {
		return fmt.Sprintf("policy=%s unallocated_gpu_pct_at_100=%.2f pods_per_s=%.1f (live, seed %d, %d nodes, %s)",
			policy, unallocated[len(unallocated)-1], podsPerSec, seed, nodes, what)
	}
	return fmt.Sprintf("policy=%s stopped_before_100pct_arrived arrived_gpu_pct=%.2f unallocated_gpu_pct_at_arrived=%.2f failed_gpu_pct=%.2f pods_per_s=%.1f (live, seed %d, %d nodes, %s; the 100%% point was not reached, so no unallocated_gpu_pct_at_100)",
		policy, arrivedPct, 100-allocatedPct, arrivedPct-allocatedPct, podsPerSec, seed, nodes, what)
}
