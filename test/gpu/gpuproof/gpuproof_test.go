package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	api "github.com/tessera-gpu/tessera/api/v1"
)

func statuses(p *Phase) map[string]string {
	m := map[string]string{}
	for _, c := range p.Checks {
		m[c.Name] = c.Status
	}
	return m
}

// An inventory that disagrees with nvidia-smi or CUDA fails exactly the checks that disagree: the
// node phase can catch a discovery bug on real hardware.
func TestCompareInventory(t *testing.T) {
	const uuid = "GPU-11111111-2222-3333-4444-555555555555"
	inv := &api.NodeInventory{GPUs: []api.GPU{{UUID: uuid, Index: 0, Model: "NVIDIA H100 80GB HBM3", MemoryBytes: 81559 << 20,
		SMCount: 132, ComputeCapability: "9.0", PCIBusID: "0000:18:00.0", NUMANode: -1}}}
	good := refGPU{UUID: uuid, Name: "NVIDIA H100 80GB HBM3", MemMiB: 81559, PCI: "0000:18:00.0", CC: "9.0"}
	cuda := refGPU{UUID: uuid, MemBytes: 81559 << 20, SMs: 132, PCI: "0000:18:00.0"}

	p := newPhase("node", false)
	compareInventory(p, inv, map[string]refGPU{uuid: good}, map[string]refGPU{uuid: cuda}, false)
	for name, st := range statuses(p) {
		if st == Fail {
			t.Errorf("matching inventory: %s failed", name)
		}
	}

	bad := good
	bad.MemMiB, bad.PCI = 81920, "0000:19:00.0"
	badCUDA := cuda
	badCUDA.SMs = 114
	p = newPhase("node", false)
	compareInventory(p, inv, map[string]refGPU{uuid: bad}, map[string]refGPU{uuid: badCUDA}, false)
	st := statuses(p)
	id := "GPU 0 (" + uuid + ") "
	for _, want := range []string{"memory", "PCI", "SM count"} {
		if st[id+want] != Fail {
			t.Errorf("%s: status %q, want fail (checks: %v)", want, st[id+want], st)
		}
	}
	if st[id+"model"] != Pass || st[id+"UUID"] != Pass {
		t.Errorf("model/UUID agree and must pass: %v", st)
	}

	p = newPhase("node", false)
	compareInventory(p, inv, map[string]refGPU{}, nil, false)
	if statuses(p)["GPU count"] != Fail {
		t.Errorf("a GPU nvidia-smi does not list must fail the count: %v", statuses(p))
	}
}

// A GPU in MIG mode is listed by nvidia-smi but is no CUDA device: CUDA lists an instance of it,
// which must match the inventory's instance, and never the GPU itself.
func TestCompareInventoryMIG(t *testing.T) {
	const uuid, mig = "GPU-11111111-2222-3333-4444-555555555555", "MIG-11111111-2222-3333-4444-666666666666"
	inv := &api.NodeInventory{GPUs: []api.GPU{{UUID: uuid, Index: 0, Model: "NVIDIA A100-SXM4-40GB", MemoryBytes: 40 << 30,
		SMCount: 108, ComputeCapability: "8.0", PCIBusID: "0000:18:00.0", NUMANode: -1,
		MIG: &api.MIG{Instances: []api.MIGInstance{{UUID: mig, Profile: "1g.5gb", MemoryBytes: 5 << 30, SMCount: 14}}}}}}
	smi := map[string]refGPU{uuid: {UUID: uuid, Name: "NVIDIA A100-SXM4-40GB", MemMiB: 40 << 10}}
	id := "GPU 0 (" + uuid + ")"

	p := newPhase("node", false)
	compareInventory(p, inv, smi, map[string]refGPU{mig: {UUID: mig, MemBytes: 5 << 30, SMs: 14}}, true)
	for name, st := range statuses(p) {
		if st == Fail {
			t.Errorf("CUDA listing the instance: %s failed", name)
		}
	}
	if statuses(p)[id+" MIG "+mig+" memory (CUDA)"] != Pass {
		t.Errorf("the instance CUDA lists is not compared: %v", statuses(p))
	}

	p = newPhase("node", false)
	compareInventory(p, inv, smi, map[string]refGPU{mig: {UUID: mig, MemBytes: 40 << 30, SMs: 108}}, true)
	if st := statuses(p); st[id+" MIG "+mig+" memory (CUDA)"] != Fail || st[id+" MIG "+mig+" SM count"] != Fail {
		t.Errorf("an instance with its GPU's memory and SMs must fail: %v", st)
	}

	p = newPhase("node", false)
	compareInventory(p, inv, smi, map[string]refGPU{uuid: {UUID: uuid, MemBytes: 40 << 30, SMs: 108}}, true)
	if st := statuses(p); st[id+" CUDA"] != Fail {
		t.Errorf("CUDA listing a GPU in MIG mode whole must fail: %v", st)
	}
}

func TestParseReferences(t *testing.T) {
	gpus, version := parseProbeInfo("cuda_driver_version=13.0\ndevices=1\ndevice=0 name=NVIDIA_H100_80GB_HBM3 total_mem=85520809984 " +
		"meminfo_total=85520809984 meminfo_free=1 uuid=GPU-aa sms=132 cc=9.0 pci=0000:18:00.0\n")
	g := gpus["GPU-aa"]
	if version != "13.0" || g.Name != "NVIDIA H100 80GB HBM3" || g.SMs != 132 || g.MemBytes != 85520809984 || g.PCI != "0000:18:00.0" {
		t.Errorf("parseProbeInfo: %+v %q", gpus, version)
	}
	if got := normalizeBusID("00000000:18:00.0"); got != "0000:18:00.0" {
		t.Errorf("normalizeBusID: %q", got)
	}
}

// The tables carry the dry-run banner and escape cells; every figure keeps its measured_by.
func TestTables(t *testing.T) {
	p := newPhase("overhead", true)
	p.figure(Figure{Name: "fake driver: launch | added", Value: 4.5, Unit: "ns/call", MeasuredBy: "callbench on the fake driver"})
	p.figure(Figure{Name: "real driver: launch, added by vcuda at 50% compute", Value: 31, Unit: "ns/call", MeasuredBy: "callbench on the real driver"})
	p.figure(Figure{Name: "fake driver: launch, added by vcuda at 50% compute", Value: 12, Unit: "ns/call", MeasuredBy: "callbench on the fake driver"})
	p.figure(Figure{Name: "fake driver: alloc, no vcuda", Value: 180, Unit: "ns/call", MeasuredBy: "callbench on the fake driver"})
	r := &Results{DryRun: true, GPUModel: "NVIDIA A100-SXM4-40GB", Driver: "580.95.05", CUDA: "13.0", Date: "2026-11-23", Phases: []*Phase{p}}
	var b bytes.Buffer
	if err := tables(&b, r, "x.json", sections["vcuda"]); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{"**DRY RUN", "**torch**: not run.", `fake driver: launch \| added`, "callbench on the fake driver", "| 4.5 ns/call |",
		"| `cuLaunchKernel` (empty kernel, 1 block) | added by vcuda, container at 50% compute | 31 ns | 12 ns |",
		"| `cuMemAlloc_v2`/`cuMemFree_v2` (4 KiB) | without vcuda (driver call alone) | not measured | 180 ns |"} {
		if !strings.Contains(out, want) {
			t.Errorf("tables lack %q:\n%s", want, out)
		}
	}
}

// nvidia-smi's CSV as the real tool prints it (the dry run's fake nvidia-smi has no --query-gpu).
func TestNvidiaSMIQuery(t *testing.T) {
	smi := filepath.Join(t.TempDir(), "nvidia-smi")
	script := "#!/bin/sh\necho 'GPU-aa, NVIDIA H100 80GB HBM3, 81559, 00000000:18:00.0, 9.0'\necho 'GPU-bb, NVIDIA H100 80GB HBM3, 81559, 00000000:2A:00.0, 9.0'\n"
	if err := os.WriteFile(smi, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	gpus, err := nvidiaSMIQuery(smi)
	if err != nil {
		t.Fatal(err)
	}
	want := refGPU{UUID: "GPU-bb", Name: "NVIDIA H100 80GB HBM3", MemMiB: 81559, PCI: "0000:2a:00.0", CC: "9.0"}
	if len(gpus) != 2 || gpus["GPU-bb"] != want {
		t.Errorf("nvidiaSMIQuery: %+v, want GPU-bb %+v", gpus, want)
	}
	if err := os.WriteFile(smi, []byte("#!/bin/sh\necho 'Driver Version: 580.95.05'\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := nvidiaSMIQuery(smi); err == nil {
		t.Error("an nvidia-smi without --query-gpu must be an error (the caller falls back to -L)")
	}
}

// vcuda's per-context table is right only if it covers the driver's figure (a share would hold more
// than its cap) and overcharges by no more than the memory guard's tolerance (64 MiB).
func TestTableRight(t *testing.T) {
	for _, c := range []struct {
		measured, table uint64
		want            bool
	}{{384 << 20, 384 << 20, true}, {500 << 20, 512 << 20, true}, {448 << 20, 512 << 20, true},
		{513 << 20, 512 << 20, false}, {447 << 20, 512 << 20, false}} {
		if got := tableRight(c.measured, c.table); got != c.want {
			t.Errorf("tableRight(%d MiB, %d MiB) = %v, want %v", c.measured>>20, c.table>>20, got, c.want)
		}
	}
}

// TestCompareProcAddr: with vcuda, every answer the bare driver gives must come back as vcuda's
// hook of the variant the driver chose, as dlsym names it; what the driver refuses stays refused.
func TestCompareProcAddr(t *testing.T) {
	const bare = "q base=cuMemAlloc version=12000 flags=0 rc=0 status=0 lib=/usr/lib/libcuda.so.1 sym=cuMemAlloc_v2 variant=cuMemAlloc_v2 dlsym_same=1\n" +
		"q base=cuGreenCtxCreate version=12000 flags=0 rc=500 status=1 lib=- sym=- variant=- dlsym_same=0\n" +
		"q base=cuLaunchKernel version=13000 flags=2 rc=0 status=0 lib=/usr/lib/libcuda.so.1 sym=- variant=- dlsym_same=0\n"
	good := "q base=cuMemAlloc version=12000 flags=0 rc=0 status=0 lib=/lib/libvcuda.so sym=cuMemAlloc_v2 variant=cuMemAlloc_v2 dlsym_same=1\n" +
		"q base=cuGreenCtxCreate version=12000 flags=0 rc=500 status=1 lib=- sym=- variant=- dlsym_same=0\n" +
		"q base=cuLaunchKernel version=13000 flags=2 rc=0 status=0 lib=/lib/libvcuda.so sym=cuLaunchKernel_ptsz variant=cuLaunchKernel_ptsz dlsym_same=1\n"
	const verdict = "every driver answer is vcuda's hook of the same variant, as dlsym names it"
	for name, tc := range map[string]struct {
		hooked string
		want   string
	}{
		"all vcuda's, same variants":   {good, Pass},
		"an older variant than driver": {strings.Replace(good, "sym=cuMemAlloc_v2 variant=cuMemAlloc_v2", "sym=cuMemAlloc variant=cuMemAlloc", 1), Fail},
		"the driver's own, unhooked":   {strings.Replace(good, "lib=/lib/libvcuda.so sym=cuLaunchKernel_ptsz", "lib=/usr/lib/libcuda.so.1 sym=cuLaunchKernel_ptsz", 1), Fail},
		"dlsym names another":          {strings.Replace(good, "variant=cuLaunchKernel_ptsz dlsym_same=1", "variant=cuLaunchKernel_ptsz dlsym_same=0", 1), Fail},
		"a refused name made up":       {strings.Replace(good, "rc=500 status=1", "rc=0 status=0", 1), Fail},
		"a query left unanswered":      {strings.SplitAfterN(good, "\n", 2)[1], Fail},
	} {
		p := newPhase("procaddr", false)
		compareProcAddr(p, bare, tc.hooked, "test")
		if got := statuses(p)[verdict]; got != tc.want {
			t.Errorf("%s: %s, want %s (%v)", name, got, tc.want, p.Checks)
		}
	}
}

// TestNotRunKeeps: a phase cut off by its limit keeps the checks it wrote before, and gains the
// reason; without -keep (or with nothing written) the reason stands alone. Never a pass.
func TestNotRunKeeps(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "torch.json")
	p := newPhase("torch", false)
	p.check("default: OOM at the cap", true, "test", "done before the cut")
	if err := p.write(out, time.Now()); err != nil {
		t.Fatal(err)
	}
	read := func() *Phase {
		data, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		got := &Phase{}
		if err := json.Unmarshal(data, got); err != nil {
			t.Fatal(err)
		}
		return got
	}
	if err := runNotRun([]string{"-phase", "torch", "-reason", "timed out", "-out", out, "-keep"}); err != nil {
		t.Fatal(err)
	}
	if st := statuses(read()); len(st) != 2 || st["default: OOM at the cap"] != Pass || st["torch: not run"] != NotChecked {
		t.Errorf("-keep: %v, want the earlier check and the reason", st)
	}
	if err := runNotRun([]string{"-phase", "memory", "-reason", "timed out", "-out", out, "-keep"}); err == nil {
		t.Error("-keep onto another phase's result must be refused")
	}
	if err := runNotRun([]string{"-phase", "torch", "-reason", "not started", "-out", out}); err != nil {
		t.Fatal(err)
	}
	if st := statuses(read()); len(st) != 1 || st["torch: not run"] != NotChecked {
		t.Errorf("without -keep: %v, want the reason alone", st)
	}
}

// TestNotRunCases: a phase that could not run lists each of its cases as not run, so the results
// name every case the run would have measured (none missing, none a pass).
func TestNotRunCases(t *testing.T) {
	out := filepath.Join(t.TempDir(), "compute.json")
	if err := runNotRun([]string{"-phase", "compute", "-reason", "needs a GPU", "-out", out, "-cases", "decode-graph at 10%: busy share\nmodel: alone, no vcuda: tokens_per_s\n"}); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	got := &Phase{}
	if err := json.Unmarshal(data, got); err != nil {
		t.Fatal(err)
	}
	st := statuses(got)
	if len(st) != 3 || st["compute: not run"] != NotChecked || st["decode-graph at 10%: busy share"] != NotChecked || st["model: alone, no vcuda: tokens_per_s"] != NotChecked {
		t.Errorf("-cases: %v, want the reason and each case not_checked", st)
	}
}

// TestWaitLineSchedule pins waitLine on a synctest bubble's clock: a line already printed is seen at
// once; a later one at the next look (every 50 ms); a container that ends stops the wait at once
// (what it printed last still counts); the timeout ends it with false.
func TestWaitLineSchedule(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		waitLine := func(s *started, line string, timeout time.Duration) (bool, time.Duration) {
			start := time.Now()
			ok := s.waitLine(line, timeout)
			return ok, time.Since(start)
		}
		s := &started{out: &syncBuffer{}, done: make(chan struct{})}
		s.out.Write([]byte("ready\n"))
		if ok, took := waitLine(s, "ready", time.Minute); !ok || took != 0 {
			t.Errorf("a printed line: %v after %v, want true at once", ok, took)
		}
		go func() {
			time.Sleep(120 * time.Millisecond)
			s.out.Write([]byte("held=1 error=0\n"))
		}()
		if ok, took := waitLine(s, "held=1 error=0", time.Minute); !ok || took != 150*time.Millisecond {
			t.Errorf("a line printed at 120 ms: %v after %v, want true at the look at 150 ms", ok, took)
		}
		if ok, took := waitLine(s, "never", time.Second); ok || took != time.Second {
			t.Errorf("a line never printed: %v after %v, want false at the 1 s timeout", ok, took)
		}
		go func() {
			time.Sleep(120 * time.Millisecond)
			s.out.Write([]byte("last words\n"))
			close(s.done)
		}()
		if ok, took := waitLine(s, "last words", time.Minute); !ok || took != 120*time.Millisecond {
			t.Errorf("a container ending at 120 ms after its last line: %v after %v, want true at 120 ms", ok, took)
		}
		if ok, took := waitLine(s, "never", time.Minute); ok || took != 0 {
			t.Errorf("an ended container: %v after %v, want false at once", ok, took)
		}
	})
}

// The timeslice phase's arithmetic on samples of a known GPU: 1 ms kernels alone; beside B, a
// quarter of them carry B's 2 ms slice plus two 50 us switches, the rest jitter by 0.1 ms. The
// implied slice is the inflation's median (not the solo time, not a quantile of all samples), the
// fraction counts only samples over solo + 0.5 ms, the switch bound is the least delay over the
// launch latency alone.
func TestSliceFigures(t *testing.T) {
	solo := []float64{1e6, 1.01e6, 0.99e6, 1e6, 1e6}
	var beside []float64
	for i := range 40 {
		if i%4 == 0 {
			beside = append(beside, 1e6+2.1e6+float64(i))
		} else {
			beside = append(beside, 1e6+0.1e6)
		}
	}
	st := sliceFigures(solo, beside, []float64{10e3, 12e3, 11e3}, []float64{70e3, 900e3, 2.05e6, 1.2e6})
	near := func(got, want float64) bool { return got > want*0.99 && got < want*1.01 }
	if !near(st.Solo, 1e6) || !near(st.Slice, 2.1e6) || st.InflatedFrac != 0.25 || !near(st.P50, 1.1e6) || !near(st.Max, 3.1e6) {
		t.Errorf("solo %.0f slice %.0f inflated %.2f p50 %.0f max %.0f: want 1e6, 2.1e6, 0.25, 1.1e6, 3.1e6", st.Solo, st.Slice, st.InflatedFrac, st.P50, st.Max)
	}
	if !near(st.Switch, 59e3) || !near(st.DelayMax, 2.05e6) || !near(st.DelayMin, 70e3) {
		t.Errorf("switch %.0f delay min %.0f max %.0f: want 59e3, 70e3, 2.05e6", st.Switch, st.DelayMin, st.DelayMax)
	}
	// nothing inflated (no co-tenant, or a GPU that runs A's kernels to the end): no slice, and said so
	if st := sliceFigures(solo, solo, nil, nil); st.Slice != 0 || st.InflatedFrac != 0 {
		t.Errorf("no inflation: slice %.0f, fraction %.2f, want 0", st.Slice, st.InflatedFrac)
	}
}

// The feedback phase's analysis tells a driver whose per-process samples come back to back (an
// idle process sampled at 0) from one that skips an idle process, whose first sample after the gap
// the agent's integration multiplies by the whole gap: the gap's gain is ~0 for the first and the gap
// for the second, while each busy segment's ratio (from the periods ending inside it) is 1 for both.
func TestFeedbackAnalysis(t *testing.T) {
	const ms = int64(time.Millisecond)
	busy1 := fbSegment{Name: "busy1", Start: 1000 * ms, End: 3000 * ms, Busy: 2000 * ms}
	gap := fbSegment{Name: "gap", Start: 3000 * ms, End: 6000 * ms}
	busy2 := fbSegment{Name: "busy2", Start: 6000 * ms, End: 8000 * ms, Busy: 2000 * ms}
	samples := func(idle bool) []rawSample {
		var out []rawSample
		for t := int64(1100); t <= 8000; t += 100 {
			util := uint32(100)
			if t > 3000 && t <= 6000 {
				if !idle {
					continue // the driver skips an idle process
				}
				util = 0
			}
			out = append(out, rawSample{TS: uint64(t * 1000), Mono: t * ms, SmUtil: util})
		}
		return out
	}
	for _, tc := range []struct {
		name     string
		idle     bool
		gain     float64
		inGapPts int
	}{{"idle samples at 0", true, 0, 29}, {"no idle samples", false, float64(3000 * ms), 0}} {
		pts := integrateRaw(samples(tc.idle))
		for _, s := range []fbSegment{busy1, busy2} {
			if r, n, ok := segmentRatio(pts, s); !ok || r < 0.999 || r > 1.001 {
				t.Errorf("%s: %s ratio %v (%d points, ok %v), want 1", tc.name, s.Name, r, n, ok)
			}
		}
		gain, inGap, ok := gapGain(pts, busy1, gap, busy2)
		if !ok || gain < tc.gain-float64(ms) || gain > tc.gain+float64(ms) || inGap != tc.inGapPts {
			t.Errorf("%s: gap gain %.0f ms (ok %v), %d points in the gap; want %.0f ms, %d", tc.name, gain/float64(ms), ok, inGap, tc.gain/float64(ms), tc.inGapPts)
		}
	}
	// A repeat (not newer than the previous sample) adds nothing; utilisation over 100 counts as 100.
	pts := integrateRaw([]rawSample{{TS: 1000, Mono: 1}, {TS: 2000, Mono: 2, SmUtil: 150}, {TS: 2000, Mono: 2, SmUtil: 100}})
	if len(pts) != 2 || pts[1].Busy != 1000*1000 {
		t.Errorf("integrateRaw with a repeat and SmUtil 150: %+v, want 2 points, busy 1 ms", pts)
	}
	// Too few points in a segment is no figure, never a pass.
	if _, _, ok := segmentRatio(pts, busy1); ok {
		t.Error("segmentRatio with no point in the segment: ok")
	}
	// The second caller: the share of the first caller's samples it got too.
	a := samples(true)
	b := slices.Clone(a)
	b = slices.Delete(b, 10, 11)
	for i := range a {
		a[i].Call = a[i].Mono
	}
	if got, missing := secondCaller(a, b, []int64{0, 9000 * ms}); missing != 1 || got != float64(len(a)-1)/float64(len(a)) {
		t.Errorf("secondCaller: %v, %d missing; want 1 missing", got, missing)
	}
	segs, warm, done := parseFeedbackProbe("warm named=1 pid=1 end=5\nsegment name=busy1 start=10 end=20 busy=9 kernels=2\ndone\n")
	if !done || warm["named"] != "1" || segs["busy1"] != (fbSegment{Name: "busy1", Start: 10, End: 20, Busy: 9, Kernels: 2}) {
		t.Errorf("parseFeedbackProbe: %+v %v %v", segs, warm, done)
	}
}
