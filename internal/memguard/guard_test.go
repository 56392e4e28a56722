package memguard

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"k8s.io/client-go/tools/record"
	clocktesting "k8s.io/utils/clock/testing"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/ledger"
	"github.com/tessera-gpu/tessera/vcuda"
)

const (
	mib       = int64(1) << 20
	gpu0      = "GPU-00000000-0000-0000-0000-000000000000"
	gpu1      = "GPU-11111111-1111-1111-1111-111111111111"
	ctrA      = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	ctrB      = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
	ctrW      = "cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc"
	ctrNobody = "dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd"
)

// env is a guard over a fake host /proc (real child processes, their real stat, a cgroup file the
// test writes), go-nvml's upstream mock as the driver, a fixed ledger and a fake clock.
type env struct {
	t      *testing.T
	proc   string
	clock  *clocktesting.FakeClock
	events *record.FakeRecorder
	guard  *Guard

	mu      sync.Mutex
	entries []ledger.Entry
	procs   map[string][]nvml.ProcessInfo // by GPU
	fail    map[string]nvml.Return        // by GPU: the compute list's answer
	regions map[string]*vcuda.Region
	// util is, by GPU, each process's SM utilisation (percent) the driver samples; utilRet, when
	// set, is what the utilisation call answers instead.
	util    map[string]map[uint32]uint32
	utilRet map[string]nvml.Return
	stamp   uint64 // the driver's sample clock, microseconds
	// buffer, when set for a GPU, replaces util: the driver's buffer of samples, every one newer
	// than the caller's lastSeen returned to each caller, as the driver answers several readers.
	buffer map[string][]nvml.ProcessUtilizationSample
}

func newEnv(t *testing.T, entries ...ledger.Entry) *env {
	e := &env{t: t, proc: t.TempDir(), clock: clocktesting.NewFakeClock(time.Unix(1_800_000_000, 0)), events: record.NewFakeRecorder(100),
		entries: entries, procs: map[string][]nvml.ProcessInfo{}, fail: map[string]nvml.Return{}, regions: map[string]*vcuda.Region{},
		util: map[string]map[uint32]uint32{}, utilRet: map[string]nvml.Return{}, buffer: map[string][]nvml.ProcessUtilizationSample{}}
	devices := map[string]*mock.Device{}
	for _, uuid := range []string{gpu0, gpu1} {
		devices[uuid] = &mock.Device{
			GetComputeRunningProcessesFunc: func() ([]nvml.ProcessInfo, nvml.Return) {
				e.mu.Lock()
				defer e.mu.Unlock()
				if r, ok := e.fail[uuid]; ok {
					return nil, r
				}
				return append([]nvml.ProcessInfo(nil), e.procs[uuid]...), nvml.SUCCESS
			},
			// A driver without graphics accounting answers NOT_SUPPORTED; MPS is left out of the
			// mock, which then panics as the sim backend's would.
			GetGraphicsRunningProcessesFunc: func() ([]nvml.ProcessInfo, nvml.Return) { return nil, nvml.ERROR_NOT_SUPPORTED },
			// As the driver samples: a few samples per process since the caller's last seen
			// timestamp (each call is a new period), NOT_FOUND when no process ran kernels.
			GetProcessUtilizationFunc: func(lastSeen uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
				e.mu.Lock()
				defer e.mu.Unlock()
				if r, ok := e.utilRet[uuid]; ok {
					return nil, r
				}
				var out []nvml.ProcessUtilizationSample
				if buf, ok := e.buffer[uuid]; ok {
					for _, smp := range buf {
						if smp.TimeStamp > lastSeen {
							out = append(out, smp)
						}
					}
					if len(out) == 0 {
						return nil, nvml.ERROR_NOT_FOUND
					}
					return out, nvml.SUCCESS
				}
				for pid, u := range e.util[uuid] {
					for range 3 {
						e.stamp += 1000
						out = append(out, nvml.ProcessUtilizationSample{Pid: pid, TimeStamp: e.stamp, SmUtil: u})
					}
					// A sample the caller has already seen is repeated: it must not count again.
					out = append(out, nvml.ProcessUtilizationSample{Pid: pid, TimeStamp: lastSeen, SmUtil: 100})
				}
				if len(out) == 0 {
					return nil, nvml.ERROR_NOT_FOUND
				}
				return out, nvml.SUCCESS
			},
		}
	}
	lib := &mock.Interface{DeviceGetHandleByUUIDFunc: func(uuid string) (nvml.Device, nvml.Return) {
		if d, ok := devices[uuid]; ok {
			return d, nvml.SUCCESS
		}
		return nil, nvml.ERROR_NOT_FOUND
	}}
	inv := &api.NodeInventory{GPUs: []api.GPU{{Index: 0, UUID: gpu0, Minor: 0, Model: "A100"}, {Index: 1, UUID: gpu1, Minor: 1, Model: "A100"}}}
	e.guard = New(Config{NVML: lib, HostProc: e.proc, Interval: time.Second, Grace: 3 * time.Second, ToleranceBytes: 64 * mib, TolerancePercent: 2,
		NodeName: "node-a", Events: e.events, Clock: e.clock,
		Entries: func() []ledger.Entry {
			e.mu.Lock()
			defer e.mu.Unlock()
			return append([]ledger.Entry(nil), e.entries...)
		},
		Inventory: func() *api.NodeInventory { return inv },
		Region: func(id string) (*vcuda.Region, error) {
			e.mu.Lock()
			defer e.mu.Unlock()
			if r := e.regions[id]; r != nil {
				return r, nil
			}
			return nil, os.ErrNotExist
		}})
	if err := e.guard.Register(prometheus.NewRegistry()); err != nil {
		t.Fatal(err)
	}
	return e
}

// child is a real process (sleep 600) placed, in the fake /proc, in a container's cgroup.
type child struct {
	pid  uint32
	done chan error
}

func (e *env) child(cgroup string) *child {
	e.t.Helper()
	cmd := exec.Command("sleep", "600")
	if err := cmd.Start(); err != nil {
		e.t.Fatalf("start a child process: %v", err)
	}
	c := &child{pid: uint32(cmd.Process.Pid), done: make(chan error, 1)}
	go func() { c.done <- cmd.Wait() }()
	e.t.Cleanup(func() { cmd.Process.Kill(); <-c.done })
	dir := filepath.Join(e.proc, strconv.Itoa(cmd.Process.Pid))
	stat, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(cmd.Process.Pid), "stat"))
	if err != nil {
		e.t.Fatal(err)
	}
	status, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(cmd.Process.Pid), "status"))
	if err != nil {
		e.t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		e.t.Fatal(err)
	}
	for name, data := range map[string][]byte{"stat": stat, "status": status, "cgroup": []byte(cgroup)} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			e.t.Fatal(err)
		}
	}
	return c
}

// inContainer is a child in the cgroup containerd's systemd driver gives container id.
func (e *env) inContainer(id string) *child {
	return e.child("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0e4b3c1a_1111_2222_3333_444455556666.slice/cri-containerd-" + id + ".scope\n")
}

func (e *env) uses(uuid string, c *child, bytes int64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	ps := e.procs[uuid][:0:0]
	for _, p := range e.procs[uuid] {
		if p.Pid != c.pid {
			ps = append(ps, p)
		}
	}
	e.procs[uuid] = append(ps, nvml.ProcessInfo{Pid: c.pid, UsedGpuMemory: uint64(bytes)})
}

// samples advances the clock by one interval and samples, n times.
func (e *env) samples(n int) {
	for range n {
		e.clock.Step(time.Second)
		e.guard.Sample()
	}
}

// killed waits for c to end (the guard's SIGKILL) and checks it died of SIGKILL. The deadline only
// keeps a regression from hanging the suite until sleep ends; it is not what is asserted.
func (c *child) killed(t *testing.T) {
	t.Helper()
	select {
	case err := <-c.done:
		c.done <- err
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Fatalf("child %d ended with %v, want SIGKILL", c.pid, err)
		}
	case <-time.After(time.Minute):
		t.Fatalf("child %d was not killed", c.pid)
	}
}

// alive checks c was not killed.
func (c *child) alive(t *testing.T) {
	t.Helper()
	select {
	case err := <-c.done:
		c.done <- err
		t.Fatalf("child %d ended (%v); it must be left alone", c.pid, err)
	default:
	}
	if err := syscall.Kill(int(c.pid), 0); err != nil {
		t.Fatalf("child %d: %v", c.pid, err)
	}
}

func (e *env) kills() float64 { return testutil.ToFloat64(e.guard.metrics.kills) }

func (e *env) eventsWith(reason string) []string {
	var out []string
	for {
		select {
		case ev := <-e.events.Events:
			if strings.Contains(ev, reason) {
				out = append(out, ev)
			}
		default:
			return out
		}
	}
}

func share(id, pod string, uuid string, mem int64) ledger.Entry {
	return ledger.Entry{ContainerID: id, PodUID: "uid-" + pod, Namespace: "team", Pod: pod, Container: "main",
		Devices: []api.DeviceAssignment{{UUID: uuid, MemoryBytes: mem}}}
}

// TestSecurityMemoryCapKill: a share whose measured memory stays over its cap plus tolerance for
// the grace period has its GPU processes killed, with a Warning Event naming pod, container, GPU,
// used and cap, and the kill counter; the container's other processes under no cap on that GPU are
// not its concern. Mutation: without the kill (enforce returns at once) the child lives and this
// fails.
func TestSecurityMemoryCapKill(t *testing.T) {
	e := newEnv(t, share(ctrA, "pod-a", gpu0, 256*mib))
	c := e.inContainer(ctrA)
	e.uses(gpu0, c, 4096*mib) // allocated past vcuda: a DEEPBIND library, a static binary
	for range 3 {             // at 0s, 1s, 2s over the cap: inside the grace
		e.samples(1)
		c.alive(t)
	}
	e.samples(1) // 3s over the cap
	c.killed(t)
	if got := e.kills(); got != 1 {
		t.Errorf("tessera_memory_cap_kills_total = %v, want 1", got)
	}
	ev := e.eventsWith(ReasonCapExceeded)
	if len(ev) != 1 {
		t.Fatalf("events %v, want one %s", ev, ReasonCapExceeded)
	}
	for _, want := range []string{"Warning", `"main"`, "4096 MiB", "cap of 256 MiB", "GPU 0 (" + gpu0 + ")", strconv.Itoa(int(c.pid))} {
		if !strings.Contains(ev[0], want) {
			t.Errorf("event %q does not say %q", ev[0], want)
		}
	}
	// The event goes on the pod (FakeRecorder drops the object; the reference is built from the entry).
	if r := podRef(&e.entries[0]); r.Kind != "Pod" || r.Namespace != "team" || r.Name != "pod-a" || r.UID != "uid-pod-a" {
		t.Errorf("event object %+v", r)
	}
}

// TestSecurityMemoryCapGrace: over the cap for less than the grace, then under it, is left alone;
// the run of over-cap samples starts again after. Mutation: with the grace check removed (kill at
// the first over-cap sample) the child dies and this fails.
func TestSecurityMemoryCapGrace(t *testing.T) {
	e := newEnv(t, share(ctrA, "pod-a", gpu0, 1024*mib))
	c := e.inContainer(ctrA)
	for range 2 {
		e.uses(gpu0, c, 2048*mib)
		e.samples(3) // 0s, 1s, 2s: a spike shorter than the 3s grace
		e.uses(gpu0, c, 512*mib)
		e.samples(1)
	}
	c.alive(t)
	if e.kills() != 0 || len(e.eventsWith(ReasonCapExceeded)) != 0 {
		t.Errorf("kills %v, events: a spike shorter than the grace must be left alone", e.kills())
	}
}

// TestMemoryCapTolerance: usage up to cap + max(64 MiB, 2% of cap) is under the cap, however long.
func TestMemoryCapTolerance(t *testing.T) {
	e := newEnv(t, share(ctrA, "pod-a", gpu0, 256*mib), share(ctrB, "pod-b", gpu1, 10240*mib))
	a, b := e.inContainer(ctrA), e.inContainer(ctrB)
	e.uses(gpu0, a, 256*mib+64*mib)            // the 64 MiB floor
	e.uses(gpu1, b, 10240*mib+10240*mib/100*2) // 2% of a 10 GiB cap
	e.samples(10)
	a.alive(t)
	b.alive(t)
	if e.kills() != 0 {
		t.Errorf("kills %v under cap plus tolerance", e.kills())
	}
	e.uses(gpu0, a, 256*mib+64*mib+1)
	e.samples(4)
	a.killed(t)
	b.alive(t)
}

// TestSecuritySharedClaimCapSummed: the containers of a shared DRA claim share the claim's one
// cap: their usage is summed and all of them are over it together. Mutation: give each container
// the claim's cap of its own (no sum) and neither is killed.
func TestSecuritySharedClaimCapSummed(t *testing.T) {
	claim := ledger.Entry{ContainerID: ledger.ClaimID("c1"), PodUID: "uid-pod-a", Namespace: "team", Pod: "pod-a", Container: "resourceclaim/shared",
		Claim:   &ledger.Claim{UID: "c1", Namespace: "team", Name: "shared", PodUIDs: []string{"uid-pod-a", "uid-pod-b"}},
		Devices: []api.DeviceAssignment{{UUID: gpu0, MemoryBytes: 1024 * mib}}}
	a := ledger.Entry{ContainerID: ctrA, PodUID: "uid-pod-a", Namespace: "team", Pod: "pod-a", Container: "main", Claims: []string{"c1"}}
	b := ledger.Entry{ContainerID: ctrB, PodUID: "uid-pod-b", Namespace: "team", Pod: "pod-b", Container: "main", Claims: []string{"c1"}}
	e := newEnv(t, claim, a, b)
	ca, cb := e.inContainer(ctrA), e.inContainer(ctrB)
	e.uses(gpu0, ca, 600*mib) // each under the 1 GiB cap, together 1200 MiB over it
	e.uses(gpu0, cb, 600*mib)
	e.samples(4)
	ca.killed(t)
	cb.killed(t)
	if e.kills() != 2 {
		t.Errorf("kills %v, want both containers of the claim", e.kills())
	}
	if ev := e.eventsWith(ReasonCapExceeded); len(ev) != 2 || !strings.Contains(ev[0], "claim team/shared, shared by 2 containers") {
		t.Errorf("events %v", ev)
	}
}

// TestSecurityWholeGPUNeverKilled: a container holding a GPU whole has no memory cap; its
// processes are never killed, even on a GPU the guard samples and with a (hostile) memory figure
// in its assignment. Mutation: drop the d.Whole check in caps and it is killed.
func TestSecurityWholeGPUNeverKilled(t *testing.T) {
	whole := ledger.Entry{ContainerID: ctrW, PodUID: "uid-w", Namespace: "team", Pod: "pod-w", Container: "main",
		Devices: []api.DeviceAssignment{{UUID: gpu0, Whole: true, MemoryBytes: 256 * mib}}}
	e := newEnv(t, whole, share(ctrA, "pod-a", gpu0, 256*mib))
	w := e.inContainer(ctrW)
	e.uses(gpu0, w, 40960*mib)
	e.samples(6)
	w.alive(t)
	if e.kills() != 0 {
		t.Errorf("kills %v", e.kills())
	}
}

// TestSecurityUnknownProcessNeverKilled: processes on a shared GPU in no container Tessera placed
// (the host, another runtime's container, a cgroup file that names no single container) are
// reported as unattributed memory and never killed.
func TestSecurityUnknownProcessNeverKilled(t *testing.T) {
	e := newEnv(t, share(ctrA, "pod-a", gpu0, 256*mib))
	host := e.child("0::/system.slice/ollama.service\n")
	other := e.inContainer(ctrNobody)
	split := e.child("0::/kubepods/pod1/" + ctrA + "\n1:memory:/kubepods/pod1/" + ctrB + "\n")
	e.uses(gpu0, host, 8192*mib)
	e.uses(gpu0, other, 8192*mib)
	e.uses(gpu0, split, 8192*mib)
	e.samples(6)
	for _, c := range []*child{host, other, split} {
		c.alive(t)
	}
	if e.kills() != 0 {
		t.Errorf("kills %v", e.kills())
	}
	want := fmt.Sprintf(`tessera_gpu_memory_unattributed_bytes{UUID="%s",device="nvidia0",gpu="0",hostname="node-a",modelName="A100"} %d`, gpu0, 3*8192*mib)
	if got := scrape(t, e.guard.metrics); !strings.Contains(got, want) {
		t.Errorf("metrics\n%s\nlack %s", got, want)
	}
}

// TestSecurityPidReuseNotKilled: a pid whose process changed between the measurement and the kill
// (another start time: the pid was reused) is not killed. Mutation: skip the start-time check in
// sameProcess and the child is killed.
func TestSecurityPidReuseNotKilled(t *testing.T) {
	e := newEnv(t, share(ctrA, "pod-a", gpu0, 256*mib))
	c := e.inContainer(ctrA)
	e.uses(gpu0, c, 4096*mib)
	e.guard.beforeKill = func(pid uint32) {
		statPath := filepath.Join(e.proc, strconv.Itoa(int(pid)), "stat")
		stat, err := os.ReadFile(statPath)
		if err != nil {
			t.Fatal(err)
		}
		// Another process now has the pid: same command, later start time.
		fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
		fields[19] = fields[19] + "7"
		if err := os.WriteFile(statPath, []byte(fmt.Sprintf("%d (sleep) %s\n", pid, strings.Join(fields, " "))), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	e.samples(4)
	c.alive(t)
	if e.kills() != 0 || testutil.ToFloat64(e.guard.metrics.killErrors) != 0 {
		t.Errorf("kills %v, kill errors %v", e.kills(), testutil.ToFloat64(e.guard.metrics.killErrors))
	}
}

// TestSecurityPidInOtherContainerNotKilled: a pid that, at the kill, is in another container than
// the one measured (reused there) is not killed. Mutation: skip the container check in sameProcess
// and the child is killed.
func TestSecurityPidInOtherContainerNotKilled(t *testing.T) {
	e := newEnv(t, share(ctrA, "pod-a", gpu0, 256*mib), share(ctrB, "pod-b", gpu1, 256*mib))
	c := e.inContainer(ctrA)
	e.uses(gpu0, c, 4096*mib)
	e.guard.beforeKill = func(pid uint32) {
		cg := "0::/kubepods/pod1/" + ctrB + "\n"
		if err := os.WriteFile(filepath.Join(e.proc, strconv.Itoa(int(pid)), "cgroup"), []byte(cg), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	e.samples(4)
	c.alive(t)
	if e.kills() != 0 {
		t.Errorf("kills %v", e.kills())
	}
}

// TestSecurityNVMLErrorNothingKilled: a sample NVML cannot answer (an error, or a process whose
// memory it cannot say) is missing data: it enforces nothing and breaks the run of over-cap
// samples. Mutation: without the reset of the run on a failed sample (delete(g.over, k)) the
// child is killed at the first over-cap sample after the failure.
func TestSecurityNVMLErrorNothingKilled(t *testing.T) {
	e := newEnv(t, share(ctrA, "pod-a", gpu0, 256*mib))
	c := e.inContainer(ctrA)
	e.uses(gpu0, c, 4096*mib)
	for _, fail := range []func(){
		func() { e.fail[gpu0] = nvml.ERROR_UNKNOWN },
		func() { e.fail[gpu0] = nvml.ERROR_GPU_IS_LOST },
		func() { e.procs[gpu0] = []nvml.ProcessInfo{{Pid: c.pid, UsedGpuMemory: ^uint64(0)}} }, // NVML_VALUE_NOT_AVAILABLE
	} {
		e.samples(3)
		e.mu.Lock()
		fail()
		e.mu.Unlock()
		e.samples(1)
		e.mu.Lock()
		delete(e.fail, gpu0)
		e.mu.Unlock()
		e.uses(gpu0, c, 4096*mib)
	}
	c.alive(t)
	if e.kills() != 0 {
		t.Errorf("kills %v on missing data", e.kills())
	}
	if got := testutil.ToFloat64(e.guard.metrics.nvmlErrors.WithLabelValues(gpu0)); got != 3 {
		t.Errorf("tessera_memory_guard_nvml_errors_total = %v, want 3", got)
	}
}

// TestSecurityRegionUnderreport: memory the driver measures past what the container's vcuda
// region counts (the region's used zeroed, or memory allocated past vcuda) is exported and told
// once by a Warning Event; the cap is enforced on the measured figure whatever the region says.
func TestSecurityRegionUnderreport(t *testing.T) {
	e := newEnv(t, share(ctrA, "pod-a", gpu0, 1024*mib))
	c := e.inContainer(ctrA)
	e.uses(gpu0, c, 900*mib)
	e.regions[ctrA] = &vcuda.Region{GPUs: []vcuda.RegionGPU{{UUID: gpu0, MemCap: uint64(1024 * mib), Used: 0}}}
	e.samples(3)
	ev := e.eventsWith(ReasonAccountingMismatch)
	if len(ev) != 1 || !strings.Contains(ev[0], "900 MiB") || !strings.Contains(ev[0], "counts 0 MiB") {
		t.Fatalf("events %v, want one %s", ev, ReasonAccountingMismatch)
	}
	want := fmt.Sprintf(`tessera_container_region_underreport_bytes{UUID="%s",container="main",gpu="0",hostname="node-a",namespace="team",pod="pod-a"} %d
tessera_container_gpu_memory_measured_bytes{UUID="%s",container="main",gpu="0",hostname="node-a",namespace="team",pod="pod-a"} %d`, gpu0, 900*mib, gpu0, 900*mib)
	for _, line := range strings.Split(want, "\n") {
		if !strings.Contains(scrape(t, e.guard.metrics), line) {
			t.Errorf("metrics lack %s", line)
		}
	}
	// An honest region (within tolerance of the measurement) is no mismatch.
	e.regions[ctrA].GPUs[0].Used = uint64(880 * mib)
	e.samples(1)
	if strings.Contains(scrape(t, e.guard.metrics), "tessera_container_region_underreport_bytes{") {
		t.Error("underreport exported for a region within tolerance")
	}
	c.alive(t)
}

func scrape(t *testing.T, c prometheus.Collector) string {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, mf := range mfs {
		for _, m := range mf.Metric {
			var l []string
			for _, lp := range m.Label {
				l = append(l, fmt.Sprintf("%s=%q", lp.GetName(), lp.GetValue()))
			}
			fmt.Fprintf(&b, "%s{%s} %d\n", mf.GetName(), strings.Join(l, ","), int64(m.GetGauge().GetValue()))
		}
	}
	return b.String()
}
