// Package memguard is the node agent's memory guard, the cap enforcement that needs no
// cooperation from the container: every interval it reads each shared GPU's processes and their
// memory from NVML on the host (host pids, the driver's own count), maps every process to its
// container through the host's /proc/<pid>/cgroup, and kills the GPU processes of a share whose
// measured memory stays over its cap, as the kernel's OOM killer does for RAM. vcuda's accounting
// region, which the container can write, stays the polite first line (an allocation over the cap
// fails with CUDA_ERROR_OUT_OF_MEMORY); what decides enforcement here is what the driver reports
// and the ledger's caps, neither of which a container can write. A tenant that lowers its region's
// counters, or allocates past vcuda (a static binary, RTLD_DEEPBIND, dlsym(RTLD_NEXT), raw ioctls),
// only chooses between a polite OOM and being killed.
package memguard

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"
	"k8s.io/utils/clock"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/hostproc"
	"github.com/tessera-gpu/tessera/internal/ledger"
	"github.com/tessera-gpu/tessera/vcuda"
)

// Event reasons.
const (
	ReasonCapExceeded        = "GPUMemoryCapExceeded"
	ReasonAccountingMismatch = "GPUMemoryAccountingMismatch"
)

// Config configures a Guard.
type Config struct {
	// NVML is the driver's library on the host (the sim backend's for --backend=sim).
	NVML nvml.Interface
	// Entries are the ledger's entries: who holds which share and cap (agent.Ledger().Entries).
	Entries func() []ledger.Entry
	// Inventory is the node's GPUs, for the metrics' labels (agent.Inventory).
	Inventory func() *api.NodeInventory
	// Region reads the accounting region vcuda keeps for a ledger ID (a container's, or a shared
	// claim's): the reading the metrics use (nri.Plugin.ReadRegion, vcuda.ParseRegion). Nil: no
	// comparison with what vcuda counted.
	Region func(ledgerID string) (*vcuda.Region, error)
	// HostProc is the host's /proc (the agent runs with hostPID).
	HostProc string
	// Interval is the time between samples; Grace how long a share must stay over its cap plus
	// tolerance, in consecutive samples, before its processes are killed (0: at the first).
	Interval, Grace time.Duration
	// ToleranceBytes and TolerancePercent: usage up to cap + max(ToleranceBytes, cap *
	// TolerancePercent / 100) is not over the cap.
	ToleranceBytes   int64
	TolerancePercent int64
	// ContextOverheadFile is where the measured per-context overhead is published for vcuda
	// (<run dir>/node/context-overhead, mounted read-only into share containers; overhead.go).
	// Empty: measured and exported, not published.
	ContextOverheadFile string
	// Compute configures the compute guard (compute.go); nil: off.
	Compute *ComputeConfig
	// Feedback configures the measured compute publisher (feedback.go; RunFeedback); nil: off.
	Feedback *FeedbackConfig
	// NodeName labels the metrics (hostname).
	NodeName string
	// Events records Warning Events on pods (nil: none).
	Events record.EventRecorder
	Log    *slog.Logger
	// Clock is the guard's time (nil: the real clock).
	Clock clock.WithTicker
}

// Guard enforces the shares' memory caps from NVML's per-process memory.
type Guard struct {
	cfg     Config
	metrics *metrics

	mu sync.Mutex
	// over is, per cap, when it was first seen over its cap plus tolerance in the current run of
	// consecutive over-cap samples.
	over map[capKey]time.Time
	// mismatchTold are the caps whose accounting mismatch was reported by an event.
	mismatchTold map[capKey]bool
	// nvmlFailing are the GPUs whose last sample failed (logged once per run of failures).
	nvmlFailing map[string]bool
	// ctx is the per-context overhead measurement (overhead.go).
	ctx *overheads
	// compute is the compute guard's state (compute.go).
	compute *computeState
	// feed is the measured compute publisher's state (feedback.go).
	feed *feedState

	// beforeKill runs after a process was attributed and before it is re-checked for killing
	// (tests: a pid reused in between).
	beforeKill func(pid uint32)
}

// New returns a guard; Register exports its metrics, Run samples until ctx ends.
func New(cfg Config) *Guard {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.HostProc == "" {
		cfg.HostProc = "/proc"
	}
	g := &Guard{cfg: cfg, over: map[capKey]time.Time{}, mismatchTold: map[capKey]bool{}, nvmlFailing: map[string]bool{}, ctx: newOverheads(), compute: newComputeState(), feed: newFeedState()}
	g.metrics = newMetrics(cfg.NodeName)
	return g
}

// Register exports the guard's metrics.
func (g *Guard) Register(reg prometheus.Registerer) error { return g.metrics.register(reg) }

// Run samples every Interval until ctx ends.
func (g *Guard) Run(ctx context.Context) error { return g.every(ctx, g.cfg.Interval, g.Sample) }

// every runs f on the guard's clock every interval until ctx ends.
func (g *Guard) every(ctx context.Context, interval time.Duration, f func()) error {
	t := g.cfg.Clock.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C():
			f()
		}
	}
}

// capKey is one memory cap on one GPU: held by a container (its ledger ID) or by a DRA claim
// whose containers all share it (the claim's ledger ID).
type capKey struct {
	holder string
	uuid   string
}

// capUnit is a share's caps on a GPU and the containers its usage is summed over.
type capUnit struct {
	capKey
	cap     int64 // memory, bytes (0: no memory cap)
	cores   int64 // compute, percent of the GPU (0 or 100 and more: no compute cap)
	holder  ledger.Entry
	members []string // container IDs
}

// attributed is a host process found on a GPU in a container, with its start time.
type attributed struct {
	pid   uint32
	start uint64
	used  uint64
}

// caps builds every enforceable cap from the ledger: a container's share on a GPU, or a shared
// claim's share (one cap, summed over every container using the claim). Whole GPUs, MIG instances
// and mdev devices have no cap to enforce here. A container that reaches one GPU through
// two caps is ambiguous (its processes cannot be split between them) and enforced on neither.
func caps(entries []ledger.Entry) (map[capKey]*capUnit, map[[2]string]capKey) {
	byID := make(map[string]*ledger.Entry, len(entries))
	for i := range entries {
		byID[entries[i].ContainerID] = &entries[i]
	}
	units := map[capKey]*capUnit{}
	of := map[[2]string]capKey{} // (container, uuid) -> its cap
	ambiguous := map[[2]string]bool{}
	join := func(holder *ledger.Entry, container string) {
		seen := map[string]bool{}
		for _, d := range holder.Devices {
			if !isShare(d) {
				continue
			}
			k := capKey{holder.ContainerID, d.UUID}
			u := units[k]
			if u == nil {
				u = &capUnit{capKey: k, holder: *holder}
				units[k] = u
			}
			if !seen[d.UUID] { // one holder's devices on a GPU are one cap, counted once per holder
				if !slices.Contains(u.members, container) {
					u.members = append(u.members, container)
				}
				cc := [2]string{container, d.UUID}
				if prev, ok := of[cc]; ok && prev != k {
					ambiguous[cc] = true
				}
				of[cc] = k
			}
			seen[d.UUID] = true
		}
	}
	for i := range entries {
		e := &entries[i]
		if e.Claim != nil || ledger.IsClaim(e.ContainerID) {
			continue
		}
		join(e, e.ContainerID)
		for _, uid := range e.Claims {
			if c := byID[ledger.ClaimID(uid)]; c != nil {
				join(c, e.ContainerID)
			}
		}
	}
	// A cap is the sum of its holder's share devices on the GPU (one per device entry), summed
	// without overflow.
	for k, u := range units {
		for _, d := range byID[k.holder].Devices {
			if d.UUID == k.uuid && isShare(d) {
				u.cap = addSat(u.cap, max(0, d.MemoryBytes))
				u.cores = addSat(u.cores, int64(max(0, d.CoresPercent)))
			}
		}
	}
	for cc := range ambiguous {
		delete(of, cc)
	}
	return units, of
}

// isShare is a device entry with a memory or a compute cap.
func isShare(d api.DeviceAssignment) bool {
	return !d.Whole && (d.MemoryBytes > 0 || d.CoresPercent > 0)
}

func addSat(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// tolerance is how far usage may pass cap: NVML counts whole pages and the driver grows a
// process's memory on its own (local memory, page tables), which no cap can foresee exactly.
func (g *Guard) tolerance(cap int64) int64 {
	return max(g.cfg.ToleranceBytes, cap/100*g.cfg.TolerancePercent)
}

// gpuSample is one GPU's processes in one sample.
type gpuSample struct {
	ok bool // NVML answered for every process
	// byContainer are the processes in ledger containers; unattributed the bytes of the others.
	byContainer  map[string][]attributed
	unattributed uint64
}

// Sample reads every shared GPU once, enforces the caps and updates the metrics.
func (g *Guard) Sample() {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.cfg.Clock.Now()
	entries := g.cfg.Entries()
	units, of := caps(entries)
	known := make(map[string]*ledger.Entry, len(entries))
	for i := range entries {
		if !ledger.IsClaim(entries[i].ContainerID) {
			known[entries[i].ContainerID] = &entries[i]
		}
	}
	uuids := map[string]bool{}
	for k := range units {
		uuids[k.uuid] = true
	}
	samples := make(map[string]*gpuSample, len(uuids))
	for uuid := range uuids {
		samples[uuid] = g.sampleGPU(uuid, known)
	}

	snap := snapshot{gpus: g.inventoryGPUs()}
	// Each holder's region is read at most once per sample.
	regions := map[string]*vcuda.Region{}
	region := func(holder string) *vcuda.Region {
		if g.cfg.Region == nil {
			return nil
		}
		r, ok := regions[holder]
		if !ok {
			r, _ = g.cfg.Region(holder) // missing or unreadable: claims nothing
			regions[holder] = r
		}
		return r
	}
	nextCtx := map[procKey]ctxObservation{}
	for uuid, s := range samples {
		if !s.ok {
			continue
		}
		snap.unattributed = append(snap.unattributed, gpuValue{uuid, float64(s.unattributed)})
		for id, procs := range s.byContainer {
			snap.measured = append(snap.measured, containerValue{known[id], uuid, float64(sumUsed(procs))})
		}
		if gp := snap.gpus[uuid]; gp != nil {
			holderOf := func(container string) string { return of[[2]string{container, uuid}].holder }
			g.measureContexts(g.ctx, nextCtx, uuid, gp.Model, s, holderOf, region, now)
		}
	}
	g.ctx.prev = nextCtx
	g.publishOverheads(g.ctx, now, &snap)

	for _, k := range sortedCaps(units, func(*capUnit) bool { return true }) {
		u := units[k]
		s := samples[k.uuid]
		if !s.ok || u.cap == 0 {
			delete(g.over, k) // missing data never counts towards the grace
			continue
		}
		var used uint64
		for _, m := range u.members {
			if of[[2]string{m, k.uuid}] == k {
				used += sumUsed(s.byContainer[m])
			}
		}
		g.compareRegion(u, used, region(u.holder.ContainerID), &snap)
		limit := addSat(u.cap, g.tolerance(u.cap))
		if used <= uint64(limit) {
			delete(g.over, k)
			continue
		}
		since, ok := g.over[k]
		if !ok {
			g.over[k], since = now, now
		}
		if now.Sub(since) < g.cfg.Grace {
			continue
		}
		delete(g.over, k)
		g.enforceMemory(u, used, s, of, now.Sub(since))
	}
	if g.cfg.Compute != nil {
		g.checkCompute(now, units, of, samples, &snap)
	}
	g.rememberAttribution(units, of, samples)
	for k := range g.over {
		if units[k] == nil {
			delete(g.over, k)
		}
	}
	for k := range g.mismatchTold {
		if units[k] == nil {
			delete(g.mismatchTold, k)
		}
	}
	g.metrics.set(snap)
}

// sortedCaps are the keys of the units keep accepts, in a fixed order (holder, then GPU), so a
// sample acts on caps, and logs and reports them, in the same order every time.
func sortedCaps(units map[capKey]*capUnit, keep func(*capUnit) bool) []capKey {
	keys := make([]capKey, 0, len(units))
	for k, u := range units {
		if keep(u) {
			keys = append(keys, k)
		}
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i].holder+keys[i].uuid < keys[j].holder+keys[j].uuid })
	return keys
}

func sumUsed(procs []attributed) uint64 {
	var n uint64
	for _, p := range procs {
		n += p.used
	}
	return n
}

// sampleGPU lists a GPU's processes (compute, graphics and MPS clients: each allocates device
// memory) and attributes each to a ledger container. A GPU NVML cannot list, or a process whose
// memory NVML cannot say, makes the sample not ok: nothing is enforced on missing data.
func (g *Guard) sampleGPU(uuid string, known map[string]*ledger.Entry) *gpuSample {
	s := &gpuSample{byContainer: map[string][]attributed{}}
	procs, err := g.processes(uuid)
	if err != nil {
		g.metrics.nvmlErrors.WithLabelValues(uuid).Inc()
		if !g.nvmlFailing[uuid] {
			g.cfg.Log.Error("memory guard: cannot list the GPU's processes; its caps are not enforced until NVML answers", "uuid", uuid, "err", err)
		}
		g.nvmlFailing[uuid] = true
		return s
	}
	if g.nvmlFailing[uuid] {
		g.cfg.Log.Info("memory guard: NVML lists the GPU's processes again", "uuid", uuid)
		delete(g.nvmlFailing, uuid)
	}
	for pid, used := range procs {
		id, err := processContainer(g.cfg.HostProc, pid)
		start, serr := hostproc.Start(g.cfg.HostProc, pid)
		if err != nil || serr != nil || known[id] == nil {
			// Gone since NVML listed it, outside any container, or in one Tessera did not
			// place (a whole-node admin pod, another device plugin): reported, never killed.
			s.unattributed += used
			continue
		}
		s.byContainer[id] = append(s.byContainer[id], attributed{pid: pid, start: start, used: used})
	}
	s.ok = true
	return s
}

// processes is the memory of every process on a GPU, by host pid. A process NVML lists twice
// (compute and graphics) is counted once.
func (g *Guard) processes(uuid string) (map[uint32]uint64, error) {
	dev, ret := g.cfg.NVML.DeviceGetHandleByUUID(uuid)
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("get device: %v", nvml.ErrorString(ret))
	}
	out := map[uint32]uint64{}
	for _, q := range []struct {
		what     string
		list     func() ([]nvml.ProcessInfo, nvml.Return)
		optional bool
	}{
		{"compute", dev.GetComputeRunningProcesses, false},
		{"graphics", dev.GetGraphicsRunningProcesses, true},
		{"MPS", dev.GetMPSComputeRunningProcesses, true},
	} {
		infos, ret := listProcesses(q.list)
		if q.optional && (ret == nvml.ERROR_NOT_SUPPORTED || ret == nvml.ERROR_FUNCTION_NOT_FOUND) {
			continue
		}
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("list %s processes: %v", q.what, nvml.ErrorString(ret))
		}
		for _, p := range infos {
			if p.UsedGpuMemory == math.MaxUint64 { // NVML_VALUE_NOT_AVAILABLE
				return nil, fmt.Errorf("list %s processes: NVML cannot say the memory of pid %d", q.what, p.Pid)
			}
			out[p.Pid] = max(out[p.Pid], p.UsedGpuMemory)
		}
	}
	return out, nil
}

// listProcesses calls an NVML process list. go-nvml's mock, which the sim backend is built on,
// panics on a method the simulation does not implement, where a real driver answers
// ERROR_NOT_SUPPORTED or ERROR_FUNCTION_NOT_FOUND: it is read as the latter.
func listProcesses(list func() ([]nvml.ProcessInfo, nvml.Return)) (infos []nvml.ProcessInfo, ret nvml.Return) {
	defer func() {
		if recover() != nil {
			infos, ret = nil, nvml.ERROR_FUNCTION_NOT_FOUND
		}
	}()
	return list()
}

// killedMember is a cap's container and the pids of it that were killed.
type killedMember struct {
	id   string
	pids []uint32
}

// killMembers kills the GPU processes of a cap's containers on its GPU, each re-checked first, and
// returns, in the cap's member order, the containers that lost processes.
func (g *Guard) killMembers(u *capUnit, s *gpuSample, of map[[2]string]capKey, why string) []killedMember {
	var out []killedMember
	for _, m := range u.members {
		if of[[2]string{m, u.uuid}] != u.capKey {
			continue
		}
		var killed []uint32
		for _, p := range s.byContainer[m] {
			if g.beforeKill != nil {
				g.beforeKill(p.pid)
			}
			err := killProcess(g.cfg.HostProc, p, m)
			switch {
			case errors.Is(err, errReplaced):
				g.cfg.Log.Info("guard: process gone or pid reused before the kill; left alone", "pid", p.pid, "containerID", m, "err", err)
			case err != nil:
				g.metrics.killErrors.Inc()
				g.cfg.Log.Error("guard: kill a process over its container's "+why, "pid", p.pid, "containerID", m, "uuid", u.uuid, "err", err)
			default:
				killed = append(killed, p.pid)
			}
		}
		if len(killed) > 0 {
			out = append(out, killedMember{m, killed})
		}
	}
	return out
}

// sharedBy says, for an Event, that a cap is a shared claim's.
func sharedBy(u *capUnit) string {
	if u.holder.Claim == nil {
		return ""
	}
	return fmt.Sprintf(" (the cap of claim %s/%s, shared by %d containers)", u.holder.Claim.Namespace, u.holder.Claim.Name, len(u.members))
}

// enforceMemory kills the GPU processes of a memory cap's containers and reports it.
func (g *Guard) enforceMemory(u *capUnit, used uint64, s *gpuSample, of map[[2]string]capKey, over time.Duration) {
	for _, k := range g.killMembers(u, s, of, "GPU memory cap") {
		m, killed := k.id, k.pids
		g.metrics.kills.Inc()
		e := g.entryOf(u, m)
		tol := g.tolerance(u.cap)
		g.cfg.Log.Warn("memory guard: GPU memory over the cap; the container's GPU processes were killed", "namespace", e.Namespace, "pod", e.Pod,
			"container", e.Container, "containerID", m, "uuid", u.uuid, "usedBytes", used, "capBytes", u.cap, "toleranceBytes", tol, "over", over, "pids", killed)
		if g.cfg.Events != nil {
			g.cfg.Events.Eventf(podRef(e), corev1.EventTypeWarning, ReasonCapExceeded,
				"container %q used %s of GPU memory on GPU %s, over its cap of %s%s (tolerance %s) for %s as NVML measures it; the Tessera node agent killed its GPU processes %v",
				e.Container, mibString(int64(min(used, math.MaxInt64))), g.gpuName(u.uuid), mibString(u.cap), sharedBy(u), mibString(tol), over, killed)
		}
	}
}

// entryOf is a cap member's own ledger entry (its pod and container names).
func (g *Guard) entryOf(u *capUnit, containerID string) *ledger.Entry {
	for _, e := range g.cfg.Entries() {
		if e.ContainerID == containerID {
			return &e
		}
	}
	return &u.holder
}

// compareRegion compares a cap's measured usage with what vcuda's region claims for it: measured
// memory past the region's count by more than the tolerance is memory allocated past vcuda (a
// static binary, RTLD_DEEPBIND, a raw ioctl) or a region the container lowered. A missing or
// unreadable region claims nothing.
func (g *Guard) compareRegion(u *capUnit, measured uint64, r *vcuda.Region, snap *snapshot) {
	if g.cfg.Region == nil {
		return
	}
	var claimed uint64
	if r != nil {
		for _, rg := range r.GPUs {
			if rg.UUID == u.uuid {
				if rg.Reclaiming {
					return // vcuda is recomputing used: no fair comparison now
				}
				claimed = rg.Used
			}
		}
	}
	tol := uint64(g.tolerance(u.cap))
	if measured <= claimed || measured-claimed <= tol {
		return
	}
	under := measured - claimed
	snap.underreport = append(snap.underreport, containerValue{&u.holder, u.uuid, float64(under)})
	if g.mismatchTold[u.capKey] {
		return
	}
	g.mismatchTold[u.capKey] = true
	e := &u.holder
	g.cfg.Log.Warn("memory guard: the GPU memory NVML measures exceeds what vcuda's accounting region counts", "namespace", e.Namespace,
		"pod", e.Pod, "container", e.Container, "holder", e.ContainerID, "uuid", u.uuid, "measuredBytes", measured, "regionBytes", claimed)
	if g.cfg.Events != nil {
		g.cfg.Events.Eventf(podRef(e), corev1.EventTypeWarning, ReasonAccountingMismatch,
			"container %q holds %s of GPU memory on GPU %s as NVML measures it, but its vcuda accounting region counts %s: memory allocated past vcuda (a static binary, a library loaded with RTLD_DEEPBIND, raw driver calls) or a region written by the container; the cap of %s is enforced on the measured usage",
			e.Container, mibString(int64(min(measured, math.MaxInt64))), g.gpuName(u.uuid), mibString(int64(min(claimed, math.MaxInt64))), mibString(u.cap))
	}
}

func podRef(e *ledger.Entry) *corev1.ObjectReference {
	return &corev1.ObjectReference{APIVersion: "v1", Kind: "Pod", Namespace: e.Namespace, Name: e.Pod, UID: types.UID(e.PodUID)}
}

func mibString(b int64) string { return fmt.Sprintf("%d MiB", b>>20) }

// gpuName is "<index> (<uuid>)" when the inventory knows the GPU.
func (g *Guard) gpuName(uuid string) string {
	if gp, ok := g.inventoryGPUs()[uuid]; ok {
		return strconv.Itoa(gp.Index) + " (" + uuid + ")"
	}
	return uuid
}
