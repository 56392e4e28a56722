package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// addedGoal is vcuda's goal for the time it adds to an intercepted call on the hot path (issue 12).
const addedGoal = 50.0

// runOverhead times callbench with and without vcuda, on the real driver (the one the dynamic
// linker finds) and on the fake driver carried in the bundle, on the same CPU, so the fake's
// figure sits next to the real one.
func runOverhead(args []string) error {
	fs := flag.NewFlagSet("overhead", flag.ContinueOnError)
	bench := fs.String("callbench", "callbench", "callbench binary")
	lib := fs.String("vcuda-library", "", "libvcuda.so (required)")
	fake := fs.String("fake-dir", "", "the fake driver's folder (libcuda.so.1, libnvidia-ml.so.1) (required)")
	real := fs.Bool("real", true, "also time the real driver (false in the dry run: there is none)")
	work := fs.String("work", "", "folder for the limits files and regions (required)")
	out := fs.String("out", "", "phase result file (required)")
	dry := fs.Bool("dry-run", false, "no GPU: only the fake driver")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *lib == "" || *fake == "" || *work == "" || *out == "" {
		return fmt.Errorf("-vcuda-library, -fake-dir, -work and -out are required")
	}
	if _, err := os.Stat(api.LimitsPathInContainer); err == nil {
		return fmt.Errorf("%s exists on this machine: vcuda would read it instead of the bench's limits", api.LimitsPathInContainer)
	}
	start := time.Now()
	p := newPhase("overhead", *dry)
	drivers := []struct {
		name string
		env  []string
	}{{"fake", []string{"LD_LIBRARY_PATH=" + *fake, "FAKE_CUDA_DEVICES=1", "FAKE_CUDA_WAVE_NS=1"}}}
	if *real {
		drivers = append([]struct {
			name string
			env  []string
		}{{"real", nil}}, drivers...)
	}
	iters := map[string]string{"alloc": "20000", "launch": "25600"}
	for _, d := range drivers {
		env := cleanEnv(d.env)
		uuidOut, err := output(time.Minute, env, *bench, "uuid")
		if err != nil {
			p.check(d.name+" driver: callbench", false, "callbench uuid", "%v", err)
			continue
		}
		uuid := words(uuidOut)["uuid"]
		for _, mode := range []string{"alloc", "launch"} {
			direct, kernel, err := benchOnce(*bench, mode, iters[mode], env)
			if err != nil {
				p.check(d.name+" "+mode, false, "callbench", "%v", err)
				continue
			}
			by := fmt.Sprintf("callbench %s on the %s driver, best of 5 rounds (kernel: %s)", mode, d.name, kernel)
			if d.name == "fake" {
				by += ", FAKE_CUDA_WAVE_NS=1 (launches cost no modelled GPU time)"
			}
			p.figure(Figure{Name: fmt.Sprintf("%s driver: %s, no vcuda", d.name, mode), Value: direct, Unit: "ns/call", MeasuredBy: by})
			for _, cores := range []int{100, 50} {
				limits, err := writeLimits(filepath.Join(*work, fmt.Sprintf("%s-%s-%d", d.name, mode, cores)), uuid, 8<<30, cores)
				if err != nil {
					return err
				}
				with, _, err := benchOnce(*bench, mode, iters[mode], append(env, "LD_PRELOAD="+*lib, api.LimitsEnv+"="+limits))
				if err != nil {
					p.check(fmt.Sprintf("%s %s under vcuda at %d%%", d.name, mode, cores), false, "callbench", "%v", err)
					continue
				}
				f := Figure{Name: fmt.Sprintf("%s driver: %s, added by vcuda at %d%% compute", d.name, mode, cores), Value: with - direct,
					Unit: "ns/call", MeasuredBy: by + fmt.Sprintf(" with vcuda preloaded (%.1f ns) minus without", with)}
				if d.name == "real" {
					f.Goal = fmt.Sprintf("<= %.0f ns added (vcuda's hot-path goal)", addedGoal)
					f.Status = passFail(with-direct <= addedGoal)
				}
				p.figure(f)
			}
		}
	}
	return finish(p, *out, start)
}

func benchOnce(bench, mode, iters string, env []string) (float64, string, error) {
	got, err := output(2*time.Minute, env, bench, mode, iters)
	if err != nil {
		return 0, "", err
	}
	kv := words(got)
	ns, err := strconv.ParseFloat(kv["ns_per_call"], 64)
	if err != nil {
		return 0, "", fmt.Errorf("callbench %s printed %q: %w", mode, got, err)
	}
	return ns, kv["kernel"], nil
}

// cleanEnv is this process's environment without anything that would change which driver or
// which vcuda limits a child sees, plus extra.
func cleanEnv(extra []string) []string {
	var env []string
	for _, e := range os.Environ() {
		k, _, _ := strings.Cut(e, "=")
		if k == "LD_PRELOAD" || k == api.LimitsEnv || strings.HasPrefix(k, "FAKE_") || (k == "LD_LIBRARY_PATH" && len(extra) > 0) {
			continue
		}
		env = append(env, e)
	}
	return append(env, extra...)
}

// writeLimits writes a vcuda limits file (and its region's folder) for one GPU.
func writeLimits(dir, uuid string, capBytes int64, cores int) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	data, err := api.EncodeLimits(&api.Limits{ContainerID: "gpuproof-" + filepath.Base(dir), RegionPath: filepath.Join(dir, "region"),
		GPUs: []api.GPULimit{{UUID: uuid, MemoryBytes: capBytes, CoresPercent: cores}}})
	if err != nil {
		return "", fmt.Errorf("limits for %s: %w", uuid, err)
	}
	path := filepath.Join(dir, "limits")
	return path, os.WriteFile(path, data, 0o644)
}

// runLimits writes a limits file for torch_checks.py, so the format has one writer (api/v1).
func runLimits(args []string) error {
	fs := flag.NewFlagSet("limits", flag.ContinueOnError)
	dir := fs.String("dir", "", "folder for the limits file and the region (required)")
	uuid := fs.String("uuid", "", "the GPU (required)")
	capBytes := fs.Int64("cap", 0, "memory cap in bytes (required)")
	cores := fs.Int("cores", 100, "compute cap in percent")
	if err := fs.Parse(args); err != nil {
		return err
	}
	path, err := writeLimits(*dir, *uuid, *capBytes, *cores)
	if err != nil {
		return err
	}
	fmt.Println(path)
	return nil
}
