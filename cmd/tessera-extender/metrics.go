package main

import (
	"io"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tessera-gpu/tessera/internal/extender"
	"github.com/tessera-gpu/tessera/internal/placement"
	"github.com/tessera-gpu/tessera/internal/telemetry"
)

// extenderMetrics time the scheduler's calls by verb and result, and each call's phases.
type extenderMetrics struct {
	requests *prometheus.HistogramVec
	phases   *prometheus.HistogramVec
}

// requestBuckets are the extender's request and phase buckets, in seconds: finer than
// telemetry.LatencyBuckets between 0.5 and 25 ms, where filter calls at thousands of nodes fall and
// the 5 ms goal lies (quantiles are interpolated within a bucket, so 2.5-5-10 ms bounds made a p99
// of 6 ms and one of 9.8 ms hard to tell apart).
var requestBuckets = []float64{0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.006,
	0.0075, 0.01, 0.015, 0.02, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}

// The phases of a verb call (tessera_extender_request_phase_seconds).
const (
	phaseRead   = "read"   // from the handler's start to the request body read in full
	phaseDecode = "decode" // the body decoded
	phaseServe  = "serve"  // the reply computed (passed on to the leader on a replica that does not lead)
	phaseReply  = "reply"  // the reply encoded and written, the call's memory given back
)

// evaluations reports the extender's node outcomes taken from its memo and evaluated afresh
// (extender.Extender.Evaluations), bounded the nodes pick-one Filter bounded instead
// (extender.Extender.Bounded), warmed those its warmer evaluated (extender.Extender.Warmed).
func newExtenderMetrics(reg prometheus.Registerer, leader *atomic.Bool, leaderElect bool, evaluations func() (remembered, evaluated int64), bounded, warmed func() int64) *extenderMetrics {
	m := &extenderMetrics{requests: prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "tessera_extender_request_duration_seconds", Buckets: requestBuckets,
		Help: "Time the extender took to answer kube-scheduler, by verb (filter, prioritize, bind) and result: ok, " +
			"unschedulable (filter: no node fits) or error.",
	}, []string{"verb", "result"}),
		phases: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "tessera_extender_request_phase_seconds", Buckets: requestBuckets,
			Help: "Where tessera_extender_request_duration_seconds went, by verb and phase: read (waiting for " +
				"kube-scheduler to send the request's body; a filter call names every node), decode, serve (the " +
				"placement work, or passing the call on to the leader) and reply (encoding and writing the answer).",
		}, []string{"verb", "phase"})}
	evalHelp := "Node evaluations of filter and prioritize, by outcome: remembered (the node and the pod's request " +
		"shape unchanged since the last evaluation under the same typical-shape snapshot) or evaluated in the call; " +
		"bounded counts the nodes --filter-pick-one bounded in the call instead (evaluated only where the bound reaches " +
		"the best score); warmed counts the evaluations made in the background for nodes that changed (--warm-memo)."
	reg.MustRegister(
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "tessera_extender_node_evaluations_total", Help: evalHelp,
			ConstLabels: prometheus.Labels{"outcome": "remembered"}}, func() float64 { r, _ := evaluations(); return float64(r) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "tessera_extender_node_evaluations_total", Help: evalHelp,
			ConstLabels: prometheus.Labels{"outcome": "evaluated"}}, func() float64 { _, e := evaluations(); return float64(e) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "tessera_extender_node_evaluations_total", Help: evalHelp,
			ConstLabels: prometheus.Labels{"outcome": "bounded"}}, func() float64 { return float64(bounded()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "tessera_extender_node_evaluations_total", Help: evalHelp,
			ConstLabels: prometheus.Labels{"outcome": "warmed"}}, func() float64 { return float64(warmed()) }))
	reg.MustRegister(m.requests, m.phases, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "tessera_extender_leader",
		Help: "1 while this replica holds the leader Lease and binds (always 1 without leader election).",
	}, func() float64 {
		if !leaderElect || leader.Load() {
			return 1
		}
		return 0
	}))
	return m
}

// registerStateMetrics exports the extender state's anomalies: conflicts (a GPU counted with two
// holders, which should stay 0) and reservations that expired without a bind outcome.
func registerStateMetrics(reg prometheus.Registerer, conflicts, expired func() int64) {
	reg.MustRegister(
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "tessera_extender_state_conflicts_total",
			Help: "Pods the extender's state applied on a GPU another pod already held (two holders of one GPU; should stay 0, each is logged)."},
			func() float64 { return float64(conflicts()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "tessera_extender_reservations_expired_total",
			Help: "Pods whose in-flight reservation (a filter's or bind's decision) expired before the extender saw the bind land or fail."},
			func() float64 { return float64(expired()) }))
}

// pressureCollector reports, per GPU model, the free GPU compute the extender's state counts and
// the model pressure placement adds for compute taken there (placement/pressure.go): why
// unrestricted pods keep off a model that pods restricted to it crowd; and whether tessera counts
// the cluster host-bound (policy_tessera.go: shares are then scored with the stranded floor).
type pressureCollector struct {
	shapes                *placement.ShapeStats
	free, coef, hostBound *prometheus.Desc
}

func newPressureCollector(shapes *placement.ShapeStats) *pressureCollector {
	return &pressureCollector{shapes: shapes,
		free: prometheus.NewDesc("tessera_extender_free_gpus", "Free GPU compute by GPU model, in GPUs, as the extender's state counts it "+
			"(the model pressure's input).", []string{"model"}, nil),
		coef: prometheus.NewDesc("tessera_extender_model_pressure", "The model pressure's coefficient by GPU model in the serving "+
			"typical-shape snapshot: tessera's gain per per-mille of compute taken there (0 where pods restricted to the model need "+
			"all its free compute; none while no pod is restricted to models).", []string{"model"}, nil),
		hostBound: prometheus.NewDesc("tessera_extender_host_bound", "1 when the cluster has less CPU or memory per GPU than "+
			"its typical pods ask, CPU-only pods included (it runs out of them before its GPUs): tessera then scores every placement "+
			"with the two-sided floor (free GPU compute against what the free CPU and memory feed, apart either way).", nil, nil)}
}

func (c *pressureCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.free
	ch <- c.coef
	ch <- c.hostBound
}

func (c *pressureCollector) Collect(ch chan<- prometheus.Metric) {
	for model, milli := range c.shapes.FreeCompute() {
		ch <- prometheus.MustNewConstMetric(c.free, prometheus.GaugeValue, float64(milli)/placement.MilliPerGPU, model)
	}
	for model, v := range c.shapes.Pressure() {
		ch <- prometheus.MustNewConstMetric(c.coef, prometheus.GaugeValue, v, model)
	}
	bound := 0.0
	if c.shapes.HostBound() {
		bound = 1
	}
	ch <- prometheus.MustNewConstMetric(c.hostBound, prometheus.GaugeValue, bound)
}

// verbs are the extender API's paths, by the verb label they get.
var verbs = map[string]string{"/filter": "filter", "/prioritize": "prioritize", "/bind": "bind"}

// instrument times each verb call and its phases; the result comes from the handler
// (extender.CallObserver), or from the HTTP status where it answered with an error, so the
// extender's handlers stay free of metrics code and no reply is read back.
func (m *extenderMetrics) instrument(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		verb, ok := verbs[r.URL.Path]
		if !ok || r.Method != http.MethodPost {
			next.ServeHTTP(w, r)
			return
		}
		start := time.Now()
		body := &timedBody{ReadCloser: r.Body}
		r.Body = body
		rec := &recorder{ResponseWriter: w, status: http.StatusOK}
		next.ServeHTTP(rec, r)
		end := time.Now()
		result := rec.result
		switch {
		case rec.status >= http.StatusBadRequest:
			result = telemetry.ResultError
		case result == "":
			result = telemetry.ResultOK
		}
		m.requests.WithLabelValues(verb, result).Observe(end.Sub(start).Seconds())
		if body.end.IsZero() {
			return
		}
		m.phases.WithLabelValues(verb, phaseRead).Observe(body.end.Sub(start).Seconds())
		if rec.decoded.IsZero() {
			return
		}
		m.phases.WithLabelValues(verb, phaseDecode).Observe(rec.decoded.Sub(body.end).Seconds())
		m.phases.WithLabelValues(verb, phaseServe).Observe(rec.served.Sub(rec.decoded).Seconds())
		m.phases.WithLabelValues(verb, phaseReply).Observe(end.Sub(rec.served).Seconds())
	})
}

// timedBody notes when a request body's end was read (io.EOF): the handlers read every verb's body
// to its end before they decode it.
type timedBody struct {
	io.ReadCloser
	end time.Time
}

func (b *timedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF && b.end.IsZero() {
		b.end = time.Now()
	}
	return n, err
}

// recorder keeps the status of a response it passes on, and what the handler observed of the
// call (extender.CallObserver).
type recorder struct {
	http.ResponseWriter
	status          int
	decoded, served time.Time
	result          string
}

var _ extender.CallObserver = (*recorder)(nil)

func (r *recorder) WriteHeader(code int) {
	r.status = code
	r.ResponseWriter.WriteHeader(code)
}

func (r *recorder) ObserveCall(decoded, served time.Time, result string) {
	r.decoded, r.served, r.result = decoded, served, result
}
