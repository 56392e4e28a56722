package memguard

import (
	"bytes"
	"fmt"
	"time"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/fsatomic"
	"github.com/tessera-gpu/tessera/internal/hostproc"
	"github.com/tessera-gpu/tessera/vcuda"
)

// The measured per-context overhead. In a pod vcuda cannot measure what a context takes (NVML
// lists host pids), so it charges a table; the agent can: for a process with a live vcuda slot it
// knows NVML's memory of the process (trusted) and what the slot says the process holds, its
// contexts and what vcuda charged them (written by the tenant). A quiet sample gives
//
//	overhead = (NVML used - (slot used - context charge)) / contexts
//
// Per GPU model the agent publishes the largest sample of the last overheadWindow, bounded by the
// smallest NVML figure of any process listed on a GPU of that model in that window: a listed process
// holds at least one context, so that bound is at least the true overhead, and NVML is not the
// tenant's to write. vcuda charges the larger of its table and the published figure. So a tenant that
// writes its slot can raise the figure (up to that bound: other containers of the model meet their
// polite OOM earlier) but can never make a charge smaller than the table: a context is never
// charged less than the scheduler's smallest share assumes. (A tenant whose own process really is
// small lowers the bound, and so can hold back a correction above the table, never below it.)
const (
	// overheadWindow is how long a sample counts.
	overheadWindow = 10 * time.Minute
	// overheadRewrite is how often the file is rewritten when nothing changed, well inside
	// api.ContextOverheadMaxAge, after which vcuda ignores it.
	overheadRewrite = time.Minute
)

// procKey names one process's view of one GPU across samples.
type procKey struct {
	pid   uint32
	start uint64
	uuid  string
}

// ctxObservation is what one sample saw of a process on a GPU.
type ctxObservation struct {
	nvml, used, charged uint64
	count               uint32
}

// timed is a value and when it was taken.
type timed struct {
	v  uint64
	at time.Time
}

// overheads is the guard's measurement state (guarded by Guard.mu).
type overheads struct {
	prev map[procKey]ctxObservation
	// high and low are, per GPU model and per container, the largest overhead sample and the
	// smallest NVML figure of a listed process in the window.
	high, low map[string]map[string]timed
	// published is the last file's content without its written line, and when it was written.
	published   []byte
	writtenAt   time.Time
	writeFailed bool
}

func newOverheads() *overheads {
	return &overheads{prev: map[procKey]ctxObservation{}, high: map[string]map[string]timed{}, low: map[string]map[string]timed{}}
}

// keep records v for (model, container) in m when it is more extreme than the one kept (by
// better) or the kept one left the window.
func keep(m map[string]map[string]timed, model, container string, v uint64, now time.Time, better func(a, b uint64) bool) {
	byC := m[model]
	if byC == nil {
		byC = map[string]timed{}
		m[model] = byC
	}
	if old, ok := byC[container]; ok && now.Sub(old.at) < overheadWindow && !better(v, old.v) {
		return
	}
	byC[container] = timed{v, now}
}

// measureContexts takes this sample's measurements on one GPU: every attributed process's NVML
// figure bounds the model's overhead from above; a process whose slot in its holder's region names
// it (PID namespace, pid there, start time) and holds contexts on the GPU gives a sample when quiet.
func (g *Guard) measureContexts(o *overheads, next map[procKey]ctxObservation, uuid, model string, s *gpuSample,
	holderOf func(container string) string, region func(holder string) *vcuda.Region, now time.Time) {
	for container, procs := range s.byContainer {
		for _, p := range procs {
			keep(o.low, model, container, p.used, now, func(a, b uint64) bool { return a <= b })
			holder := holderOf(container)
			if holder == "" {
				continue
			}
			r := region(holder)
			if r == nil {
				continue
			}
			obs, ok := slotObservation(g.cfg.HostProc, r, uuid, p)
			if !ok {
				continue
			}
			k := procKey{p.pid, p.start, uuid}
			next[k] = obs
			// Quiet: nothing moved for a whole interval (no allocation, free or context between
			// the samples, NVML's figure settled), so NVML and the slot describe the same state.
			if o.prev[k] != obs {
				continue
			}
			alloc := obs.used - obs.charged // ParseRegion: charged <= used
			if obs.nvml < alloc {
				continue // the slot claims more than the driver counts: no overhead to learn
			}
			v := (obs.nvml - alloc + uint64(obs.count) - 1) / uint64(obs.count)
			keep(o.high, model, container, v, now, func(a, b uint64) bool { return a >= b })
		}
	}
}

// slotObservation finds p's live slot in r and what it says of the GPU: false when there is none,
// the slot is mid-update, the GPU's total is being recomputed, or it records no contexts there.
func slotObservation(hostProc string, r *vcuda.Region, uuid string, p attributed) (ctxObservation, bool) {
	rec := -1
	for i, rg := range r.GPUs {
		if rg.UUID == uuid {
			if rg.Reclaiming {
				return ctxObservation{}, false
			}
			rec = i
		}
	}
	if rec < 0 {
		return ctxObservation{}, false
	}
	id, err := hostproc.IdentityOf(hostProc, p.pid)
	if err != nil || id.Start != p.start {
		return ctxObservation{}, false
	}
	for _, sl := range r.Processes {
		if !sl.Live || sl.Inflight != 0 || sl.PIDNS != id.PIDNS || uint64(sl.PID) != id.NSPID || sl.StartTime != id.Start {
			continue
		}
		for _, c := range sl.Contexts {
			if c.GPU == rec {
				return ctxObservation{nvml: p.used, used: sl.Used[rec], charged: c.Charged, count: c.Count}, true
			}
		}
	}
	return ctxObservation{}, false
}

// prune drops what left the window.
func prune(m map[string]map[string]timed, now time.Time) {
	for model, byC := range m {
		for c, t := range byC {
			if now.Sub(t.at) >= overheadWindow {
				delete(byC, c)
			}
		}
		if len(byC) == 0 {
			delete(m, model)
		}
	}
}

// publishable is, per GPU model, the overhead to publish: the largest sample in the window, bounded
// by the smallest NVML figure in it; a model without both has none.
func (o *overheads) publishable(now time.Time) map[string]uint64 {
	prune(o.high, now)
	prune(o.low, now)
	out := map[string]uint64{}
	for model, byC := range o.high {
		lows, ok := o.low[model]
		if !ok {
			continue
		}
		var high uint64
		for _, t := range byC {
			high = max(high, t.v)
		}
		low := uint64(api.ContextOverheadMaxBytes)
		for _, t := range lows {
			low = min(low, t.v)
		}
		if v := min(high, low); v > 0 {
			out[model] = v
		}
	}
	return out
}

// publishOverheads exports the figures and writes the file for vcuda: each inventory GPU of a
// measured model with its model's figure. Rewritten when it changes, and every overheadRewrite so
// that vcuda knows the agent is measuring.
func (g *Guard) publishOverheads(o *overheads, now time.Time, snap *snapshot) {
	byModel := o.publishable(now)
	byUUID := map[string]int64{}
	for uuid, gp := range snap.gpus {
		if v, ok := byModel[gp.Model]; ok {
			byUUID[uuid] = int64(v)
			snap.overhead = append(snap.overhead, gpuValue{uuid, float64(v)})
		}
	}
	if g.cfg.ContextOverheadFile == "" {
		return
	}
	body, err := api.EncodeContextOverheads(time.Unix(0, 0), byUUID)
	if err == nil && bytes.Equal(body, o.published) && now.Sub(o.writtenAt) < overheadRewrite {
		return
	}
	var data []byte
	if err == nil {
		data, err = api.EncodeContextOverheads(now, byUUID)
	}
	if err == nil {
		err = fsatomic.WriteFile(g.cfg.ContextOverheadFile, data, 0o644)
	}
	if err != nil {
		if !o.writeFailed {
			g.cfg.Log.Error("memory guard: cannot publish the measured context overhead; vcuda charges its table", "path", g.cfg.ContextOverheadFile, "err", fmt.Errorf("write: %w", err))
		}
		o.writeFailed = true
		return
	}
	o.writeFailed = false
	o.published, o.writtenAt = body, now
}
