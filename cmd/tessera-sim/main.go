// Command tessera-sim replays an openb GPU cluster trace through the extender's placement policies
// and reports the unallocated GPU share as the workload arrives (the FGD paper's protocol).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement/simulate"
	"github.com/tessera-gpu/tessera/internal/telemetry"
)

func main() {
	err := run(context.Background(), os.Args[1:], os.Stdout, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return // the usage was asked for and printed
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "tessera-sim:", err)
		os.Exit(1)
	}
}

type options struct {
	nodes, pods string
	policies    []string
	seeds       int
	firstSeed   uint64
	inflate     float64
	limit       int
	workers     int
	shapes      string
	variant     string
	version     bool
}

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	fs := flag.NewFlagSet("tessera-sim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := &options{}
	var policies string
	fs.StringVar(&o.nodes, "nodes", "../shared/data/openb/openb_node_list_gpu_node.csv", "node list CSV (columns sn, cpu_milli, memory_mib, gpu, model)")
	fs.StringVar(&o.pods, "pods", "../shared/data/openb/openb_pod_list_default.csv", "pod list CSV (columns name, cpu_milli, memory_mib, num_gpu, gpu_milli[, gpu_spec])")
	fs.StringVar(&policies, "policy", api.PolicyTessera, "comma-separated placement policies to compare: "+strings.Join(api.KnownPolicies, ", ")+" (tessera is this project's policy)")
	fs.IntVar(&o.seeds, "seeds", 10, "number of arrival orders (seeds first-seed, first-seed+1, ...); the report shows medians")
	fs.Uint64Var(&o.firstSeed, "first-seed", 42, "first seed (the published protocol uses 42..51)")
	fs.Float64Var(&o.inflate, "inflate", 1.3, "resample pods until the GPU request reaches this multiple of cluster capacity")
	fs.IntVar(&o.limit, "limit", 0, "use only the first N pods of the pod list (0: all; for quick runs and tests)")
	fs.IntVar(&o.workers, "workers", runtime.GOMAXPROCS(0), "runs simulated in parallel")
	fs.StringVar(&o.shapes, "shapes", "paper", "typical task shapes: paper (from the whole pod list, the FGD paper's published protocol) or online (learned from the pods arrived so far, what the live extender can know)")
	fs.StringVar(&o.variant, "vary", "", "derive a variant of the pod list: spec=F,multigpu=F,share=F,cpu=F (shares of GPU pods restricted to models, made 2/4/8-GPU, made shares, CPU x(1+F)), multigpu-request=F (copies of the list's multi-GPU pods added until they ask for F of the GPU request, as the paper's multigpuX traces), spec-request=F (GPU pods restricted to the models of the list's own restricted pods until F of the GPU pods are, as the paper's gpuspecX traces); and of the cluster, composable with those: split=F (F of the 8-GPU nodes made four 2-GPU nodes with a quarter of the CPU and memory each), merge=F (F of the nodes with at most 4 GPUs joined in pairs of the same hardware), host=F (every node's CPU and memory x F), nodes=F (F of the nodes kept, drawn at random), model=M (only the nodes of GPU model M); deterministic")
	fs.BoolVar(&o.version, "version", false, "print the version and exit")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if o.version {
		return o, nil
	}
	for p := range strings.SplitSeq(policies, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		if !api.IsKnownPolicy(p) && !simulate.IsDRAPolicy(p) {
			return nil, fmt.Errorf("--policy: unknown policy %q (known: %s; DRA's allocator as the scheduler places claims: %s)", p,
				strings.Join(api.KnownPolicies, ", "), strings.Join(simulate.DRAPolicies, ", "))
		}
		o.policies = append(o.policies, p)
	}
	switch {
	case len(o.policies) == 0:
		return nil, fmt.Errorf("--policy: name at least one policy")
	case o.seeds < 1:
		return nil, fmt.Errorf("--seeds must be >= 1, got %d", o.seeds)
	case o.inflate <= 0:
		return nil, fmt.Errorf("--inflate must be > 0, got %g", o.inflate)
	case o.workers < 1:
		o.workers = 1
	}
	return o, nil
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	if o.version {
		telemetry.PrintVersion(stdout, "tessera-sim")
		return nil
	}
	nodes, err := simulate.LoadNodes(o.nodes)
	if err != nil {
		return err
	}
	pods, err := simulate.LoadPods(o.pods)
	if err != nil {
		return err
	}
	if o.limit > 0 && o.limit < len(pods) {
		pods = pods[:o.limit]
	}
	if o.variant != "" {
		if nodes, pods, err = simulate.VaryClusterBy(nodes, pods, o.variant); err != nil {
			return fmt.Errorf("--vary: %w", err)
		}
	}
	cluster := simulate.NewCluster(nodes, pods)
	var shapes string
	switch o.shapes {
	case "paper":
		cluster.UseOracleShapes()
		shapes = "from the whole pod list (the paper's protocol)"
	case "online":
		shapes = "learned online from arrived pods"
	default:
		return fmt.Errorf("--shapes must be paper or online, got %q", o.shapes)
	}
	fmt.Fprintf(stdout, "trace: %d nodes, %d GPUs, %d pods (%s); %d seeds from %d, inflate %.2f; typical shapes %s\n",
		len(nodes), cluster.Capacity/1000, len(pods), o.pods, o.seeds, o.firstSeed, o.inflate, shapes)

	type job struct {
		policy string
		seed   uint64
	}
	jobs := make(chan job)
	results := map[string][]simulate.Result{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	var firstErr error
	for w := 0; w < o.workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				res, err := cluster.Run(j.policy, j.seed, o.inflate)
				mu.Lock()
				if err != nil && firstErr == nil {
					firstErr = err
				}
				results[j.policy] = append(results[j.policy], res)
				mu.Unlock()
			}
		}()
	}
	for _, p := range o.policies {
		for s := 0; s < o.seeds; s++ {
			select {
			case jobs <- job{p, o.firstSeed + uint64(s)}:
			case <-ctx.Done():
			}
		}
	}
	close(jobs)
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	return report(stdout, o.policies, results, cluster.Capacity)
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func report(w io.Writer, policies []string, results map[string][]simulate.Result, capacity int64) error {
	fmt.Fprintf(w, "\nunallocated GPU %% (median over seeds) by arrived workload\n")
	fmt.Fprintf(w, "%-10s", "policy")
	for _, c := range simulate.Checkpoints {
		fmt.Fprintf(w, " %8s", fmt.Sprintf("%.0f%%", c))
	}
	fmt.Fprintf(w, " %15s %10s\n", "min-max@100%", "failed")
	for _, p := range policies {
		rs := results[p]
		fmt.Fprintf(w, "%-10s", p)
		for i := range simulate.Checkpoints {
			var xs []float64
			for _, r := range rs {
				xs = append(xs, r.Unallocated[i])
			}
			fmt.Fprintf(w, " %8.2f", median(xs))
		}
		var at100, failed []float64
		for _, r := range rs {
			at100 = append(at100, r.Unallocated[len(simulate.Checkpoints)-1])
			failed = append(failed, float64(r.Failed))
		}
		fmt.Fprintf(w, " %7.2f-%-7.2f %10.0f\n", slices.Min(at100), slices.Max(at100), median(failed))
	}
	fmt.Fprintf(w, "\nfailed GPU request before 100%% arrival, %% of capacity (median over seeds) by pod class\n")
	for _, p := range policies {
		classes := map[string][]float64{}
		for _, r := range results[p] {
			for c := range r.FailedMilli {
				classes[c] = nil
			}
		}
		names := slices.Sorted(maps.Keys(classes))
		fmt.Fprintf(w, "%-10s", p)
		for _, c := range names {
			var xs []float64
			for _, r := range results[p] {
				xs = append(xs, 100*float64(r.FailedMilli[c])/float64(capacity))
			}
			fmt.Fprintf(w, " %s=%.2f", c, median(xs))
		}
		fmt.Fprintf(w, "   free at 100%%:")
		for _, c := range []string{"partial", "floor", "offline", "whole", "whole-cpu<4"} {
			var xs []float64
			for _, r := range results[p] {
				xs = append(xs, 100*float64(r.Free100[c])/float64(capacity))
			}
			fmt.Fprintf(w, " %s=%.2f", c, median(xs))
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintln(w)
	for _, p := range policies {
		var at100 []float64
		for _, r := range results[p] {
			at100 = append(at100, r.Unallocated[len(simulate.Checkpoints)-1])
		}
		fmt.Fprintf(w, "policy=%s unallocated_gpu_pct_at_100=%.2f\n", p, median(at100))
	}
	for _, p := range policies { // per seed, so that medians over other seed sets can be taken
		rs := slices.Clone(results[p])
		slices.SortFunc(rs, func(a, b simulate.Result) int { return int(a.Seed) - int(b.Seed) })
		for _, r := range rs {
			fmt.Fprintf(w, "seed=%d policy=%s unallocated_gpu_pct_at_100=%.2f\n", r.Seed, p, r.Unallocated[len(simulate.Checkpoints)-1])
		}
	}
	return nil
}
