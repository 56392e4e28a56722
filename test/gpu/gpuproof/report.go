package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"
)

// phaseOrder is the order of run.sh's phases in the results file and the tables: the order
// device-run.sh runs them in, most important first.
var phaseOrder = []string{"preflight", "node", "refusals", "container", "torch", "memory", "procaddr", "guard", "feedback", "overhead", "timeslice", "compute"}

// Results is test/gpu/results/<date>-<gpu model>.json: every phase that ran, and what it ran on.
type Results struct {
	Schema    int               `json:"schema"`
	DryRun    bool              `json:"dry_run"`
	Date      string            `json:"date"`
	GPUModel  string            `json:"gpu_model"`
	Driver    string            `json:"driver_version"`
	CUDA      string            `json:"cuda_driver_version"`
	Torch     string            `json:"torch_version,omitempty"`
	Env       map[string]string `json:"env"`
	Failed    int               `json:"failed"`
	Missing   []string          `json:"phases_missing"`
	Phases    []*Phase          `json:"phases"`
	Generated string            `json:"generated_by"`
}

func runMerge(args []string) error {
	fs := flag.NewFlagSet("merge", flag.ContinueOnError)
	dir := fs.String("dir", "", "folder of the phases' files (<phase>.json) (required)")
	outDir := fs.String("out-dir", "", "where results/<date>-<gpu model>.json goes (required)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *dir == "" || *outDir == "" {
		return fmt.Errorf("-dir and -out-dir are required")
	}
	r, err := merge(*dir)
	if err != nil {
		return err
	}
	data, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	path := filepath.Join(*outDir, r.Date+"-"+slug(r.GPUModel)+".json")
	if err := os.MkdirAll(*outDir, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(path, append(data, '\n'), 0o644); err != nil {
		return fmt.Errorf("write the results: %w", err)
	}
	fmt.Printf("%s: %d phases, %d failed, missing %v\n", path, len(r.Phases), r.Failed, r.Missing)
	return nil
}

func merge(dir string) (*Results, error) {
	r := &Results{Schema: 1, Date: time.Now().UTC().Format("2006-01-02"), Env: map[string]string{}, Missing: []string{},
		Generated: "test/gpu/run.sh (gpuproof merge)"}
	for _, name := range phaseOrder {
		data, err := os.ReadFile(filepath.Join(dir, name+".json"))
		if os.IsNotExist(err) {
			r.Missing = append(r.Missing, name)
			continue
		}
		if err != nil {
			return nil, err
		}
		p := &Phase{}
		if err := json.Unmarshal(data, p); err != nil {
			return nil, fmt.Errorf("phase file %s.json: %w", name, err)
		}
		if p.Phase != name {
			return nil, fmt.Errorf("phase file %s.json holds phase %q", name, p.Phase)
		}
		r.Phases = append(r.Phases, p)
		r.DryRun = r.DryRun || p.DryRun
		r.Failed += p.failed()
		for k, v := range p.Env {
			r.Env[name+"."+k] = v
		}
	}
	if len(r.Phases) == 0 {
		return nil, fmt.Errorf("no phase results in %s", dir)
	}
	r.GPUModel = first(r.Env["node.gpu_model"], r.Env["container.gpu_model"], r.Env["torch.gpu_model"], "unknown-gpu")
	r.Driver = first(r.Env["node.driver_version"], r.Env["torch.driver_version"], "unknown")
	r.CUDA = first(r.Env["node.cuda_driver_version"], r.Env["torch.cuda_driver_version"], "unknown")
	r.Torch = r.Env["torch.torch_version"]
	return r, nil
}

func first(vals ...string) string {
	for _, v := range vals {
		if v != "" {
			return v
		}
	}
	return ""
}

var nonSlug = regexp.MustCompile(`[^A-Za-z0-9.]+`)

func slug(s string) string { return strings.Trim(nonSlug.ReplaceAllString(s, "-"), "-") }

// sections: which phases go to which document.
var sections = map[string][]string{
	"node":  {"preflight", "node", "refusals", "container", "guard", "feedback"}, // docs/install.md
	"vcuda": {"torch", "memory", "procaddr", "overhead", "timeslice", "compute"}, // vcuda/README.md
}

func runTables(args []string) error {
	fs := flag.NewFlagSet("tables", flag.ContinueOnError)
	section := fs.String("section", "vcuda", "node (docs/install.md) or vcuda (vcuda/README.md)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		return fmt.Errorf("usage: gpuproof tables [-section node|vcuda] results.json")
	}
	phases, ok := sections[*section]
	if !ok {
		return fmt.Errorf("-section must be node or vcuda, got %q", *section)
	}
	data, err := os.ReadFile(fs.Arg(0))
	if err != nil {
		return err
	}
	r := &Results{}
	if err := json.Unmarshal(data, r); err != nil {
		return fmt.Errorf("decode %s: %w", fs.Arg(0), err)
	}
	return tables(os.Stdout, r, filepath.Base(fs.Arg(0)), phases)
}

// tables renders the checks and figures of the given phases as markdown.
func tables(w io.Writer, r *Results, file string, phases []string) error {
	if r.DryRun {
		fmt.Fprintf(w, "**DRY RUN on the simulated node and vcuda's fake driver: no GPU was used; no number below is a GPU's.**\n\n")
	}
	fmt.Fprintf(w, "%s, driver %s, CUDA %s", r.GPUModel, r.Driver, r.CUDA)
	if r.Torch != "" {
		fmt.Fprintf(w, ", PyTorch %s", r.Torch)
	}
	fmt.Fprintf(w, "; %s (`test/gpu/results/%s`, %d failed).\n", r.Date, file, r.Failed)
	for _, name := range phases {
		i := slices.IndexFunc(r.Phases, func(p *Phase) bool { return p.Phase == name })
		if i < 0 {
			fmt.Fprintf(w, "\n**%s**: not run.\n", name)
			continue
		}
		p := r.Phases[i]
		fmt.Fprintf(w, "\n**%s** (%.0f s)\n", name, p.Seconds)
		if len(p.Checks) > 0 {
			fmt.Fprintf(w, "\n| check | result | detail | measured by |\n| --- | --- | --- | --- |\n")
			for _, c := range p.Checks {
				fmt.Fprintf(w, "| %s | %s | %s | %s |\n", cell(c.Name), c.Status, cell(c.Detail), cell(c.MeasuredBy))
			}
		}
		if name == "overhead" {
			overheadTable(w, p)
		}
		if len(p.Figures) > 0 {
			fmt.Fprintf(w, "\n| figure | value | goal | result | measured by |\n| --- | --- | --- | --- | --- |\n")
			for _, f := range p.Figures {
				fmt.Fprintf(w, "| %s | %s %s | %s | %s | %s |\n", cell(f.Name), num(f.Value), f.Unit, cell(orDash(f.Goal)), orDash(f.Status), cell(f.MeasuredBy))
			}
		}
	}
	return nil
}

func cell(s string) string {
	s = strings.ReplaceAll(s, "|", "\\|")
	if len(s) > 160 {
		s = s[:157] + "..."
	}
	return s
}

func num(v float64) string {
	if v == float64(int64(v)) && (v > 1e4 || v < -1e4) {
		return fmt.Sprintf("%d", int64(v))
	}
	return fmt.Sprintf("%.4g", v)
}

var overheadName = regexp.MustCompile(`^(real|fake) driver: (\w+), (no vcuda|added by vcuda at (\d+)% compute)$`)

// overheadTable puts the real driver's figure next to the fake driver's, call by call: the
// summary of the overhead phase (the full figures, with how each was measured, follow it).
func overheadTable(w io.Writer, p *Phase) {
	type key struct{ mode, setting string }
	vals := map[key]map[string]string{}
	var order []key
	for _, f := range p.Figures {
		m := overheadName.FindStringSubmatch(f.Name)
		if m == nil {
			continue
		}
		k := key{m[2], "without vcuda (driver call alone)"}
		if m[4] != "" {
			k.setting = "added by vcuda, container at " + m[4] + "% compute"
		}
		if vals[k] == nil {
			vals[k] = map[string]string{}
			order = append(order, k)
		}
		vals[k][m[1]] = num(f.Value) + " ns"
	}
	if len(order) == 0 {
		return
	}
	fmt.Fprintf(w, "\n| call | | real driver | fake driver |\n| --- | --- | --- | --- |\n")
	calls := map[string]string{"alloc": "`cuMemAlloc_v2`/`cuMemFree_v2` (4 KiB)", "launch": "`cuLaunchKernel` (empty kernel, 1 block)"}
	for _, k := range order {
		fmt.Fprintf(w, "| %s | %s | %s | %s |\n", first(calls[k.mode], k.mode), k.setting, first(vals[k]["real"], "not measured"), first(vals[k]["fake"], "not measured"))
	}
}
