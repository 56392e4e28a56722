package main

import (
	"flag"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/cdi"
)

// The memory phase: what a GPU must confirm about memory in a pod, measured from the host's NVML
// (host pids, the driver's own count) while runc containers made from the CDI specs run memprobe.
//
//   - the per-context overhead in a container's own PID namespace, where vcuda cannot find itself in
//     NVML's list and charges its table (api.ContextOverheadBytes, vcuda's ctx_table) instead: the
//     measured figure per GPU model next to the table's, so a real run says whether the table holds;
//   - llama.cpp's VMM pool (create -> map -> release, unmapped later) and a create/map/release loop
//     in a share: CUDA_ERROR_OUT_OF_MEMORY at the cap, NVML never above cap + the memory guard's
//     tolerance, and the unmap gives the memory back.
func runMemory(args []string) error {
	fs := flag.NewFlagSet("memory", flag.ContinueOnError)
	work := fs.String("work", "", "the node phase's work folder (cdi/, inventory.json) (required)")
	out := fs.String("out", "", "phase result file (required)")
	rootfs := fs.String("rootfs", "", "the containers' root file system, with memprobe (required)")
	runc := fs.String("runc", "runc", "runc binary")
	index := fs.Int("gpu-index", 0, "the GPU the share containers get")
	shareMiB := fs.Int64("share-mib", 4096, "the VMM containers' memory cap")
	nvmlLib := fs.String("nvml-library", "auto", "the host's libnvidia-ml.so.1 (auto: under the driver root)")
	dry := fs.Bool("dry-run", false, "the simulated node and the fake driver")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *work == "" || *out == "" || !filepath.IsAbs(*rootfs) {
		return fmt.Errorf("-work, -out and an absolute -rootfs are required")
	}
	start := time.Now()
	p := newPhase("memory", *dry)
	inv, g, r, err := setupContainers(*work, *index, *runc, *rootfs, filepath.Join(*work, "containers"))
	if err != nil {
		return err
	}
	lib, err := openNVML(*nvmlLib)
	if err != nil {
		p.check("host NVML", false, "go-nvml on the host's libnvidia-ml.so.1", "%v", err)
		return finish(p, *out, start)
	}
	defer lib.Shutdown()
	by := "host NVML (usedGpuMemory by host pid)"
	if *dry {
		by = "the fake driver's NVML on the host (its per-process records, by host pid); the fake charges the figures vcuda's README gives, so this is no measurement"
	}
	contextOverhead(p, r, inv, lib, by)
	for _, pattern := range []string{"pool", "loop"} {
		vmmPattern(p, r, *work, g, lib, pattern, *shareMiB<<20, by)
	}
	return finish(p, *out, start)
}

// contextOverhead starts one container with every shareable GPU, without vcuda, whose memprobe
// makes a context on each, and reads each GPU's usedGpuMemory for its host pid.
func contextOverhead(p *Phase, r *runner, inv *api.NodeInventory, lib nvml.Interface, by string) {
	gen := &cdi.Generator{Vendor: configv1.DefaultCDIVendor}
	var devices []string
	for _, g := range inv.GPUs {
		if g.Shareable() {
			devices = append(devices, gen.Name(cdi.ClassGPU, g.UUID))
		}
	}
	c, err := r.start("ctx", devices, nil, "exec memprobe ctx 60", "")
	if err != nil {
		p.check("context overhead: container runs", false, "runc run", "%v", err)
		return
	}
	defer c.stop()
	if !c.waitLine("ready", time.Minute) {
		p.check("context overhead: contexts made", false, "memprobe ctx", "no ready line: %s", lastLines(c.out.String(), 5))
		return
	}
	pid, err := c.pid()
	if err != nil {
		p.check("context overhead: container's host pid", false, "runc state", "%v", err)
		return
	}
	got := c.out.String()
	nspid := words(firstMatch(got, `(?m)^pid=.*$`))["pid"]
	// NVML's count can trail the context's creation by a sample; the most of three reads a
	// quarter second apart is the context's.
	used := map[string]uint64{}
	listed := map[string]bool{}
	for range 3 {
		for _, g := range inv.GPUs {
			procs, err := computeProcesses(lib, g.UUID)
			if err != nil {
				continue
			}
			if u, ok := procs[uint32(pid)]; ok {
				listed[g.UUID] = true
				used[g.UUID] = max(used[g.UUID], u)
			}
		}
		time.Sleep(250 * time.Millisecond)
	}
	type model struct {
		name, cc     string
		min, max     uint64
		n            int
		contextsMade int
	}
	models := map[string]*model{}
	var order []string
	for _, line := range strings.Split(got, "\n") {
		kv := words(line)
		if !strings.HasPrefix(line, "ctx ") {
			continue
		}
		g := inv.GPUByUUID(kv["uuid"])
		if g == nil {
			p.check("context overhead: "+kv["uuid"], false, "memprobe ctx (cuDeviceGetUuid_v2)", "CUDA in the container lists a GPU the inventory does not: %s", line)
			continue
		}
		id := fmt.Sprintf("GPU %d (%s)", g.Index, g.UUID)
		if kv["error"] != "0" {
			p.check(id+": context", false, "memprobe ctx (cuDevicePrimaryCtxRetain)", "CUDA error %s", kv["error"])
			continue
		}
		if !listed[g.UUID] {
			p.check(id+": NVML lists the container's process by host pid", false, by, "host pid %d (pid %s in the container) not in NVML's list", pid, nspid)
			continue
		}
		m := models[g.Model+" "+kv["cc"]]
		if m == nil {
			m = &model{name: g.Model, cc: kv["cc"], min: used[g.UUID]}
			models[g.Model+" "+kv["cc"]] = m
			order = append(order, g.Model+" "+kv["cc"])
		}
		m.n++
		m.min, m.max = min(m.min, used[g.UUID]), max(m.max, used[g.UUID])
	}
	p.check("context overhead: NVML lists the container's process by host pid", len(listed) > 0 && len(listed) == len(devices) && nspid != strconv.Itoa(pid),
		by, "host pid %d, pid %s in the container's namespace; listed on %d of %d GPUs", pid, nspid, len(listed), len(devices))
	for _, k := range order {
		m := models[k]
		table := api.ContextOverheadBytes(api.ComputeCapabilityMajor(m.cc))
		name := fmt.Sprintf("context overhead: %s (cc %s)", m.name, m.cc)
		p.figure(Figure{Name: name + ", measured", Value: float64(m.max), Unit: "bytes", MeasuredBy: fmt.Sprintf("%s for a process with one primary context and no allocation, in a container's PID namespace; most of %d GPUs (least %d)", by, m.n, m.min)})
		p.figure(Figure{Name: name + ", vcuda's table", Value: float64(table), Unit: "bytes", MeasuredBy: "api.ContextOverheadBytes (vcuda/src/hooks_ctx.c ctx_table): what vcuda charges per context where NVML does not list its own pid"})
		p.check(name+": vcuda's table is right", tableRight(m.max, uint64(table)), by+" vs api.ContextOverheadBytes",
			"measured %d MiB, table %d MiB: want measured <= table <= measured + %d MiB", m.max>>20, table>>20, configv1.DefaultMemoryGuardTolerance>>20)
		p.Env["ctx_overhead_bytes."+slug(m.name)] = strconv.FormatUint(m.max, 10)
	}
}

// tableRight: vcuda's per-context figure covers what the driver takes (else a share holds more
// than its cap) and wastes no more than the memory guard's tolerance.
func tableRight(measured, table uint64) bool {
	return measured <= table && table-measured <= configv1.DefaultMemoryGuardTolerance
}

// vmmPattern runs memprobe's VMM pattern in a share container capped at capBytes while the host
// samples NVML for the container's processes.
func vmmPattern(p *Phase, r *runner, work string, g *api.GPU, lib nvml.Interface, pattern string, capBytes int64, by string) {
	const chunk = 64 << 20
	name := "vmm " + pattern
	probe := "memprobe vmm " + pattern + " (cuMemCreate, cuMemMap, cuMemSetAccess, cuMemRelease while mapped; cuMemUnmap later) under vcuda"
	gen := &cdi.Generator{Vendor: configv1.DefaultCDIVendor}
	mounts, err := shareMounts(filepath.Join(work, "containers", "vmm-"+pattern+"-vcuda"), "gpuproof-vmm-"+pattern, g.UUID, capBytes, 100, true)
	if err != nil {
		p.check(name+": container runs", false, "nri.VCUDAMounts", "%v", err)
		return
	}
	// Up to twice the cap: far enough past it to show a leak, bounded on a GPU where nothing stops it.
	cmd := fmt.Sprintf("exec memprobe vmm %s %d %d 2", pattern, chunk, 2*capBytes)
	c, err := r.start("vmm-"+pattern, []string{gen.Name(cdi.ClassGPU, g.UUID), gen.Name(cdi.ClassShare, cdi.ShareName)}, mounts, cmd, "")
	if err != nil {
		p.check(name+": container runs", false, "runc run", "%v", err)
		return
	}
	defer c.stop()
	var pid int
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if pid, err = c.pid(); err == nil || !c.running() {
			break
		}
	}
	// A probe that ends at once (the driver lacks the calls) leaves nothing to sample.
	var peak uint64
	var procs, samples int
	var serr error
	finished := false
	var ns uint64
	if err == nil {
		ns, err = pidNamespace(uint32(pid))
	}
	if err == nil {
		s := startSampler(lib, g.UUID, ns, 50*time.Millisecond)
		finished = c.wait(time.Minute) >= 0
		peak, procs, samples, serr = s.finish()
	} else if finished = c.wait(5*time.Second) >= 0; !finished {
		p.check(name+": container runs", false, "runc state", "%v; output: %s", err, lastLines(c.out.String(), 5))
		return
	}
	got := c.out.String()
	v := words(firstMatch(got, `(?m)^vmm .*$`))
	if m := v["missing"]; m != "" {
		p.check(name+": OOM at the cap", false, probe, "the driver (or vcuda) exports no %s: the pattern cannot run", m)
		return
	}
	mapped, _ := strconv.ParseInt(v["mapped"], 10, 64)
	free, _ := strconv.ParseInt(v["meminfo_free"], 10, 64)
	p.check(name+": OOM at the cap", finished && v["stopped_by"] == "2" && v["during"] == "create" && mapped <= capBytes && mapped >= free-chunk, probe,
		"mapped %d of cap %d (free at start %d), stopped by CUDA error %s during %s", mapped, capBytes, free, v["stopped_by"], v["during"])
	tol := max(int64(configv1.DefaultMemoryGuardTolerance), capBytes/100*configv1.DefaultMemoryGuardPercent)
	p.figure(Figure{Name: name + ": most host NVML showed", Value: float64(peak), Unit: "bytes", Goal: fmt.Sprintf("<= cap + tolerance = %d", capBytes+tol),
		Status:     passFail(procs > 0 && serr == nil && peak <= uint64(capBytes+tol)),
		MeasuredBy: fmt.Sprintf("%s, every 50 ms over the container's life (%d samples, %d processes seen; error %v)", by, samples, procs, serr)})
	u := words(firstMatch(got, `(?m)^unmapped=.*$`))
	unmapped, _ := strconv.ParseInt(u["unmapped"], 10, 64)
	refilled, _ := strconv.ParseInt(u["refilled"], 10, 64)
	// Nothing leaked: once unmapped, what was free at the start can be allocated again.
	p.check(name+": the unmap gives the memory back", u["unmap_error"] == "0" && unmapped == mapped && mapped > 0 && refilled >= free-chunk, probe+", then cuMemAlloc_v2 until an error",
		"unmapped %d of %d (error %s); then %d allocated (stopped by %s), %d free at the start", unmapped, mapped, u["unmap_error"], refilled, u["refill_stopped_by"], free)
}
