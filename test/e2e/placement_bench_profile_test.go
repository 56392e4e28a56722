package e2e

import (
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"k8s.io/client-go/rest"
)

// The placement benchmark's profile: where a live replay's time goes. Each process's CPU time over
// the replay (the machine's cores are the scarce thing), the extender's and the scheduler's own
// latency histograms, and each pod's time from create to the benchmark's watch seeing it bound.

// cpuSeconds is the CPU time (user + system) a process has used so far, from /proc/<pid>/stat; 0
// when it cannot be read (the process exited).
func cpuSeconds(pid int) float64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// The command name (field 2) may hold spaces; the fields after its closing ")" start at 3.
	i := strings.LastIndexByte(string(data), ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(data[i+1:]))
	if len(f) < 13 {
		return 0
	}
	utime, _ := strconv.ParseFloat(f[11], 64) // field 14
	stime, _ := strconv.ParseFloat(f[12], 64) // field 15
	return (utime + stime) / 100              // USER_HZ is 100 on Linux
}

// runQueueSeconds is the time pid's threads (those alive now) spent runnable but waiting for a CPU
// (schedstat's run delay): behind another process, or behind another thread of their own.
func runQueueSeconds(pid int) float64 {
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", pid))
	var ns int64
	for _, task := range tasks {
		data, err := os.ReadFile(task)
		if err != nil {
			continue // the thread ended
		}
		if f := strings.Fields(string(data)); len(f) >= 2 {
			d, _ := strconv.ParseInt(f[1], 10, 64)
			ns += d
		}
	}
	return float64(ns) / 1e9
}

// cpuMeter samples the CPU time of named processes, and their threads' time waiting for a CPU.
type cpuMeter struct {
	names []string
	pids  map[string]int
	start map[string]float64
	queue map[string]float64
	at    time.Time
}

func newCPUMeter(pids map[string]int) *cpuMeter {
	m := &cpuMeter{pids: pids, start: map[string]float64{}, queue: map[string]float64{}, at: time.Now()}
	for name, pid := range pids {
		m.names = append(m.names, name)
		m.start[name] = cpuSeconds(pid)
		m.queue[name] = runQueueSeconds(pid)
	}
	sort.Strings(m.names)
	return m
}

// report is the CPU seconds each process used since the meter started, and in cores over the wall
// time, and how long its threads waited for a CPU meanwhile.
func (m *cpuMeter) report() string {
	wall := time.Since(m.at).Seconds()
	var parts, queued []string
	var total float64
	for _, name := range m.names {
		s := cpuSeconds(m.pids[name]) - m.start[name]
		total += s
		parts = append(parts, fmt.Sprintf("%s %.0fs (%.2f cores)", name, s, s/wall))
		queued = append(queued, fmt.Sprintf("%s %.1fs", name, runQueueSeconds(m.pids[name])-m.queue[name]))
	}
	return fmt.Sprintf("CPU over %.0fs wall: %s; total %.2f cores; runnable threads waiting for a CPU (schedstat run delay, summed over threads): %s",
		wall, strings.Join(parts, ", "), total/wall, strings.Join(queued, ", "))
}

// affinity is each process's Cpus_allowed_list as it is now, over all its threads (a list per
// distinct mask, so a thread that escaped the pinning shows).
func (m *cpuMeter) affinity() string {
	var parts []string
	for _, name := range m.names {
		tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", m.pids[name]))
		seen := map[string]int{}
		var lists []string
		for _, task := range tasks {
			l, err := statusCPUList(task)
			if err != nil {
				continue // the thread ended
			}
			if seen[l] == 0 {
				lists = append(lists, l)
			}
			seen[l]++
		}
		if len(lists) == 0 {
			lists = []string{"unknown"}
		}
		for i, l := range lists {
			lists[i] = fmt.Sprintf("%s (%d threads)", l, seen[l])
		}
		parts = append(parts, name+" "+strings.Join(lists, " + "))
	}
	return strings.Join(parts, ", ")
}

// histStats summarises one histogram (series merged): count, mean, and quantiles interpolated
// within buckets as PromQL's histogram_quantile does (so no finer than the bucket bounds).
type histStats struct {
	count          uint64
	mean, p50, p99 float64
	// over5ms counts the observations above 5 ms where the histogram has a 5 ms bound (the
	// extender's filter p99 goal: a p99 above it means more than 1% of the calls took longer); -1
	// where it has none.
	over5ms int64
}

func (h histStats) String() string {
	s := fmt.Sprintf("n=%d mean=%s p50~%s p99~%s", h.count, ms(h.mean), ms(h.p50), ms(h.p99))
	if h.over5ms >= 0 {
		s += fmt.Sprintf(" over5ms=%d", h.over5ms)
	}
	return s
}

func ms(s float64) string { return fmt.Sprintf("%.1fms", s*1000) }

// fetchMetrics is a Prometheus text endpoint's body.
func fetchMetrics(hc *http.Client, url string) ([]byte, error) {
	resp, err := hc.Get(url)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", url, err)
	}
	return body, nil
}

// scrapeEvaluations reads the extender's node-outcome counters: remembered and evaluated in calls
// (the evaluation memo's hit rate), bounded instead of evaluated (pick-one's score bounds), warmed
// in the background.
func scrapeEvaluations(hc *http.Client, url string) (string, error) {
	body, err := fetchMetrics(hc, url)
	if err != nil {
		return "", err
	}
	counts := map[string]float64{}
	for _, line := range strings.Split(string(body), "\n") {
		var outcome string
		var n float64
		if k, _ := fmt.Sscanf(line, `tessera_extender_node_evaluations_total{outcome=%q} %g`, &outcome, &n); k == 2 {
			counts[outcome] = n
		}
	}
	calls := counts["remembered"] + counts["evaluated"]
	if calls == 0 {
		return "", fmt.Errorf("scrape %s: no tessera_extender_node_evaluations_total", url)
	}
	return fmt.Sprintf("in calls remembered=%.0f evaluated=%.0f (%.1f%% evaluated), bounded instead (pick-one's score bounds)=%.0f; warmed in the background=%.0f",
		counts["remembered"], counts["evaluated"], 100*counts["evaluated"]/calls, counts["bounded"], counts["warmed"]), nil
}

// goRuntimeMetrics are the Go collector's series the profile prints for the extender: GOMAXPROCS
// (sized by its CPU affinity), the garbage collector's target and stop-the-world pauses.
var goRuntimeMetrics = []string{"go_sched_gomaxprocs_threads", "go_gc_gogc_percent", "go_gc_gomemlimit_bytes",
	"go_gc_duration_seconds", "go_memstats_heap_inuse_bytes", "go_threads"}

// scrapeGoRuntime reads goRuntimeMetrics' samples from a Prometheus text endpoint, as name=value
// (with the quantile of a summary).
func scrapeGoRuntime(hc *http.Client, url string) (string, error) {
	body, err := fetchMetrics(hc, url)
	if err != nil {
		return "", err
	}
	var out []string
	for _, line := range strings.Split(string(body), "\n") {
		name, value, ok := strings.Cut(line, " ")
		if !ok || strings.HasPrefix(line, "#") {
			continue
		}
		base, _, _ := strings.Cut(name, "{")
		for _, m := range goRuntimeMetrics {
			if base == m || base == m+"_sum" || base == m+"_count" {
				out = append(out, name+"="+value)
			}
		}
	}
	if len(out) == 0 {
		return "", fmt.Errorf("scrape %s: none of %v", url, goRuntimeMetrics)
	}
	return strings.Join(out, " "), nil
}

// scrapeHistograms reads a Prometheus text endpoint and summarises the histogram name per value of
// the label by (its other labels merged; by may name several labels, comma-separated: the key is
// their values joined by "/").
func scrapeHistograms(hc *http.Client, url, name, by string) (map[string]histStats, error) {
	resp, err := hc.Get(url)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("scrape %s: %s", url, resp.Status)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", url, err)
	}
	fam, ok := fams[name]
	if !ok {
		return nil, fmt.Errorf("scrape %s: no %s", url, name)
	}
	return summariseHistogram(fam, by), nil
}

func summariseHistogram(fam *dto.MetricFamily, by string) map[string]histStats {
	type acc struct {
		count   uint64
		sum     float64
		buckets map[float64]uint64 // cumulative counts by upper bound
	}
	groups := map[string]*acc{}
	for _, m := range fam.GetMetric() {
		h := m.GetHistogram()
		if h == nil {
			continue
		}
		var vals []string
		for _, name := range strings.Split(by, ",") {
			for _, l := range m.GetLabel() {
				if l.GetName() == name {
					vals = append(vals, l.GetValue())
				}
			}
		}
		key := strings.Join(vals, "/")
		a := groups[key]
		if a == nil {
			a = &acc{buckets: map[float64]uint64{}}
			groups[key] = a
		}
		a.count += h.GetSampleCount()
		a.sum += h.GetSampleSum()
		for _, b := range h.GetBucket() {
			a.buckets[b.GetUpperBound()] += b.GetCumulativeCount()
		}
	}
	out := map[string]histStats{}
	for key, a := range groups {
		if a.count == 0 {
			continue
		}
		bounds := make([]float64, 0, len(a.buckets))
		for ub := range a.buckets {
			bounds = append(bounds, ub)
		}
		sort.Float64s(bounds)
		cum := make([]uint64, len(bounds))
		for i, ub := range bounds {
			cum[i] = a.buckets[ub]
		}
		over := int64(-1)
		if at, ok := a.buckets[0.005]; ok {
			over = int64(a.count - at)
		}
		out[key] = histStats{count: a.count, mean: a.sum / float64(a.count),
			p50: bucketQuantile(0.5, bounds, cum, a.count), p99: bucketQuantile(0.99, bounds, cum, a.count), over5ms: over}
	}
	return out
}

// bucketQuantile interpolates the q-quantile linearly inside the bucket it falls in (from 0 for
// the first); past the last finite bound it is that bound.
func bucketQuantile(q float64, bounds []float64, cum []uint64, count uint64) float64 {
	rank := q * float64(count)
	lower, below := 0.0, uint64(0)
	for i, ub := range bounds {
		if float64(cum[i]) >= rank {
			if math.IsInf(ub, 1) {
				return lower
			}
			in := cum[i] - below
			if in == 0 {
				return ub
			}
			return lower + (ub-lower)*(rank-float64(below))/float64(in)
		}
		lower, below = ub, cum[i]
	}
	return lower
}

// formatHists prints histograms by label value in name order.
func formatHists(h map[string]histStats) string {
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %s", k, h[k]))
	}
	return strings.Join(parts, "; ")
}

// schedulerMetricsClient is an HTTP client for kube-scheduler's secure port as the admin (its
// /metrics needs an authorised user; its serving certificate is self-signed).
func schedulerMetricsClient(cp *ControlPlane) (*http.Client, error) {
	rc := rest.CopyConfig(cp.RESTConfig)
	rc.TLSClientConfig.Insecure = true
	rc.TLSClientConfig.CAFile, rc.TLSClientConfig.CAData = "", nil
	rc.Timeout = 10 * time.Second
	hc, err := rest.HTTPClientFor(rc)
	if err != nil {
		return nil, fmt.Errorf("scheduler metrics client: %w", err)
	}
	return hc, nil
}

// durationStats summarises observed durations as histStats (exact quantiles).
func durationStats(d []time.Duration) histStats {
	if len(d) == 0 {
		return histStats{over5ms: -1}
	}
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	var sum time.Duration
	var over int64
	for _, v := range s {
		sum += v
		if v > 5*time.Millisecond {
			over++
		}
	}
	at := func(q float64) float64 { return s[min(len(s)-1, int(q*float64(len(s))))].Seconds() }
	return histStats{count: uint64(len(s)), mean: sum.Seconds() / float64(len(s)), p50: at(0.5), p99: at(0.99), over5ms: over}
}
