package memguard

import (
	"fmt"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	corev1 "k8s.io/api/core/v1"
)

// The compute guard: vcuda holds a share to its compute cap from inside the container, with state
// the container can write (its limiter's credit lives in the accounting region), so a tenant can lift
// its own cap. What decides here is NVML's per-process SM utilisation read on the host (the share of
// time at least one of the process's kernels ran, sampled by the driver), summed over the share's
// processes, averaged over a window, and compared with the ledger's cap: a share whose average stays
// over cap + tolerance for the grace is killed (or, with action Event, reported). It runs in the
// memory guard's samples, on the same attribution of processes to containers.

// ReasonComputeCapExceeded is the Event reason of a share over its compute cap.
const ReasonComputeCapExceeded = "GPUComputeCapExceeded"

// ComputeConfig configures the compute guard (nil in Config: off).
type ComputeConfig struct {
	// Window is the span the measured utilisation is averaged over; Grace how long the average
	// must stay over cap + TolerancePercent points before the action.
	Window, Grace    time.Duration
	TolerancePercent int64
	// Kill kills the share's GPU processes; false: a Warning Event and the metric only.
	Kill bool
}

// utilPoint is a share's measured utilisation (percent of the GPU) at one sample.
type utilPoint struct {
	at   time.Time
	util float64
}

// computeState is what the compute guard remembers between samples.
type computeState struct {
	// lastSeen is, per GPU, the newest NVML sample timestamp taken (NVML returns only newer ones).
	lastSeen map[string]uint64
	// points are each cap's measurements within the window; first when each was first measured.
	points map[capKey][]utilPoint
	first  map[capKey]time.Time
	// over is when each cap's windowed average was first over its limit in the current run.
	over map[capKey]time.Time
	// told are the caps reported by an Event in the current run over (action Event).
	told map[capKey]bool
	// unsupported are the GPUs whose driver cannot sample per-process utilisation (logged once).
	unsupported map[string]bool
}

func newComputeState() *computeState {
	return &computeState{lastSeen: map[string]uint64{}, points: map[capKey][]utilPoint{}, first: map[capKey]time.Time{},
		over: map[capKey]time.Time{}, told: map[capKey]bool{}, unsupported: map[string]bool{}}
}

// forget drops what is remembered of a cap (gone, or its data missing).
func (c *computeState) forget(k capKey) {
	delete(c.points, k)
	delete(c.first, k)
	delete(c.over, k)
	delete(c.told, k)
}

// processUtilization is each process's SM utilisation on a GPU (percent, the mean of the samples
// NVML has taken since the last call), by host pid; nil when the driver cannot say: nothing is judged
// on such a sample. A GPU without new samples had no process running kernels (an empty map).
func (g *Guard) processUtilization(uuid string) map[uint32]float64 {
	cs := g.compute
	dev, ret := g.cfg.NVML.DeviceGetHandleByUUID(uuid)
	if ret != nvml.SUCCESS {
		return nil
	}
	samples, ret := getProcessUtilization(dev, cs.lastSeen[uuid])
	switch ret {
	case nvml.SUCCESS:
	case nvml.ERROR_NOT_FOUND:
		return map[uint32]float64{}
	case nvml.ERROR_NOT_SUPPORTED, nvml.ERROR_FUNCTION_NOT_FOUND:
		if !cs.unsupported[uuid] {
			g.cfg.Log.Error("compute guard: the driver cannot sample per-process utilisation on this GPU; its shares' compute caps rest on vcuda alone", "uuid", uuid, "err", nvml.ErrorString(ret))
		}
		cs.unsupported[uuid] = true
		g.metrics.utilErrors.WithLabelValues(uuid).Inc()
		return nil
	default:
		g.metrics.utilErrors.WithLabelValues(uuid).Inc()
		g.cfg.Log.Warn("compute guard: cannot read per-process utilisation", "uuid", uuid, "err", nvml.ErrorString(ret))
		return nil
	}
	delete(cs.unsupported, uuid)
	sum, n := map[uint32]float64{}, map[uint32]float64{}
	for _, s := range samples {
		if s.TimeStamp <= cs.lastSeen[uuid] {
			continue // not newer than asked for: a driver's repeat, counted once
		}
		sum[s.Pid] += float64(min(s.SmUtil, 100))
		n[s.Pid]++
	}
	for _, s := range samples {
		cs.lastSeen[uuid] = max(cs.lastSeen[uuid], s.TimeStamp)
	}
	out := make(map[uint32]float64, len(sum))
	for pid, v := range sum {
		out[pid] = v / n[pid]
	}
	return out
}

// getProcessUtilization calls NVML, reading a mock's panic on a method it lacks as the real
// driver's ERROR_FUNCTION_NOT_FOUND (as listProcesses does).
func getProcessUtilization(dev nvml.Device, lastSeen uint64) (samples []nvml.ProcessUtilizationSample, ret nvml.Return) {
	defer func() {
		if recover() != nil {
			samples, ret = nil, nvml.ERROR_FUNCTION_NOT_FOUND
		}
	}()
	return dev.GetProcessUtilization(lastSeen)
}

// checkCompute measures every compute cap in this sample and acts on those over it for the grace.
func (g *Guard) checkCompute(now time.Time, units map[capKey]*capUnit, of map[[2]string]capKey, samples map[string]*gpuSample, snap *snapshot) {
	cfg, cs := g.cfg.Compute, g.compute
	utils := map[string]map[uint32]float64{}
	measuredNow := map[capKey]bool{}
	for _, k := range sortedCaps(units, func(u *capUnit) bool { return u.cores > 0 && u.cores < 100 }) {
		u, s := units[k], samples[k.uuid]
		per, seen := utils[k.uuid]
		if !seen { // one NVML call per GPU and sample, however many caps share it
			if s.ok {
				per = g.processUtilization(k.uuid)
			}
			utils[k.uuid] = per
		}
		if per == nil {
			cs.forget(k) // missing data never counts towards the grace
			continue
		}
		var util float64
		for _, m := range u.members {
			if of[[2]string{m, k.uuid}] != k {
				continue
			}
			for _, p := range s.byContainer[m] {
				util += per[p.pid]
			}
		}
		measuredNow[k] = true
		pts := append(cs.points[k], utilPoint{now, util})
		for len(pts) > 0 && now.Sub(pts[0].at) >= cfg.Window { // the window's span, not one sample more
			pts = pts[1:]
		}
		cs.points[k] = pts
		if _, ok := cs.first[k]; !ok {
			cs.first[k] = now
		}
		var sum float64
		for _, p := range pts {
			sum += p.util
		}
		avg := sum / float64(len(pts))
		snap.smUtil = append(snap.smUtil, containerValue{&u.holder, k.uuid, avg})
		limit := float64(u.cores + cfg.TolerancePercent)
		if now.Sub(cs.first[k]) < cfg.Window || avg <= limit {
			// A window not yet full is not evidence; under the limit ends a run over it.
			delete(cs.over, k)
			delete(cs.told, k)
			continue
		}
		since, ok := cs.over[k]
		if !ok {
			cs.over[k], since = now, now
		}
		if now.Sub(since) < cfg.Grace {
			continue
		}
		if cfg.Kill {
			delete(cs.over, k)
			g.enforceCompute(u, avg, s, of, now.Sub(since))
			cs.forget(k) // a fresh window for whatever runs next
		} else if !cs.told[k] {
			cs.told[k] = true
			g.reportCompute(u, avg, now.Sub(since))
		}
	}
	for k := range cs.points {
		if !measuredNow[k] {
			cs.forget(k)
		}
	}
}

// enforceCompute kills the GPU processes of a compute cap's containers and reports it.
func (g *Guard) enforceCompute(u *capUnit, avg float64, s *gpuSample, of map[[2]string]capKey, over time.Duration) {
	cfg := g.cfg.Compute
	for _, k := range g.killMembers(u, s, of, "GPU compute cap") {
		g.metrics.computeViolations.WithLabelValues("Kill").Inc()
		e := g.entryOf(u, k.id)
		g.cfg.Log.Warn("compute guard: SM utilisation over the cap; the container's GPU processes were killed", "namespace", e.Namespace, "pod", e.Pod,
			"container", e.Container, "containerID", k.id, "uuid", u.uuid, "utilPercent", avg, "capPercent", u.cores, "tolerancePercent", cfg.TolerancePercent, "over", over, "pids", k.pids)
		if g.cfg.Events != nil {
			g.cfg.Events.Eventf(podRef(e), corev1.EventTypeWarning, ReasonComputeCapExceeded,
				"container %q ran kernels %.0f%% of the time on GPU %s (averaged over %s, as NVML measures it per process), over its compute cap of %d%%%s (tolerance %d points) for %s; the Tessera node agent killed its GPU processes %v",
				e.Container, avg, g.gpuName(u.uuid), cfg.Window, u.cores, sharedBy(u), cfg.TolerancePercent, over, k.pids)
		}
	}
}

// reportCompute reports a share over its compute cap without acting (action Event).
func (g *Guard) reportCompute(u *capUnit, avg float64, over time.Duration) {
	cfg := g.cfg.Compute
	g.metrics.computeViolations.WithLabelValues("Event").Inc()
	e := &u.holder
	g.cfg.Log.Warn("compute guard: SM utilisation over the cap (action Event: nothing killed)", "namespace", e.Namespace, "pod", e.Pod,
		"container", e.Container, "holder", e.ContainerID, "uuid", u.uuid, "utilPercent", avg, "capPercent", u.cores, "tolerancePercent", cfg.TolerancePercent, "over", over)
	if g.cfg.Events != nil {
		g.cfg.Events.Eventf(podRef(e), corev1.EventTypeWarning, ReasonComputeCapExceeded,
			"container %q ran kernels %.0f%% of the time on GPU %s (averaged over %s, as NVML measures it per process), over its compute cap of %d%%%s (tolerance %d points) for %s; %s",
			e.Container, avg, g.gpuName(u.uuid), cfg.Window, u.cores, sharedBy(u), cfg.TolerancePercent, over,
			fmt.Sprintf("the node agent's computeGuard.action is %s, so nothing was killed", "Event"))
	}
}
