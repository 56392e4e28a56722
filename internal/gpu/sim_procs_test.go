package gpu

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/tessera-gpu/tessera/internal/testing/fakedriver"
)

// simRecord encodes a record as vcuda/test/fake.h lays it out (written out here byte by byte, not
// through the parser's constants).
func simRecord(pidns, nspid, start uint64, devs ...simProcDev) []byte {
	return simRecordAt(pidns, nspid, start, 0, devs...)
}

// simRecordAt is simRecord written at `at` (CLOCK_MONOTONIC ns).
func simRecordAt(pidns, nspid, start, at uint64, devs ...simProcDev) []byte {
	b := make([]byte, 440)
	copy(b, "TSDRVPR2")
	binary.NativeEndian.PutUint64(b[8:], 7)
	binary.NativeEndian.PutUint64(b[16:], pidns)
	binary.NativeEndian.PutUint64(b[24:], nspid)
	binary.NativeEndian.PutUint64(b[32:], start)
	binary.NativeEndian.PutUint64(b[40:], at)
	for i := 0; i < 16; i++ {
		e := b[48+24*i:]
		binary.NativeEndian.PutUint32(e, ^uint32(0))
		if i < len(devs) {
			binary.NativeEndian.PutUint32(e, devs[i].Minor)
			binary.NativeEndian.PutUint32(e[4:], devs[i].Ctxs)
			binary.NativeEndian.PutUint64(e[8:], devs[i].Used)
			binary.NativeEndian.PutUint64(e[16:], devs[i].Busy)
		}
	}
	binary.NativeEndian.PutUint64(b[432:], 7)
	return b
}

// Records come from containers: whatever their bytes, parsing refuses what is not a whole record and
// never panics.
func TestSimProcRecordRefusesGarbage(t *testing.T) {
	good := simRecordAt(4026532000, 7, 12345, 99, simProcDev{Minor: 3, Ctxs: 1, Used: 1 << 30, Busy: 5e8})
	r, err := parseSimProcRecord(good)
	if err != nil || r.PIDNS != 4026532000 || r.NSPID != 7 || r.Start != 12345 || r.At != 99 || len(r.Devs) != 1 ||
		r.Devs[0] != (simProcDev{Minor: 3, Ctxs: 1, Used: 1 << 30, Busy: 5e8}) {
		t.Fatalf("good record: %+v, %v", r, err)
	}
	mutate := func(f func(b []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	for name, b := range map[string][]byte{
		"empty":      nil,
		"short":      good[:439],
		"long":       append(append([]byte(nil), good...), 0),
		"magic":      mutate(func(b []byte) []byte { b[0] = 'X'; return b }),
		"torn":       mutate(func(b []byte) []byte { b[432]++; return b }),
		"no pid":     simRecord(4026532000, 0, 12345),
		"no ns":      simRecord(0, 7, 12345),
		"no start":   simRecord(4026532000, 7, 0),
		"pid > max":  simRecord(4026532000, 1<<23, 12345),
		"all ones":   mutate(func(b []byte) []byte { copy(b[8:], strings.Repeat("\xff", 432)); return b }),
		"text":       []byte(strings.Repeat("TSDRVPR2", 55)),
		"twice size": append(append([]byte(nil), good...), good...),
	} {
		if _, err := parseSimProcRecord(b); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func FuzzSimProcRecord(f *testing.F) {
	f.Add(simRecord(4026532000, 7, 12345, simProcDev{Minor: 3, Ctxs: 1, Used: 1 << 30}))
	f.Add([]byte("TSDRVPR2"))
	f.Add(make([]byte, 440))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := parseSimProcRecord(b)
		if err == nil && (len(b) != 440 || len(r.Devs) > 16) {
			t.Fatalf("accepted %d bytes with %d devices", len(b), len(r.Devs))
		}
	})
}

// fakeProc writes a process into a fake /proc: its PID namespace link, NSpid and start time.
func fakeProc(t *testing.T, root string, hostPID int, pidns uint64, nspids string, start uint64) {
	t.Helper()
	dir := filepath.Join(root, strconv.Itoa(hostPID))
	if err := os.MkdirAll(filepath.Join(dir, "ns"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(fmt.Sprintf("pid:[%d]", pidns), filepath.Join(dir, "ns/pid")); err != nil {
		t.Fatal(err)
	}
	status := "Name:\tholder\nPid:\t" + strconv.Itoa(hostPID) + "\nNSpid:\t" + nspids + "\nNSpgid:\t1\n"
	// A command name with spaces and a ')' is why field 22 is counted from the last ')'.
	stat := fmt.Sprintf("%d (a) b c) S 1 1 1 0 -1 4194560 100 0 0 0 0 0 0 0 20 0 1 0 %d 1000 10\n", hostPID, start)
	for name, text := range map[string]string{"status": status, "stat": stat} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// A record names a process by (PID namespace, pid there, start time); NVML reports it by the pid the
// host's /proc gives the process with that namespace, innermost NSpid and start time, and not at all
// once no such process lives (its record is removed: the driver freed its memory).
func TestSimProcsMapRecordsToHostPIDs(t *testing.T) {
	proc, dir := t.TempDir(), t.TempDir()
	fakeProc(t, proc, 5001, 900, "5001\t1", 111)     // a container's init
	fakeProc(t, proc, 5002, 900, "5002\t2", 222)     // its second process
	fakeProc(t, proc, 6001, 901, "6001\t1", 333)     // another container's init
	fakeProc(t, proc, 7001, 902, "7001\t40\t1", 444) // nested: the innermost pid counts
	records := map[string][]byte{
		"900-1-111.proc": simRecord(900, 1, 111, simProcDev{Minor: 0, Ctxs: 1, Used: 100}, simProcDev{Minor: 2, Used: 5}),
		"900-2-222.proc": simRecord(900, 2, 222, simProcDev{Minor: 0, Ctxs: 1}),            // a context holding nothing is listed
		"901-1-999":      simRecord(901, 1, 999, simProcDev{Minor: 0, Ctxs: 1, Used: 300}), // not .proc: not a record
		"901-1-999.proc": simRecord(901, 1, 999, simProcDev{Minor: 0, Ctxs: 1, Used: 300}), // pid 1 of 901 started later: the holder died
		"903-1-555.proc": simRecord(903, 1, 555, simProcDev{Minor: 0, Used: 400}),          // no such namespace any more
		"902-1-444.proc": simRecord(902, 1, 444, simProcDev{Minor: 0, Used: 50}),
		"901-1-333.proc": simRecord(901, 1, 333, simProcDev{Minor: 0}),                // alive, holding nothing: not listed
		"copy.proc":      simRecord(900, 1, 111, simProcDev{Minor: 0, Used: 1 << 40}), // a second record of a live process, misnamed
		"junk.proc":      []byte("not a record"),
	}
	for name, b := range records {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// A link to a valid record of a live process elsewhere is not followed; a FIFO is not waited on.
	fakeProc(t, proc, 6002, 901, "6002\t2", 666)
	outside := filepath.Join(t.TempDir(), "record")
	if err := os.WriteFile(outside, simRecord(901, 2, 666, simProcDev{Minor: 0, Used: 77}), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(dir, "901-2-666.proc")); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(filepath.Join(dir, "901-3-777.proc"), 0o644); err != nil {
		t.Fatal(err)
	}
	p := simProcs{dir: dir, procRoot: proc}
	got, err := p.byMinor()
	if err != nil {
		t.Fatal(err)
	}
	want := map[uint32][]simProcess{
		0: {{hostPID: 5001, start: 111, dev: simProcDev{Minor: 0, Ctxs: 1, Used: 100}}, {hostPID: 5002, start: 222, dev: simProcDev{Minor: 0, Ctxs: 1}},
			{hostPID: 7001, start: 444, dev: simProcDev{Minor: 0, Used: 50}}},
		2: {{hostPID: 5001, start: 111, dev: simProcDev{Minor: 2, Used: 5}}},
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("processes by minor:\n got %v\nwant %v", got, want)
	}
	for name, kept := range map[string]bool{"901-1-999.proc": false, "903-1-555.proc": false, "900-1-111.proc": true, "901-1-333.proc": true,
		"junk.proc": true, "901-1-999": true, "copy.proc": true} {
		if _, err := os.Stat(filepath.Join(dir, name)); (err == nil) != kept {
			t.Errorf("%s: kept=%v, want %v", name, err == nil, kept)
		}
	}
}

// buildFakeDriver builds vcuda/test's fake libcuda and test/image's cudaprobe (make and gcc are
// required: a missing toolchain fails the test).
func buildFakeDriver(t *testing.T) (libDir, probe string) {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	build := t.TempDir()
	libDir = filepath.Join(build, "fake")
	probe = filepath.Join(build, "cudaprobe")
	for _, s := range [][]string{
		{"make", "-s", "-C", filepath.Join(root, "vcuda"), "BUILD=" + build, filepath.Join(libDir, "libcuda.so.1")},
		{"gcc", "-O2", "-Wall", "-Werror", "-o", probe, filepath.Join(root, "test/image/cudaprobe.c"), "-L" + libDir, "-l:libcuda.so.1"},
	} {
		if out, err := exec.Command(s[0], s[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(s, " "), err, out)
		}
	}
	return libDir, probe
}

// probeInPIDNamespace runs cudaprobe with args on the simulated node's fake driver in a PID
// namespace of its own, as a container's process, and returns its host pid and its first line.
func probeInPIDNamespace(t *testing.T, n *Node, libDir, probe string, args ...string) (int, string) {
	t.Helper()
	cmd := exec.Command("unshare", append([]string{"--pid", "--fork", "--kill-child", "--mount-proc", probe}, args...)...)
	cmd.Env = append(os.Environ(), "LD_LIBRARY_PATH="+libDir, "FAKE_GPU_NODE_FILE="+n.SimGPUFile,
		"FAKE_DEV_ROOT="+filepath.Join(n.DevRoot, "dev"), "FAKE_SIM_DRIVER_DIR="+n.SimDriverState)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("unshare (util-linux) is required: %v", err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("cudaprobe %v: %q, %v", args, line, err)
	}
	// unshare forks the namespace's init, which execs cudaprobe: that is the process.
	kids, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", cmd.Process.Pid, cmd.Process.Pid))
	f := strings.Fields(string(kids))
	if err != nil || len(f) != 1 {
		t.Fatalf("children of unshare: %q, %v", kids, err)
	}
	pid, _ := strconv.Atoi(f[0])
	return pid, line
}

// The simulated node's NVML reports a process in a container's PID namespace the way the real driver
// does: by host pid, with what the driver charges it (its context included), until it is killed.
func TestSimNVMLReportsContainerProcessesByHostPID(t *testing.T) {
	b, n := openTestSim(t, "")
	libDir, probe := buildFakeDriver(t)
	const held = 100 << 20
	holder, line := probeInPIDNamespace(t, n, libDir, probe, "hold", strconv.Itoa(held), "600")
	if !strings.HasPrefix(line, fmt.Sprintf("held=%d error=0", held)) {
		t.Fatalf("cudaprobe hold: %q", line)
	}

	// GPU 0 (minor 0, an A100: compute capability 8.0) is the holder's device 0; what a context
	// takes there is the fake driver's own figure, read from its header so the two cannot drift.
	ctxBytes, err := fakedriver.ContextBytes(8)
	if err != nil {
		t.Fatal(err)
	}
	dev, ret := b.NVML().DeviceGetHandleByIndex(0)
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	procs, ret := dev.GetComputeRunningProcesses()
	want := []nvml.ProcessInfo{{Pid: uint32(holder), UsedGpuMemory: ctxBytes + held, GpuInstanceId: 0xFFFFFFFF, ComputeInstanceId: 0xFFFFFFFF}}
	if ret != nvml.SUCCESS || fmt.Sprint(procs) != fmt.Sprint(want) {
		t.Fatalf("GPU 0 processes: %+v (%v), want host pid %d: %+v", procs, ret, holder, want)
	}
	if procs, ret := b.NVML().DeviceGetComputeRunningProcesses(dev); ret != nvml.SUCCESS || len(procs) != 1 {
		t.Errorf("library-level list: %+v (%v)", procs, ret)
	}
	other, _ := b.NVML().DeviceGetHandleByIndex(1)
	for name, list := range map[string]func() ([]nvml.ProcessInfo, nvml.Return){
		"GPU 1 compute": other.GetComputeRunningProcesses, "graphics": dev.GetGraphicsRunningProcesses, "MPS": dev.GetMPSComputeRunningProcesses,
	} {
		if procs, ret := list(); ret != nvml.SUCCESS || len(procs) != 0 {
			t.Errorf("%s: %+v (%v), want none", name, procs, ret)
		}
	}

	// SIGKILL: the driver frees the process's memory; NVML lists it no more.
	if err := syscall.Kill(holder, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// unshare reaps the holder; wait until it is gone (the deadline only bounds a hang).
	for deadline := time.Now().Add(time.Minute); syscall.Kill(holder, 0) == nil && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if procs, ret := dev.GetComputeRunningProcesses(); ret != nvml.SUCCESS || len(procs) != 0 {
		t.Errorf("after SIGKILL: %+v (%v), want none", procs, ret)
	}
	if left, _ := filepath.Glob(filepath.Join(n.SimDriverState, "*.proc")); len(left) != 0 {
		t.Errorf("records of dead processes left: %v", left)
	}
}

// NVML's per-process utilisation on the simulated node: a sample per period of a process that ran
// kernels, its busy share between two successive records, only samples newer than the caller's last seen
// timestamp, NOT_FOUND when none, nothing for an idle process, and a process that is gone forgotten.
func TestSimProcessUtilization(t *testing.T) {
	proc, dir := t.TempDir(), t.TempDir()
	fakeProc(t, proc, 5001, 900, "5001\t1", 111)
	fakeProc(t, proc, 5002, 900, "5002\t2", 222)
	write := func(name string, b []byte) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	const s = uint64(1e9)
	p := &simProcs{dir: dir, procRoot: proc}
	write("900-1-111.proc", simRecordAt(900, 1, 111, 10*s, simProcDev{Minor: 0, Ctxs: 1, Busy: 2 * s}))
	write("900-2-222.proc", simRecordAt(900, 2, 222, 10*s, simProcDev{Minor: 0, Ctxs: 1, Busy: 1 * s}))
	if got, ret := p.processUtilization(0, 0); ret != nvml.ERROR_NOT_FOUND {
		t.Fatalf("one reading each: %+v (%v), want NOT_FOUND (no period to sample yet)", got, ret)
	}
	// 1: 2 s -> 3.5 s busy over 2 s: 75%; 2: did not write again (idle): no sample.
	write("900-1-111.proc", simRecordAt(900, 1, 111, 12*s, simProcDev{Minor: 0, Ctxs: 1, Busy: 3500 * 1e6}))
	got, ret := p.processUtilization(0, 0)
	if ret != nvml.SUCCESS || len(got) != 1 || got[0].Pid != 5001 || got[0].SmUtil != 75 {
		t.Fatalf("after a second record: %+v (%v), want pid 5001 at 75%%", got, ret)
	}
	stamp := got[0].TimeStamp
	if again, ret := p.processUtilization(0, stamp); ret != nvml.ERROR_NOT_FOUND {
		t.Fatalf("asked past the last sample: %+v (%v), want NOT_FOUND", again, ret)
	}
	if again, ret := p.processUtilization(0, stamp-1); ret != nvml.SUCCESS || len(again) != 1 || again[0].TimeStamp != stamp {
		t.Fatalf("the same sample asked again: %+v (%v), want it with the same timestamp", again, ret)
	}
	// A busy count that went backwards (a container rewriting its record) is not a reading; more
	// busy than time is at most 100%.
	write("900-1-111.proc", simRecordAt(900, 1, 111, 13*s, simProcDev{Minor: 0, Ctxs: 1, Busy: 1 * s}))
	if got, _ := p.processUtilization(0, stamp); len(got) != 0 {
		t.Fatalf("busy went backwards: %+v, want no new sample", got)
	}
	write("900-1-111.proc", simRecordAt(900, 1, 111, 14*s, simProcDev{Minor: 0, Ctxs: 1, Busy: 9 * s}))
	if got, _ := p.processUtilization(0, stamp); len(got) != 1 || got[0].SmUtil != 100 {
		t.Fatalf("more busy than time: %+v, want 100%%", got)
	}
	if got, ret := p.processUtilization(1, 0); ret != nvml.ERROR_NOT_FOUND {
		t.Fatalf("another GPU: %+v (%v)", got, ret)
	}
	// The process exits: its record goes and so does what was remembered of it.
	if err := os.RemoveAll(filepath.Join(proc, "5001")); err != nil {
		t.Fatal(err)
	}
	p.processUtilization(0, 0)
	if _, ok := p.busySeen[simBusyKey{0, 5001, 111}]; ok {
		t.Error("a process that is gone is still remembered")
	}
}

// Two callers with their own lastSeen (the compute guard every second, the measured compute
// publisher every 200 ms) interleaved: each sees every period of a process, so the busy time each
// integrates from the samples (SmUtil x the time since the same process's previous sample) is the
// process's real busy time; periods follow each other with no gap and no overlap. Mutation:
// returning only each process's latest sample loses the periods the other caller's calls made, and
// the slower caller's sum falls short.
func TestSimProcessUtilizationTwoCallers(t *testing.T) {
	proc, dir := t.TempDir(), t.TempDir()
	fakeProc(t, proc, 5001, 900, "5001\t1", 111)
	p := &simProcs{dir: dir, procRoot: proc}
	const s = uint64(1e9)
	busy := uint64(0)
	record := func(i uint64) {
		t.Helper()
		b := simRecordAt(900, 1, 111, (10+i)*s, simProcDev{Minor: 0, Ctxs: 1, Busy: busy})
		if err := os.WriteFile(filepath.Join(dir, "900-1-111.proc"), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	record(0)
	p.processUtilization(0, 0) // the first reading: no period yet
	base := uint64(p.wallOffsetUS + int64(10*s/1000))
	type caller struct {
		lastSeen, prev, busyUS uint64
		samples                int
	}
	fast, slow := &caller{prev: base}, &caller{prev: base}
	call := func(c *caller) {
		got, ret := p.processUtilization(0, c.lastSeen)
		if ret != nvml.SUCCESS && ret != nvml.ERROR_NOT_FOUND {
			t.Fatalf("processUtilization: %v", ret)
		}
		sort.Slice(got, func(i, j int) bool { return got[i].TimeStamp < got[j].TimeStamp })
		for _, smp := range got {
			if smp.TimeStamp <= c.prev {
				t.Fatalf("sample %+v not after the previous one (%d)", smp, c.prev)
			}
			c.busyUS += uint64(smp.SmUtil) * (smp.TimeStamp - c.prev) / 100
			c.prev = smp.TimeStamp
			c.lastSeen = max(c.lastSeen, smp.TimeStamp)
			c.samples++
		}
	}
	for i := uint64(1); i <= 30; i++ {
		busy += (i * 7 % 100) * s / 100 // a whole percent of each 1 s period
		record(i)
		call(fast)
		if i%3 == 0 {
			call(slow)
		}
	}
	for _, c := range []*caller{fast, slow} {
		if c.samples != 30 || c.busyUS != busy/1000 {
			t.Errorf("a caller integrated %d us of busy from %d samples, want %d us from 30", c.busyUS, c.samples, busy/1000)
		}
	}
	// The ring is bounded: a caller that never asks gets the newest simUtilSamples only.
	for i := uint64(31); i <= 31+simUtilSamples; i++ {
		busy += s / 2
		record(i)
		p.processUtilization(0, ^uint64(0))
	}
	if got, _ := p.processUtilization(0, 0); len(got) != simUtilSamples {
		t.Errorf("%d samples kept, want the newest %d", len(got), simUtilSamples)
	}
}

// The simulated node's NVML samples a container process's SM utilisation by host pid, from the
// busy time the fake driver's device model gives its kernels: a compute-bound loop reads near 100%,
// and a process that only holds memory has no sample.
func TestSimNVMLSamplesContainerUtilization(t *testing.T) {
	b, n := openTestSim(t, "")
	libDir, probe := buildFakeDriver(t)
	start := func(args ...string) int {
		t.Helper()
		pid, line := probeInPIDNamespace(t, n, libDir, probe, args...)
		if !strings.Contains(line, "error=0") {
			t.Fatalf("cudaprobe %v: %q", args, line)
		}
		return pid
	}
	spinner := start("spin", "600")
	holder := start("hold", strconv.Itoa(64<<20), "600")
	dev, ret := b.NVML().DeviceGetHandleByIndex(0)
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	// Sampled as the agent does: a call per period, each asking for samples newer than the last.
	var last uint64
	var utils []uint32
	for range 5 {
		time.Sleep(300 * time.Millisecond)
		samples, ret := dev.GetProcessUtilization(last)
		if ret != nvml.SUCCESS && ret != nvml.ERROR_NOT_FOUND {
			t.Fatalf("GetProcessUtilization: %v", ret)
		}
		for _, s := range samples {
			last = max(last, s.TimeStamp)
			switch int(s.Pid) {
			case spinner:
				utils = append(utils, s.SmUtil)
			case holder:
				t.Errorf("the process that only holds memory was sampled: %+v", s)
			default:
				t.Errorf("a sample for pid %d, neither the spinner (%d) nor the holder (%d)", s.Pid, spinner, holder)
			}
		}
	}
	// Kernels back to back with a synchronise between: busy all but the launch gaps, once past
	// the first period (which holds the start: context, module load).
	if len(utils) < 3 || slices.Min(utils[1:]) < 80 {
		t.Errorf("spinner's samples %v, want at least 3, each after the first >= 80%%", utils)
	}
}
