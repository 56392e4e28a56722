package memguard

import (
	"context"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"golang.org/x/sys/unix"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/fsatomic"
	"github.com/tessera-gpu/tessera/internal/hostproc"
)

// The measured compute publisher: vcuda's compute limiter prices launches from samples it takes in
// the process, which on a GPU time-slicing between processes also time the co-tenants' slices. The
// driver on the host knows each process's own kernel time (NVML's per-process SM utilisation), so
// every FeedbackConfig.Interval the agent integrates it per process (SmUtil x the time since the same
// process's previous sample) and writes, per share, the measured compute file
// (api.ComputeMeasured) into the directory the NRI plugin mounts read-only into the share's
// containers: a reference vcuda's closed loop corrects itself by, which the container cannot write.
// It reads NVML with a lastSeen of its own per GPU (the compute guard keeps its own) and attributes
// host pids with the memory guard's last sample (re-walking cgroups five times a second would cost
// more than the samples are worth): a process the guard has not attributed yet is absent, and one
// whose start time no longer matches (its pid reused since) is not counted. It fails closed and
// quietly: no sample, no new line; a file it cannot write keeps its old content.

// FeedbackConfig configures the measured compute publisher (nil in Config: off).
type FeedbackConfig struct {
	// Interval is the time between publications.
	Interval time.Duration
	// File is where a share's measured compute file goes (nri.Plugin.MeasuredComputeFile), by its
	// holder (a container, or a shared claim's ledger ID). A file whose directory does not exist is
	// not written: the NRI plugin creates it with the share's vcuda files and removes it with them.
	File func(holder string) (string, error)
}

// feedOwner is the share a host process was attributed to by the guard's last sample.
type feedOwner struct {
	holder, container string
	start             uint64
}

// feedKey is one process on one GPU: host pid and start time (a pid may be reused).
type feedKey struct {
	uuid  string
	pid   uint32
	start uint64
}

// feedProc is what is integrated of a process on a GPU.
type feedProc struct {
	holder, container string
	nspid             uint64
	// prevTS is the NVML timestamp (wall-clock us) of its latest sample counted; busy the ns
	// counted so far, at the CLOCK_MONOTONIC ns its newest period ended.
	prevTS, busy, at uint64
}

// feedState is the publisher's memory between rounds.
type feedState struct {
	mu sync.Mutex
	// attrib is, per GPU, the guard's last attribution of host pids to shares (replaced whole by
	// each sample of the guard whose process list answered; read under Guard.mu).
	attrib map[string]map[uint32]feedOwner
	// holders are the shares of the guard's last sample.
	holders map[string]bool

	lastSeen map[string]uint64 // per GPU: the newest NVML timestamp taken by the publisher
	procs    map[feedKey]*feedProc
	written  map[string][]api.ComputeMeasuredLine // per holder: the lines last written
	failing  map[string]bool                      // GPUs whose utilisation NVML cannot give (logged once)
	writeBad map[string]bool                      // holders whose last write failed (logged once)
	// clock is the host's wall clock and CLOCK_MONOTONIC, ns (tests: fixed).
	clock func() (wall, mono int64)
}

func newFeedState() *feedState {
	return &feedState{lastSeen: map[string]uint64{}, procs: map[feedKey]*feedProc{}, written: map[string][]api.ComputeMeasuredLine{},
		failing: map[string]bool{}, writeBad: map[string]bool{}, clock: hostClocks}
}

func hostClocks() (wall, mono int64) {
	var w, m unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &m)
	_ = unix.ClockGettime(unix.CLOCK_REALTIME, &w)
	return w.Nano(), m.Nano()
}

// monoOffset is wall - CLOCK_MONOTONIC in ns, measured around one wall-clock read so the error is
// the read's own duration, not a scheduler's preemption between two unrelated calls.
func (fs *feedState) monoOffset() int64 {
	_, m1 := fs.clock()
	w, m2 := fs.clock()
	return w - (m1+m2)/2
}

// rememberAttribution keeps the guard's sample's attribution for the publisher (called by Sample
// with g.mu held). A GPU whose process list did not answer keeps its previous attribution, so a
// failed sample does not restart every process's busy count.
func (g *Guard) rememberAttribution(units map[capKey]*capUnit, of map[[2]string]capKey, samples map[string]*gpuSample) {
	fs := g.feed
	next := map[string]map[uint32]feedOwner{}
	holders := map[string]bool{}
	for k, u := range units {
		holders[k.holder] = true
		s := samples[k.uuid]
		if !s.ok {
			if prev, ok := fs.attrib[k.uuid]; ok {
				next[k.uuid] = prev
			}
			continue
		}
		if next[k.uuid] == nil {
			next[k.uuid] = map[uint32]feedOwner{}
		}
		for _, m := range u.members {
			if of[[2]string{m, k.uuid}] != k {
				continue
			}
			for _, p := range s.byContainer[m] {
				next[k.uuid][p.pid] = feedOwner{holder: k.holder, container: m, start: p.start}
			}
		}
	}
	fs.attrib, fs.holders = next, holders
}

// RunFeedback publishes the measured compute every FeedbackConfig.Interval until ctx ends (the
// guard's Run must be running: it attributes the processes).
func (g *Guard) RunFeedback(ctx context.Context) error {
	if g.cfg.Feedback == nil {
		return nil
	}
	return g.every(ctx, g.cfg.Feedback.Interval, g.publishMeasured)
}

// publishMeasured is one round: read every shared GPU's new samples, integrate them, write each
// share's file whose lines changed.
func (g *Guard) publishMeasured() {
	fs := g.feed
	g.mu.Lock()
	attrib, holders := fs.attrib, fs.holders
	g.mu.Unlock()
	fs.mu.Lock()
	defer fs.mu.Unlock()
	for _, uuid := range slices.Sorted(maps.Keys(attrib)) {
		g.integrate(uuid, attrib[uuid])
	}
	// Forget what the guard no longer attributes (gone, or its pid now another process's).
	for k, p := range fs.procs {
		if o, ok := attrib[k.uuid][k.pid]; !ok || o.start != k.start || o.holder != p.holder {
			delete(fs.procs, k)
		}
	}
	byHolder := map[string][]api.ComputeMeasuredLine{}
	for k, p := range fs.procs {
		byHolder[p.holder] = append(byHolder[p.holder], api.ComputeMeasuredLine{UUID: canonicalUUID(k.uuid), PID: p.nspid, Start: k.start, Busy: p.busy, At: p.at})
	}
	for _, h := range slices.Sorted(maps.Keys(holders)) {
		g.writeMeasured(h, ownLines(byHolder[h]))
	}
	for h := range fs.written {
		if !holders[h] {
			delete(fs.written, h)
			delete(fs.writeBad, h)
		}
	}
}

// integrate adds a GPU's samples newer than the publisher's lastSeen to its processes' busy time.
func (g *Guard) integrate(uuid string, owners map[uint32]feedOwner) {
	fs := g.feed
	dev, ret := g.cfg.NVML.DeviceGetHandleByUUID(uuid)
	var samples []nvml.ProcessUtilizationSample
	if ret == nvml.SUCCESS {
		samples, ret = getProcessUtilization(dev, fs.lastSeen[uuid])
	}
	offset := fs.monoOffset()
	switch ret {
	case nvml.SUCCESS, nvml.ERROR_NOT_FOUND:
		if fs.failing[uuid] {
			g.cfg.Log.Info("compute feedback: NVML gives per-process utilisation again", "uuid", uuid)
			delete(fs.failing, uuid)
		}
	default:
		if !fs.failing[uuid] {
			g.cfg.Log.Warn("compute feedback: cannot read per-process utilisation; the GPU's shares get no new measured compute (vcuda runs on its own samples)", "uuid", uuid, "err", nvml.ErrorString(ret))
		}
		fs.failing[uuid] = true
		return
	}
	// Each process's samples in time order, so every period runs from its previous sample.
	sort.SliceStable(samples, func(i, j int) bool { return samples[i].TimeStamp < samples[j].TimeStamp })
	last := fs.lastSeen[uuid]
	starts := map[uint32]uint64{}
	for _, s := range samples {
		if s.TimeStamp <= last {
			continue // not newer than asked for: a driver's repeat, counted once
		}
		fs.lastSeen[uuid] = max(fs.lastSeen[uuid], s.TimeStamp)
		o, ok := owners[s.Pid]
		if !ok {
			continue // not a share's process (or not attributed yet)
		}
		start, seen := starts[s.Pid]
		if !seen {
			var err error
			if start, err = hostproc.Start(g.cfg.HostProc, s.Pid); err != nil {
				start = 0 // gone: counts for nobody
			}
			starts[s.Pid] = start
		}
		if start != o.start {
			continue // the pid is another process's since the guard attributed it
		}
		at := uint64(max(0, int64(s.TimeStamp)*1000-offset))
		k := feedKey{uuid, s.Pid, start}
		p := fs.procs[k]
		if p == nil {
			nspid, err := g.nspidOf(s.Pid, start)
			if err != nil {
				continue
			}
			// The first sample is the baseline: the period it ends began before the process was seen.
			fs.procs[k] = &feedProc{holder: o.holder, container: o.container, nspid: nspid, prevTS: s.TimeStamp, at: at}
			continue
		}
		if s.TimeStamp <= p.prevTS {
			continue
		}
		p.busy += PeriodBusyNs(s.SmUtil, s.TimeStamp-p.prevTS)
		p.prevTS = s.TimeStamp
		p.at = max(p.at, at)
	}
}

// nspidOf is host pid's pid in its own PID namespace, checked to be the process started at start.
func (g *Guard) nspidOf(pid uint32, start uint64) (uint64, error) {
	status, err := hostproc.ReadFile(g.cfg.HostProc, pid, "status")
	if err != nil {
		return 0, err
	}
	nspid, err := hostproc.NSpid(status)
	if err != nil {
		return 0, err
	}
	if again, err := hostproc.Start(g.cfg.HostProc, pid); err != nil || again != start {
		return 0, errors.New("the process changed while read")
	}
	return nspid, nil
}

// ownLines are a share's lines in a fixed order, without any (pid, start) two of its containers
// both claim: a shared claim's containers may be in different PID namespaces, and a process must
// never read another's figure as its own.
func ownLines(lines []api.ComputeMeasuredLine) []api.ComputeMeasuredLine {
	sort.Slice(lines, func(i, j int) bool {
		a, b := lines[i], lines[j]
		if a.UUID != b.UUID {
			return a.UUID < b.UUID
		}
		if a.PID != b.PID {
			return a.PID < b.PID
		}
		return a.Start < b.Start
	})
	out := lines[:0:0]
	for i := 0; i < len(lines); {
		j := i + 1
		for j < len(lines) && lines[j].UUID == lines[i].UUID && lines[j].PID == lines[i].PID && lines[j].Start == lines[i].Start {
			j++
		}
		if j == i+1 {
			out = append(out, lines[i])
		}
		i = j
	}
	return out
}

// writeMeasured writes a share's file when its lines changed, into the directory the NRI plugin
// made (none: nothing to do).
func (g *Guard) writeMeasured(holder string, lines []api.ComputeMeasuredLine) {
	fs := g.feed
	if prev, ok := fs.written[holder]; ok && slices.Equal(prev, lines) {
		return
	}
	path, err := g.cfg.Feedback.File(holder)
	if err != nil {
		return // a holder that names no directory has no vcuda files
	}
	if st, err := os.Stat(filepath.Dir(path)); err != nil || !st.IsDir() {
		return // not a vcuda share (whole GPU, Kata) or gone: the plugin owns the directory
	}
	_, mono := fs.clock()
	data, err := api.EncodeComputeMeasured(&api.ComputeMeasured{Written: uint64(max(0, mono)), Lines: lines})
	if err == nil {
		err = fsatomic.WriteFile(path, data, 0o644)
	}
	if err != nil {
		g.metrics.feedbackWriteErrors.Inc()
		if !fs.writeBad[holder] {
			g.cfg.Log.Error("compute feedback: cannot write the measured compute file; the share's vcuda keeps the last one it read", "holder", holder, "path", path, "err", err)
		}
		fs.writeBad[holder] = true
		return
	}
	g.metrics.feedbackWrites.Inc()
	delete(fs.writeBad, holder)
	fs.written[holder] = lines
}

// canonicalUUID is a GPU UUID with lowercase hex, as the file writes it.
func canonicalUUID(uuid string) string {
	if rest, ok := strings.CutPrefix(uuid, "GPU-"); ok {
		return "GPU-" + strings.ToLower(rest)
	}
	return uuid
}

// PeriodBusyNs is the ns a process's kernels ran in a sample period of us microseconds at util
// percent. NVML reports whole percents; a driver that truncates reads a process up to a point low,
// which vcuda would turn into a grant that much over the share (5% of a 10% cap). Half a point is
// the unbiased reading of a truncated figure; where a driver rounds instead it errs the safe way
// (the container is charged half a point more). 0 and 100 are exact: no process runs more than the
// whole period, and a process with no kernels in the period (a driver that samples idle processes
// at 0) gains nothing.
func PeriodBusyNs(util uint32, us uint64) uint64 {
	tenths := uint64(min(util, 100)) * 10
	if util > 0 && util < 100 {
		tenths += 5
	}
	return tenths * us // util/100 of us microseconds, in ns: util x us x 10
}
