package gpu

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	"golang.org/x/sys/unix"

	"github.com/tessera-gpu/tessera/internal/hostproc"
)

// This file is the simulated driver's per-process accounting, as NVML on the host reports it. A real
// kernel driver knows the device memory of every process (its contexts, allocations, modules, pools'
// reserved pages) and NVML lists each process by host pid, until it exits, even by SIGKILL. Inside the
// simulated node's containers the driver is vcuda/test's fake, whose state is private to each
// process; so the fake publishes one record per process in the simulated driver's state directory
// (mounted read-write into every GPU container at SimDriverStateInContainer), and here the records
// become NVML's process lists. The directory is written by containers: every record is hostile input,
// read bounded and never trusted beyond simulation.

// SimDriverStateInContainer is where containers of the simulated node find the simulated driver's
// state directory (vcuda/test/fake.h, FAKE_SIM_DRIVER_DIR_DEFAULT).
const SimDriverStateInContainer = "/run/tessera-sim/driver"

// The record layout (vcuda/test/fake.h, fake_proc_record), native byte order: magic, seq, PID
// namespace inode, pid in that namespace, start time (field 22 of /proc/<pid>/stat), the
// CLOCK_MONOTONIC ns of the write, 16 device entries of (minor u32, live contexts u32, bytes u64,
// busy ns u64), seq again.
const (
	simProcMagic      = "TSDRVPR2"
	simProcDevs       = 16
	simProcDevSize    = 24
	simProcHeaderSize = 48
	simProcRecordSize = simProcHeaderSize + simProcDevs*simProcDevSize + 8
	// simProcNoDevice marks an unused device entry.
	simProcNoDevice = ^uint32(0)
	// simProcMaxRecords bounds what one listing reads: a container filling the directory with
	// names costs the agent no more than this.
	simProcMaxRecords = 4096
	// simProcRetries is how often a record caught mid-write (seq differs at its two ends) is read again.
	simProcRetries = 3
)

// simProcRecord is one process's record, parsed.
type simProcRecord struct {
	PIDNS, NSPID, Start uint64
	// At is when the process wrote the record (CLOCK_MONOTONIC ns).
	At   uint64
	Devs []simProcDev
}

// simProcDev is what the driver charges a process on one GPU.
type simProcDev struct {
	Minor uint32
	Ctxs  uint32
	Used  uint64
	// Busy is the ns during which at least one of the process's kernels ran on the GPU, by At.
	Busy uint64
}

var (
	errSimProcTorn = errors.New("record caught mid-write")
	simProcOrder   = binary.NativeEndian
)

// parseSimProcRecord decodes a record exactly simProcRecordSize bytes long; anything else is an error,
// never a panic.
func parseSimProcRecord(b []byte) (simProcRecord, error) {
	var r simProcRecord
	if len(b) != simProcRecordSize {
		return r, fmt.Errorf("record is %d bytes, want %d", len(b), simProcRecordSize)
	}
	if string(b[:8]) != simProcMagic {
		return r, fmt.Errorf("record magic %q, want %q", b[:8], simProcMagic)
	}
	if simProcOrder.Uint64(b[8:]) != simProcOrder.Uint64(b[simProcRecordSize-8:]) {
		return r, errSimProcTorn
	}
	r.PIDNS, r.NSPID, r.Start, r.At = simProcOrder.Uint64(b[16:]), simProcOrder.Uint64(b[24:]), simProcOrder.Uint64(b[32:]), simProcOrder.Uint64(b[40:])
	if r.PIDNS == 0 || r.NSPID == 0 || r.NSPID > 1<<22 || r.Start == 0 {
		return r, fmt.Errorf("record key (pid namespace %d, pid %d, start %d) names no process", r.PIDNS, r.NSPID, r.Start)
	}
	for i := 0; i < simProcDevs; i++ {
		e := b[simProcHeaderSize+i*simProcDevSize:]
		d := simProcDev{Minor: simProcOrder.Uint32(e), Ctxs: simProcOrder.Uint32(e[4:]), Used: simProcOrder.Uint64(e[8:]), Busy: simProcOrder.Uint64(e[16:])}
		if d.Minor != simProcNoDevice {
			r.Devs = append(r.Devs, d)
		}
	}
	return r, nil
}

// fileName is the name the driver gives the record: "<pidns>-<nspid>-<start>.proc".
func (r simProcRecord) fileName() string {
	return fmt.Sprintf("%d-%d-%d.proc", r.PIDNS, r.NSPID, r.Start)
}

// simProcs reads the simulated driver's records and maps them to host pids through procRoot.
type simProcs struct {
	dir      string
	procRoot string

	// busyMu guards busySeen: per process and GPU, its latest busy reading and the utilisation
	// samples made from its readings (processUtilization).
	busyMu   sync.Mutex
	busySeen map[simBusyKey]*simBusySeen
	// wallOffsetUS turns a record's CLOCK_MONOTONIC ns into the wall-clock microseconds NVML's
	// samples carry; fixed once, so a sample keeps its timestamp from one call to the next.
	wallOffsetUS int64
}

// simBusyKey is one process (host pid and start time) on one GPU minor.
type simBusyKey struct {
	minor   uint32
	hostPID uint32
	start   uint64
}

// simBusySeen is a process's latest busy reading on a GPU (at: CLOCK_MONOTONIC ns) and the samples
// made so far, oldest first, at most simUtilSamples: as the driver keeps a buffer of samples per
// GPU and answers every caller from it, a sample one caller took is still there for another.
type simBusySeen struct {
	at, busy uint64
	samples  []nvml.ProcessUtilizationSample
	live     bool // seen in the current listing
}

// simUtilSamples bounds the samples kept per process (a caller asking less often than this many
// records loses the oldest, as the driver's buffer overwrites them).
const simUtilSamples = 64

// simProcess is a live process holding memory on a GPU, by host pid.
type simProcess struct {
	hostPID uint32
	start   uint64 // its start time: with hostPID, the process (a pid may be reused)
	at      uint64 // when its record was written (CLOCK_MONOTONIC ns)
	dev     simProcDev
}

// byMinor lists the live processes per GPU minor. Records of processes that are gone (no process in
// procRoot with that PID namespace, pid and start time) are removed: the driver freed their memory
// when they exited.
func (p *simProcs) byMinor() (map[uint32][]simProcess, error) {
	records, names, err := p.read()
	if err != nil {
		return nil, err
	}
	hosts := p.hostPIDs(records)
	out := map[uint32][]simProcess{}
	for i, r := range records {
		host, ok := hosts[i]
		if !ok {
			_ = os.Remove(filepath.Join(p.dir, names[i]))
			continue
		}
		for _, d := range r.Devs {
			if d.Used > 0 || d.Ctxs > 0 { // NVML lists a process with a context even if it holds nothing else
				out[d.Minor] = append(out[d.Minor], simProcess{hostPID: host, start: r.Start, at: r.At, dev: d})
			}
		}
	}
	for _, l := range out {
		sort.Slice(l, func(a, b int) bool { return l[a].hostPID < l[b].hostPID })
	}
	return out, nil
}

// read returns the valid records in the directory (at most simProcMaxRecords entries looked at) and
// their file names. A missing directory has none.
func (p *simProcs) read() ([]simProcRecord, []string, error) {
	dir, err := os.Open(p.dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("simulated driver state: %w", err)
	}
	defer dir.Close()
	entries, err := dir.ReadDir(simProcMaxRecords)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, nil, fmt.Errorf("simulated driver state: %w", err)
	}
	var records []simProcRecord
	var names []string
	for _, e := range entries {
		if !e.Type().IsRegular() || !strings.HasSuffix(e.Name(), ".proc") {
			continue
		}
		// Only the file named for its key counts: one record per process, however many copies of it
		// a container writes under other names.
		if r, err := readSimProcRecord(filepath.Join(p.dir, e.Name())); err == nil && e.Name() == r.fileName() {
			records = append(records, r)
			names = append(names, e.Name())
		}
	}
	return records, names, nil
}

// readSimProcRecord reads one record file: a regular file (no link followed, no FIFO waited on) of
// exactly the record's size, read again while caught mid-write.
func readSimProcRecord(path string) (simProcRecord, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return simProcRecord{}, err
	}
	defer f.Close()
	if st, err := f.Stat(); err != nil || !st.Mode().IsRegular() {
		return simProcRecord{}, fmt.Errorf("%s is not a regular file", path)
	}
	buf := make([]byte, simProcRecordSize+1)
	for try := 0; ; try++ {
		n, err := f.ReadAt(buf, 0)
		if err != nil && !errors.Is(err, io.EOF) {
			return simProcRecord{}, err
		}
		r, err := parseSimProcRecord(buf[:n])
		if !errors.Is(err, errSimProcTorn) || try == simProcRetries {
			return r, err
		}
	}
}

// hostPIDs maps records (by index) to the pid of their process in procRoot: the process whose
// /proc/<pid>/ns/pid is the record's namespace, whose innermost NSpid is the record's pid and whose
// start time is the record's. Records without one are absent.
func (p *simProcs) hostPIDs(records []simProcRecord) map[int]uint32 {
	out := map[int]uint32{}
	if len(records) == 0 {
		return out
	}
	type key struct{ ns, pid uint64 }
	want := map[key][]int{}
	namespaces := map[uint64]bool{}
	for i, r := range records {
		want[key{r.PIDNS, r.NSPID}] = append(want[key{r.PIDNS, r.NSPID}], i)
		namespaces[r.PIDNS] = true
	}
	entries, err := os.ReadDir(p.procRoot)
	if err != nil {
		return out
	}
	for _, e := range entries {
		pid, err := strconv.ParseUint(e.Name(), 10, 32)
		if err != nil || pid == 0 {
			continue
		}
		host := uint32(pid)
		ns, err := hostproc.PIDNamespace(p.procRoot, host)
		if err != nil || !namespaces[ns] {
			continue
		}
		status, err := hostproc.ReadFile(p.procRoot, host, "status")
		if err != nil {
			continue
		}
		nspid, err := hostproc.NSpid(status)
		if err != nil {
			continue
		}
		idx := want[key{ns, nspid}]
		if len(idx) == 0 {
			continue
		}
		start, err := hostproc.Start(p.procRoot, host)
		if err != nil {
			continue
		}
		for _, i := range idx {
			if records[i].Start == start {
				out[i] = uint32(pid)
			}
		}
	}
	return out
}

// strictProcesses makes a GPU's process lists the simulated driver's: compute processes from the
// records by host pid (GPU and compute instance not attributable: a process on the full GPU), no
// graphics or MPS clients. go-nvml's wrapper of the C call retries on INSUFFICIENT_SIZE until the
// list fits, so its Go interface only ever sees the whole list.
func (b *simBackend) strictProcesses(d *server.Device) {
	compute := func() ([]nvml.ProcessInfo, nvml.Return) {
		if b.lost(d) {
			return nil, nvml.ERROR_GPU_IS_LOST
		}
		all, err := b.procs.byMinor()
		if err != nil {
			return nil, nvml.ERROR_UNKNOWN
		}
		var out []nvml.ProcessInfo
		for _, p := range all[uint32(d.Minor)] {
			out = append(out, nvml.ProcessInfo{Pid: p.hostPID, UsedGpuMemory: p.dev.Used, GpuInstanceId: noInstance, ComputeInstanceId: noInstance})
		}
		return out, nvml.SUCCESS
	}
	none := func() ([]nvml.ProcessInfo, nvml.Return) {
		if b.lost(d) {
			return nil, nvml.ERROR_GPU_IS_LOST
		}
		return nil, nvml.SUCCESS
	}
	d.GetComputeRunningProcessesFunc = compute
	d.GetGraphicsRunningProcessesFunc = none
	d.GetMPSComputeRunningProcessesFunc = none
	d.GetProcessUtilizationFunc = func(lastSeen uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
		if b.lost(d) {
			return nil, nvml.ERROR_GPU_IS_LOST
		}
		return b.procs.processUtilization(uint32(d.Minor), lastSeen)
	}
}

// processUtilization is NVML's per-process utilisation of a GPU as the real driver samples it: for
// each process that ran kernels there, a sample per period between two of its successive records, of
// the share of time (SmUtil, percent) during which at least one of its kernels ran, stamped
// (wall-clock microseconds) with the period's end; each period starts where the process's previous
// one ended. Every kept sample newer than lastSeen is returned (the last simUtilSamples per
// process), so callers with their own lastSeen each see every period; ERROR_NOT_FOUND when there
// are none. A process whose record did not change since the last call has no new sample (an idle
// process writes no record, as a driver samples only processes that ran). Busy time comes from the
// containers' own records, so a hostile container can under-report it here; the simulation cannot
// do better, a real driver counts it itself (internal/testing/README.md, the sim's row).
func (p *simProcs) processUtilization(minor uint32, lastSeen uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
	all, err := p.byMinor()
	if err != nil {
		return nil, nvml.ERROR_UNKNOWN
	}
	p.busyMu.Lock()
	defer p.busyMu.Unlock()
	if p.busySeen == nil {
		p.busySeen = map[simBusyKey]*simBusySeen{}
		var ts unix.Timespec
		_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
		p.wallOffsetUS = time.Now().UnixMicro() - ts.Nano()/1000
	}
	for k, s := range p.busySeen {
		if k.minor == minor {
			s.live = false
		}
	}
	var out []nvml.ProcessUtilizationSample
	for _, proc := range all[minor] {
		k := simBusyKey{minor, proc.hostPID, proc.start}
		s := p.busySeen[k]
		if s == nil {
			s = &simBusySeen{at: proc.at, busy: proc.dev.Busy}
			p.busySeen[k] = s
		} else if proc.at > s.at && proc.dev.Busy >= s.busy {
			util := min(100, (proc.dev.Busy-s.busy)*100/(proc.at-s.at))
			stamp := uint64(max(0, p.wallOffsetUS+int64(proc.at/1000)))
			s.samples = append(s.samples, nvml.ProcessUtilizationSample{Pid: proc.hostPID, TimeStamp: stamp, SmUtil: uint32(util)})
			if len(s.samples) > simUtilSamples {
				s.samples = s.samples[len(s.samples)-simUtilSamples:]
			}
			s.at, s.busy = proc.at, proc.dev.Busy
		}
		s.live = true
		for _, smp := range s.samples {
			if smp.TimeStamp > lastSeen {
				out = append(out, smp)
			}
		}
	}
	for k, s := range p.busySeen {
		if k.minor == minor && !s.live {
			delete(p.busySeen, k) // gone: its memory of busy time goes with it
		}
	}
	if len(out) == 0 {
		return nil, nvml.ERROR_NOT_FOUND
	}
	return out, nvml.SUCCESS
}

// strictMIGProcesses: the records name GPUs by minor, not GPU instances, so a MIG device lists no
// processes (they are listed on the parent, as real NVML lists every process there to root).
func strictMIGProcesses(m *mock.Device, parentLost func() bool) {
	none := func() ([]nvml.ProcessInfo, nvml.Return) {
		if parentLost() {
			return nil, nvml.ERROR_GPU_IS_LOST
		}
		return nil, nvml.SUCCESS
	}
	m.GetComputeRunningProcessesFunc = none
	m.GetGraphicsRunningProcessesFunc = none
	m.GetMPSComputeRunningProcessesFunc = none
	// Utilisation is sampled per GPU, not per GPU instance: a MIG device has none (NOT_SUPPORTED,
	// as real NVML answers on a MIG device handle).
	m.GetProcessUtilizationFunc = func(uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
		if parentLost() {
			return nil, nvml.ERROR_GPU_IS_LOST
		}
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
}

// serveProcesses answers the library-level process calls through the device's own.
func (b *simBackend) serveProcesses() {
	b.srv.DeviceGetComputeRunningProcessesFunc = func(d nvml.Device) ([]nvml.ProcessInfo, nvml.Return) {
		return d.GetComputeRunningProcesses()
	}
	b.srv.DeviceGetGraphicsRunningProcessesFunc = func(d nvml.Device) ([]nvml.ProcessInfo, nvml.Return) {
		return d.GetGraphicsRunningProcesses()
	}
	b.srv.DeviceGetMPSComputeRunningProcessesFunc = func(d nvml.Device) ([]nvml.ProcessInfo, nvml.Return) {
		return d.GetMPSComputeRunningProcesses()
	}
	b.srv.DeviceGetProcessUtilizationFunc = func(d nvml.Device, lastSeen uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
		return d.GetProcessUtilization(lastSeen)
	}
}

// makeSimDriverState creates the state directory the containers' simulated driver writes into:
// world-writable (a container's user may be anyone) and sticky (one user cannot remove another's
// records).
func makeSimDriverState(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("create simulated driver state directory: %w", err)
	}
	if err := os.Chmod(dir, 0o777|os.ModeSticky); err != nil {
		return fmt.Errorf("simulated driver state directory: %w", err)
	}
	return nil
}
