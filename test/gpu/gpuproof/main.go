// Command gpuproof is the Go side of test/gpu/run.sh, the real-GPU proof of Tessera's node path and
// vcuda. It is built here and carried to the GPU machine in the bundle (`make gpu-bundle`), so the
// machine needs no Go toolchain. Subcommands:
//
//	gpuproof node      tessera-node cdi generate on this machine; inventory vs nvidia-smi and CUDA; the specs
//	gpuproof container CUDA in runc containers made only from the CDI specs (+ the NRI plugin's vcuda mounts)
//	gpuproof memory    per-context overhead in a container's PID namespace; VMM create/map/release under a cap
//	gpuproof guard     the node agent's memory guard kills a share container that allocates past vcuda
//	gpuproof overhead  cost per intercepted call, real driver and fake driver, with and without vcuda
//	gpuproof feedback  the agent's measured compute file and the raw NVML samples under it, for a known busy schedule
//	gpuproof timeslice how the GPU time-slices two processes (slicebench), and what vcuda charges beside one, per sampling gate
//	gpuproof preflight the sandbox, cgroup2, whether runc (or the namespace fallback) starts a container
//	gpuproof nsrunc    runc's verbs done with unshare, bind mounts and chroot: the fallback where runc cannot run
//	gpuproof refusals  internal/gpu's realnvml test (the strict sim's refusal table) on this machine's NVML
//	gpuproof procaddr  cuGetProcAddress vs dlsym for every hooked symbol, with and without vcuda
//	gpuproof merge     the phases' partial results -> results/<date>-<gpu model>.json
//	gpuproof tables    the markdown tables for vcuda/README.md and docs/install.md
//	gpuproof limits    write a vcuda limits file (for torch_checks.py)
//	gpuproof region    print a vcuda region's busy_ns, the compute limiter's charge (for torch_checks.py)
//	gpuproof notrun    a phase's result saying why it did not run (not a pass)
//
// Each phase writes one JSON file (a Phase) as it finishes, so a run cut short keeps what it measured.
// Every figure says what measured it; a dry run (the fake driver) is marked as such everywhere.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// Check statuses.
const (
	Pass       = "pass"
	Fail       = "fail"
	NotChecked = "not_checked"
)

// Check is one yes/no claim with its evidence.
type Check struct {
	Name       string `json:"name"`
	Status     string `json:"status"`
	Detail     string `json:"detail"`
	MeasuredBy string `json:"measured_by"`
}

// Figure is one number, with its unit, how it was measured and the goal it is held to (if any).
type Figure struct {
	Name       string  `json:"name"`
	Value      float64 `json:"value"`
	Unit       string  `json:"unit"`
	MeasuredBy string  `json:"measured_by"`
	Goal       string  `json:"goal,omitempty"`
	Status     string  `json:"status,omitempty"` // pass/fail against Goal; empty when there is no goal
}

// Phase is what one phase of run.sh measured (torch_checks.py writes the same shape).
type Phase struct {
	Phase   string            `json:"phase"`
	DryRun  bool              `json:"dry_run"`
	Started string            `json:"started"`
	Seconds float64           `json:"seconds"`
	Env     map[string]string `json:"env,omitempty"`
	Checks  []Check           `json:"checks"`
	Figures []Figure          `json:"figures"`
}

func newPhase(name string, dryRun bool) *Phase {
	return &Phase{Phase: name, DryRun: dryRun, Started: time.Now().UTC().Format(time.RFC3339), Env: map[string]string{},
		Checks: []Check{}, Figures: []Figure{}}
}

func (p *Phase) check(name string, ok bool, measuredBy, format string, args ...any) {
	st := Fail
	if ok {
		st = Pass
	}
	p.Checks = append(p.Checks, Check{Name: name, Status: st, Detail: fmt.Sprintf(format, args...), MeasuredBy: measuredBy})
}

func (p *Phase) skip(name, measuredBy, format string, args ...any) {
	p.Checks = append(p.Checks, Check{Name: name, Status: NotChecked, Detail: fmt.Sprintf(format, args...), MeasuredBy: measuredBy})
}

func (p *Phase) figure(f Figure) { p.Figures = append(p.Figures, f) }

// failed counts the failed checks and figures.
func (p *Phase) failed() int {
	n := 0
	for _, c := range p.Checks {
		if c.Status == Fail {
			n++
		}
	}
	for _, f := range p.Figures {
		if f.Status == Fail {
			n++
		}
	}
	return n
}

// write saves the phase to path and prints a one-line summary per check.
func (p *Phase) write(path string, start time.Time) error {
	p.Seconds = time.Since(start).Seconds()
	data, err := json.MarshalIndent(p, "", "  ")
	if err != nil {
		return fmt.Errorf("encode phase %s: %w", p.Phase, err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("results directory: %w", err)
	}
	if err := os.WriteFile(path, append(data, '\n'), 0o644); err != nil {
		return fmt.Errorf("write phase %s: %w", p.Phase, err)
	}
	for _, c := range p.Checks {
		fmt.Printf("%-11s %s: %s\n", c.Status, c.Name, c.Detail)
	}
	for _, f := range p.Figures {
		fmt.Printf("%-11s %s = %.4g %s (%s)\n", orDash(f.Status), f.Name, f.Value, f.Unit, f.MeasuredBy)
	}
	fmt.Printf("phase %s: %d failed, %.1f s, written to %s\n", p.Phase, p.failed(), p.Seconds, path)
	return nil
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

const usage = `usage: gpuproof <preflight|node|refusals|container|memory|procaddr|guard|feedback|overhead|timeslice|merge|tables|limits|region|notrun|nsrunc> [flags]   (see test/gpu/README.md)`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, usage)
		os.Exit(2)
	}
	cmds := map[string]func([]string) error{
		"node": runNode, "container": runContainer, "memory": runMemory, "guard": runGuard, "overhead": runOverhead, "merge": runMerge, "tables": runTables,
		"limits": runLimits, "notrun": runNotRun, "preflight": runPreflight, "nsrunc": runNSRunc, "refusals": runRefusals, "procaddr": runProcAddr,
		"timeslice": runTimeslice, "region": runRegion, "feedback": runFeedback,
	}
	cmd, ok := cmds[os.Args[1]]
	if !ok {
		fmt.Fprintln(os.Stderr, usage)
		os.Exit(2)
	}
	if err := cmd(os.Args[2:]); err != nil {
		fmt.Fprintf(os.Stderr, "gpuproof %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

// errFailed is returned (exit status 1) when a phase ran to its end but some check failed: its
// results are written all the same.
type errFailed struct {
	phase string
	n     int
}

func (e errFailed) Error() string { return fmt.Sprintf("phase %s: %d checks failed", e.phase, e.n) }

func finish(p *Phase, path string, start time.Time) error {
	if err := p.write(path, start); err != nil {
		return err
	}
	if n := p.failed(); n > 0 {
		return errFailed{p.Phase, n}
	}
	return nil
}

// runNotRun writes the result of a phase that could not run here (no GPU in a dry run, no PyTorch on
// the GPU machine): one not_checked check with the reason, so the results say it, and no pass.
func runNotRun(args []string) error {
	fs := flag.NewFlagSet("notrun", flag.ContinueOnError)
	phase := fs.String("phase", "", "the phase (required)")
	reason := fs.String("reason", "", "why it did not run (required)")
	out := fs.String("out", "", "phase result file (required)")
	dry := fs.Bool("dry-run", false, "the simulated node and the fake driver")
	keep := fs.Bool("keep", false, "if -out holds what the phase wrote before it was cut off, add the reason to it")
	cases := fs.String("cases", "", "the phase's cases, one per line (torch_checks.py cases <phase>): each is listed as not run too, so none is missing")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *phase == "" || *reason == "" || *out == "" {
		return fmt.Errorf("-phase, -reason and -out are required")
	}
	p := newPhase(*phase, *dry)
	start := time.Now()
	if data, err := os.ReadFile(*out); *keep && err == nil {
		if err := json.Unmarshal(data, p); err != nil || p.Phase != *phase {
			return fmt.Errorf("%s: not phase %s's result (%v)", *out, *phase, err)
		}
		start = start.Add(-time.Duration(p.Seconds * float64(time.Second)))
	}
	p.skip(*phase+": not run", "run.sh", "%s", *reason)
	for _, c := range strings.Split(*cases, "\n") {
		if c = strings.TrimSpace(c); c != "" {
			p.skip(c, "run.sh", "%s", *reason)
		}
	}
	return p.write(*out, start)
}
