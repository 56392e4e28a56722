package memguard

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/tessera-gpu/tessera/internal/hostproc"
	"github.com/tessera-gpu/tessera/vcuda"
)

// inPIDNS gives c, in the fake host /proc, the PID namespace pidns and the pid nspid there (what
// /proc/<pid>/ns/pid and status say of a container's process), and returns the slot vcuda in the
// container would have written for it: live, its namespace's pid, its start time.
func (e *env) inPIDNS(c *child, pidns uint64, nspid uint32) vcuda.RegionProcess {
	e.t.Helper()
	dir := filepath.Join(e.proc, strconv.Itoa(int(c.pid)))
	if err := os.MkdirAll(filepath.Join(dir, "ns"), 0o755); err != nil {
		e.t.Fatal(err)
	}
	if err := os.Symlink(fmt.Sprintf("pid:[%d]", pidns), filepath.Join(dir, "ns", "pid")); err != nil {
		e.t.Fatal(err)
	}
	status := fmt.Sprintf("Name:\tpython3\nNSpid:\t%d\t%d\n", c.pid, nspid)
	if err := os.WriteFile(filepath.Join(dir, "status"), []byte(status), 0o644); err != nil {
		e.t.Fatal(err)
	}
	start, err := hostproc.Start(e.proc, c.pid)
	if err != nil {
		e.t.Fatal(err)
	}
	return vcuda.RegionProcess{PID: nspid, Live: true, StartTime: start, PIDNS: pidns}
}

// holds sets a container's region: one GPU record (gpu0) and the slots given.
func (e *env) holds(ctr string, slots ...vcuda.RegionProcess) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.regions[ctr] = &vcuda.Region{GPUs: []vcuda.RegionGPU{{UUID: gpu0, MemCap: uint64(4096 * mib)}}, Processes: slots}
}

// slot is s holding used bytes on gpu0, n contexts of which were charged charged bytes.
func slot(s vcuda.RegionProcess, used int64, n uint32, charged int64) vcuda.RegionProcess {
	s.Used = []uint64{uint64(used)}
	s.Contexts = []vcuda.RegionContexts{{GPU: 0, Count: n, Charged: uint64(charged)}}
	return s
}

// published is the overhead file's gpu lines (uuid -> bytes), or nil when it does not exist.
func (e *env) published() map[string]string {
	e.t.Helper()
	data, err := os.ReadFile(e.guard.cfg.ContextOverheadFile)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		e.t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(string(data), "\n"), "\n")
	var written int64
	if len(lines) < 2 || lines[0] != "tessera-context-overhead 1" {
		e.t.Fatalf("file %q: no header", data)
	}
	// vcuda ignores a file written over 600 s ago: the agent keeps it within a minute.
	if _, err := fmt.Sscanf(lines[1], "written %d", &written); err != nil || written > e.clock.Now().Unix() || e.clock.Now().Unix()-written > 60 {
		e.t.Fatalf("file %q: not written within the last minute (now %d)", data, e.clock.Now().Unix())
	}
	out := map[string]string{}
	for _, l := range lines[2:] {
		f := strings.Fields(l)
		if len(f) != 3 || f[0] != "gpu" {
			e.t.Fatalf("file line %q", l)
		}
		out[f[1]] = f[2]
	}
	return out
}

func overheadEnv(t *testing.T) *env {
	e := newEnv(t, share(ctrA, "pod-a", gpu0, 4096*mib), share(ctrB, "pod-b", gpu0, 4096*mib))
	e.guard.cfg.ContextOverheadFile = filepath.Join(t.TempDir(), "node", "context-overhead")
	return e
}

func (e *env) overheadMetric(uuid, gpu string) string {
	return fmt.Sprintf(`tessera_gpu_context_overhead_bytes{UUID="%s",device="nvidia%s",gpu="%s",hostname="node-a",modelName="A100"}`, uuid, gpu, gpu)
}

// TestContextOverheadMeasured: a process in a container's PID namespace whose slot says it holds one
// context (charged the table's 512 MiB) and 1 GiB of allocations, while NVML counts 1700 MiB for its
// host pid, measures 676 MiB per context once two samples agree (quiet); it is exported for every
// GPU of the model and published for vcuda. A sample in which the process moved is no measurement.
// Mutation: taking samples without the quiet rule (o.prev[k] != obs ignored) publishes the first
// sample's figure (NVML caught mid-allocation: 1724 MiB, bounded to 1700) and this fails.
func TestContextOverheadMeasured(t *testing.T) {
	e := overheadEnv(t)
	c := e.inContainer(ctrA)
	s := e.inPIDNS(c, 4026532001, 7)
	e.holds(ctrA, slot(s, 1536*mib, 1, 512*mib))
	e.uses(gpu0, c, 2748*mib) // NVML ahead of the slot: an allocation under way
	e.samples(1)
	e.uses(gpu0, c, 1700*mib)
	e.samples(1)
	if got := e.published(); len(got) != 0 {
		t.Fatalf("published %v before a quiet sample", got)
	}
	if strings.Contains(scrape(t, e.guard.metrics), "tessera_gpu_context_overhead_bytes{") {
		t.Fatal("overhead exported before a quiet sample")
	}
	e.samples(1)
	want := strconv.FormatInt(676*mib, 10)
	if got := e.published(); got[gpu0] != want || got[gpu1] != want || len(got) != 2 {
		t.Fatalf("published %v, want %s for both A100s", got, want)
	}
	e.samples(120) // unchanged for two minutes: still rewritten (checked by published)
	if got := e.published(); got[gpu0] != want {
		t.Fatalf("after two quiet minutes: %v", got)
	}
	m := scrape(t, e.guard.metrics)
	for _, line := range []string{e.overheadMetric(gpu0, "0") + " " + want, e.overheadMetric(gpu1, "1") + " " + want} {
		if !strings.Contains(m, line) {
			t.Errorf("metrics lack %s:\n%s", line, m)
		}
	}
	c.alive(t)
}

// TestSecurityContextOverheadTenantCannotLower: container A writes its own slot (any count of
// contexts, allocations up to everything NVML counts) to make the measured overhead small; the
// figure published for the model, which container B's vcuda charges, stays at B's honest 676 MiB
// (and vcuda never charges less than its table: TestContextOverhead/ctxoverhead_below_table_ignored).
// Mutation: publishing the smallest container's sample instead of the largest (publishable's max
// made a min) publishes A's 2 MiB and this fails.
func TestSecurityContextOverheadTenantCannotLower(t *testing.T) {
	e := overheadEnv(t)
	b := e.inContainer(ctrB)
	e.holds(ctrB, slot(e.inPIDNS(b, 4026532002, 7), 1536*mib, 1, 512*mib))
	e.uses(gpu0, b, 1700*mib)
	e.samples(2)
	want := strconv.FormatInt(676*mib, 10)
	if got := e.published()[gpu0]; got != want {
		t.Fatalf("honest figure %s, want %s", got, want)
	}
	a := e.inContainer(ctrA)
	sa := e.inPIDNS(a, 4026532001, 7)
	e.uses(gpu0, a, 1700*mib)
	for _, lie := range []vcuda.RegionProcess{
		slot(sa, 1700*mib, 62, 62*2*mib), // 62 contexts of 2 MiB, the rest allocations
		slot(sa, 1700*mib, 1, 2*mib),     // all of NVML's figure allocations
		slot(sa, 1698*mib, 1, 0),         // nothing charged for its context
	} {
		e.holds(ctrA, lie)
		e.samples(3)
		if got := e.published()[gpu0]; got != want {
			t.Fatalf("tenant slot %+v: published %s, want B's %s", lie, got, want)
		}
	}
}

// TestSecurityContextOverheadRaiseBounded: a tenant whose slot claims no allocations makes its
// whole NVML figure (3000 MiB) look like one context's; the published figure is bounded by the
// smallest process NVML lists on the model (B's 1700 MiB, which holds at least one context), so the
// tenant cannot make other containers' contexts cost more than a whole process of theirs. Mutation:
// without the bound (publishable ignores low) 3000 MiB is published and this fails.
func TestSecurityContextOverheadRaiseBounded(t *testing.T) {
	e := overheadEnv(t)
	b := e.inContainer(ctrB)
	e.holds(ctrB, slot(e.inPIDNS(b, 4026532002, 7), 1536*mib, 1, 512*mib))
	e.uses(gpu0, b, 1700*mib)
	a := e.inContainer(ctrA)
	e.holds(ctrA, slot(e.inPIDNS(a, 4026532001, 9), 512*mib, 1, 512*mib))
	e.uses(gpu0, a, 3000*mib)
	e.samples(3)
	if got, want := e.published()[gpu0], strconv.FormatInt(1700*mib, 10); got != want {
		t.Fatalf("published %s, want the bound %s", got, want)
	}
}

// TestContextOverheadSlotMismatch: a slot that does not name the host process (another PID
// namespace, another pid there, another start time, mid-update, not live) gives no measurement:
// the agent never reads one process's slot against another's NVML figure.
func TestContextOverheadSlotMismatch(t *testing.T) {
	for name, mod := range map[string]func(*vcuda.RegionProcess){
		"other namespace": func(s *vcuda.RegionProcess) { s.PIDNS++ },
		"other pid":       func(s *vcuda.RegionProcess) { s.PID++ },
		"other start":     func(s *vcuda.RegionProcess) { s.StartTime++ },
		"in flight":       func(s *vcuda.RegionProcess) { s.Inflight = 1 },
		"not live":        func(s *vcuda.RegionProcess) { s.Live = false },
	} {
		t.Run(name, func(t *testing.T) {
			e := overheadEnv(t)
			c := e.inContainer(ctrA)
			s := slot(e.inPIDNS(c, 4026532001, 7), 1536*mib, 1, 512*mib)
			mod(&s)
			e.holds(ctrA, s)
			e.uses(gpu0, c, 1700*mib)
			e.samples(3)
			if got := e.published(); len(got) != 0 {
				t.Fatalf("published %v from a slot that is not the process's", got)
			}
		})
	}
}
