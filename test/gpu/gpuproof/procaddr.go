package main

import (
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// runProcAddr asks cuGetProcAddress_v2 for every hooked base name at CUDA 12000, 12080 and 13000,
// with and without the per-thread-stream flag (procprobe), once on the bare driver and once with
// vcuda preloaded. With vcuda every answer the driver gives must come back as vcuda's hook of the
// same variant the driver picked, the one dlsym names too; a name the driver does not know must
// stay unknown. This is the runtime's path (libcudart resolves everything through it), on the
// real driver whose exports vcuda's table was written from headers alone.
func runProcAddr(args []string) error {
	fs := flag.NewFlagSet("procaddr", flag.ContinueOnError)
	probe := fs.String("procprobe", "procprobe", "procprobe binary")
	cudaprobe := fs.String("cudaprobe", "cudaprobe", "cudaprobe binary (the GPU's UUID for vcuda's limits)")
	table := fs.String("hook-table", "", "vcuda's hook table, lines \"<symbol> <base>\" (required)")
	lib := fs.String("vcuda-library", "", "libvcuda.so (required)")
	work := fs.String("work", "", "folder for the limits file (required)")
	out := fs.String("out", "", "phase result file (required)")
	dry := fs.Bool("dry-run", false, "the fake driver")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *table == "" || *lib == "" || *work == "" || *out == "" {
		return fmt.Errorf("-hook-table, -vcuda-library, -work and -out are required")
	}
	start := time.Now()
	p := newPhase("procaddr", *dry)
	const by = "procprobe: dlopen libcuda.so.1, cuGetProcAddress_v2, dladdr and dlsym"
	bare, err := output(2*time.Minute, driverEnv(), *probe, *table)
	if err != nil {
		p.check("probe runs on the bare driver", false, by, "%v", err)
		return finish(p, *out, start)
	}
	// vcuda needs a limits file naming the GPU it runs on: the one CUDA calls device 0
	info, err := output(time.Minute, driverEnv(), *cudaprobe, "info")
	if err != nil {
		return fmt.Errorf("the GPU's UUID: %w", err)
	}
	limits, err := writeLimits(*work, words(firstMatch(info, `(?m)^device=0 .*$`))["uuid"], 1<<30, 100)
	if err != nil {
		return err
	}
	hooked, err := output(2*time.Minute, driverEnv("LD_PRELOAD="+*lib, api.LimitsEnv+"="+limits), *probe, *table)
	if err != nil {
		p.check("probe runs with vcuda", false, by, "%v", err)
		return finish(p, *out, start)
	}
	compareProcAddr(p, bare, hooked, by)
	return finish(p, *out, start)
}

// driverEnv keeps the driver this process was given (the fake's, with its settings, in a dry
// run) and drops any vcuda, plus extra.
func driverEnv(extra ...string) []string {
	var env []string
	for _, e := range os.Environ() {
		if k, _, _ := strings.Cut(e, "="); k != "LD_PRELOAD" && k != api.LimitsEnv {
			env = append(env, e)
		}
	}
	return append(env, extra...)
}

// compareProcAddr holds procprobe's answers with vcuda against the bare driver's, query by query.
func compareProcAddr(p *Phase, bare, hooked, by string) {
	queries := func(out string) (map[string]map[string]string, []string) {
		m, order := map[string]map[string]string{}, []string(nil)
		for _, line := range strings.Split(out, "\n") {
			if !strings.HasPrefix(line, "q ") {
				continue
			}
			w := words(line)
			key := fmt.Sprintf("%s@%s/flags=%s", w["base"], w["version"], w["flags"])
			m[key] = w
			order = append(order, key)
		}
		return m, order
	}
	driver, order := queries(bare)
	withVC, _ := queries(hooked)
	var wrong []string
	found := 0
	for _, key := range order {
		d, v := driver[key], withVC[key]
		switch {
		case v == nil:
			wrong = append(wrong, key+": no answer with vcuda")
		case d["rc"] != "0":
			if v["rc"] != d["rc"] {
				wrong = append(wrong, fmt.Sprintf("%s: driver rc %s, with vcuda rc %s", key, d["rc"], v["rc"]))
			}
		case v["rc"] != "0" || !strings.Contains(v["lib"], "libvcuda"):
			wrong = append(wrong, fmt.Sprintf("%s: with vcuda rc %s in %s (%s), want vcuda's hook", key, v["rc"], v["lib"], v["sym"]))
		case d["variant"] != "-" && v["variant"] != d["variant"]:
			wrong = append(wrong, fmt.Sprintf("%s: driver gives %s, vcuda gives %s", key, d["variant"], v["variant"]))
		case v["dlsym_same"] != "1":
			wrong = append(wrong, fmt.Sprintf("%s: vcuda's %s is not what dlsym names", key, v["sym"]))
		default:
			found++
		}
	}
	p.check("queries asked", len(order) > 0, by, "%d queries (hooked bases x 12000/12080/13000 x default/per-thread)", len(order))
	p.check("every driver answer is vcuda's hook of the same variant, as dlsym names it", len(order) > 0 && len(wrong) == 0, by,
		"%d of %d answered by vcuda's hook; wrong: %s", found, len(order), firstN(wrong, 12))
}

func firstN(s []string, n int) string {
	if len(s) == 0 {
		return "none"
	}
	if len(s) > n {
		return strings.Join(s[:n], "; ") + fmt.Sprintf("; and %d more", len(s)-n)
	}
	return strings.Join(s, "; ")
}
