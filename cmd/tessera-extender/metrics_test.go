package main

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tessera-gpu/tessera/internal/extender"
	"github.com/tessera-gpu/tessera/internal/placement"
	"github.com/tessera-gpu/tessera/internal/telemetry"
)

// TestRequestMetrics: each verb is timed under the result the extender reported for it
// (extender.CallObserver), or error where it answered with an HTTP error, and its phases are timed.
func TestRequestMetrics(t *testing.T) {
	reg := telemetry.NewRegistry("tessera-extender")
	leader := &atomic.Bool{}
	m := newExtenderMetrics(reg, leader, true, func() (int64, int64) { return 4990, 10 }, func() int64 { return 55 }, func() int64 { return 77 })
	answers := map[string]string{
		"/filter":     `{"NodeNames":["n1"],"FailedNodes":{},"Error":""}`,
		"/prioritize": `[{"Host":"n1","Score":10}]`,
		"/bind":       `{"Error":"node n1: GPU over-commit"}`,
	}
	results := map[string]string{"/filter": telemetry.ResultOK, "/prioritize": telemetry.ResultOK, "/bind": telemetry.ResultError}
	h := m.instrument(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/healthz" {
			io.WriteString(w, "ok")
			return
		}
		if _, err := io.ReadAll(r.Body); err != nil { // as the verbs do before decoding
			t.Errorf("read body: %v", err)
		}
		if strings.Contains(r.URL.RawQuery, "bad") { // not decoded: answered with an HTTP error, not observed
			http.Error(w, "invalid extender request", http.StatusBadRequest)
			return
		}
		obs, ok := w.(extender.CallObserver)
		if !ok {
			t.Fatalf("the instrumented handler's writer is no CallObserver")
		}
		result := results[r.URL.Path]
		if strings.Contains(r.URL.RawQuery, "none") {
			result = extender.ResultUnschedulable
		}
		now := time.Now()
		obs.ObserveCall(now, now, result)
		io.WriteString(w, answers[r.URL.Path])
	}))
	for _, target := range []string{"/filter", "/filter?none", "/filter?none", "/filter?bad", "/prioritize", "/bind", "/bind"} {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, target, strings.NewReader("{}")))
		if target == "/bind" && rec.Body.String() != answers["/bind"] {
			t.Fatalf("the instrumented handler changed the answer: %q", rec.Body.String())
		}
	}
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/healthz", nil))
	out := scrape(t, reg)
	for _, want := range []string{
		`tessera_extender_request_duration_seconds_count{result="ok",verb="filter"} 1`,
		`tessera_extender_request_duration_seconds_count{result="unschedulable",verb="filter"} 2`,
		`tessera_extender_request_duration_seconds_count{result="error",verb="filter"} 1`,
		`tessera_extender_request_duration_seconds_count{result="ok",verb="prioritize"} 1`,
		`tessera_extender_request_duration_seconds_count{result="error",verb="bind"} 2`,
		`tessera_extender_request_phase_seconds_count{phase="read",verb="filter"} 4`,
		`tessera_extender_request_phase_seconds_count{phase="decode",verb="filter"} 3`,
		`tessera_extender_request_phase_seconds_count{phase="serve",verb="filter"} 3`,
		`tessera_extender_request_phase_seconds_count{phase="reply",verb="filter"} 3`,
		`tessera_extender_request_phase_seconds_count{phase="reply",verb="bind"} 2`,
		`tessera_extender_request_duration_seconds_bucket{result="ok",verb="filter",le="0.004"} 1`,
		"\ntessera_extender_leader 0\n",
		`tessera_extender_node_evaluations_total{outcome="remembered"} 4990`,
		`tessera_extender_node_evaluations_total{outcome="bounded"} 55`,
		`tessera_extender_node_evaluations_total{outcome="evaluated"} 10`,
		`tessera_extender_node_evaluations_total{outcome="warmed"} 77`,
		"tessera_extender_build_info{",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	if strings.Contains(out, `verb="healthz"`) || strings.Contains(out, `result="ok",verb="bind"`) {
		t.Errorf("unexpected series:\n%s", out)
	}
	leader.Store(true)
	if out := scrape(t, reg); !strings.Contains(out, "\ntessera_extender_leader 1\n") {
		t.Errorf("leader gauge not 1 while leading")
	}
	if t.Failed() {
		t.Log(out)
	}
}

// TestInstrumentDoesNotReadRepliesBack: timing a call costs the same whatever its reply's size.
// The result once came from decoding a copy of the reply, and a filter reply names every refused
// node: at 4,800 of them that was 3.8 ms and 1.5 MB per call, inside the time the histogram measured
// and before the next call could run on the extender's CPU.
func TestInstrumentDoesNotReadRepliesBack(t *testing.T) {
	m := newExtenderMetrics(prometheus.NewRegistry(), &atomic.Bool{}, false, func() (int64, int64) { return 0, 0 }, func() int64 { return 0 }, func() int64 { return 0 })
	reply := func(refused int) []byte {
		var b strings.Builder
		b.WriteString(`{"Nodes":null,"NodeNames":[],"FailedNodes":{`)
		for i := range refused {
			if i > 0 {
				b.WriteByte(',')
			}
			fmt.Fprintf(&b, `"node-%04d":"the pod asks for GPU model A100"`, i)
		}
		b.WriteString(`},"FailedAndUnresolvableNodes":{},"Error":""}`)
		return []byte(b.String())
	}
	allocs := func(body []byte) float64 {
		h := m.instrument(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.ReadAll(r.Body)
			now := time.Now()
			w.(extender.CallObserver).ObserveCall(now, now, extender.ResultUnschedulable)
			_, _ = w.Write(body)
		}))
		return testing.AllocsPerRun(20, func() {
			h.ServeHTTP(discardWriter{}, httptest.NewRequest(http.MethodPost, "/filter", strings.NewReader("{}")))
		})
	}
	small, large := allocs(reply(1)), allocs(reply(4800))
	if large > small {
		t.Errorf("a call with a reply refusing 4,800 nodes allocated %.0f times, one refusing 1 node %.0f: the reply is read back", large, small)
	}
}

// discardWriter is a ResponseWriter that keeps nothing.
type discardWriter struct{}

func (discardWriter) Header() http.Header         { return http.Header{} }
func (discardWriter) Write(b []byte) (int, error) { return len(b), nil }
func (discardWriter) WriteHeader(int)             {}

func scrape(t *testing.T, reg *prometheus.Registry) string {
	rec := httptest.NewRecorder()
	telemetry.MetricsHandler(reg).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	return rec.Body.String()
}

// TestPressureMetrics: the free GPUs and the model pressure by model, read from the shape
// statistics at scrape time (T4-only pods ask 20% of the request; T4 holds 2 of 10 free GPUs: its
// pressure is 0, G2's the restricted share 0.2).
func TestPressureMetrics(t *testing.T) {
	shapes := placement.NewShapeStats()
	for i := range 100 {
		r := &placement.Request{CPUMilli: 1000, Containers: []placement.ContainerShape{{Whole: 1}}}
		if i < 20 {
			r.Models = []string{"T4"}
		}
		shapes.Observe(r, 1)
	}
	for model, gpus := range map[string]int{"G2": 8, "T4": 2} {
		n := &placement.NodeState{}
		for i := range gpus {
			n.GPUs = append(n.GPUs, placement.GPUState{Index: i, Model: model, Usable: true})
		}
		shapes.AddNodeFree(n, 1)
	}
	shapes.ScoreContext() // the snapshot that serves
	reg := telemetry.NewRegistry("tessera-extender")
	reg.MustRegister(newPressureCollector(shapes))
	out := scrape(t, reg)
	for _, want := range []string{
		`tessera_extender_free_gpus{model="G2"} 8`,
		`tessera_extender_free_gpus{model="T4"} 2`,
		`tessera_extender_model_pressure{model="G2"} 0.2`,
		`tessera_extender_model_pressure{model="T4"} 0`,
		`tessera_extender_host_bound 0`, // the nodes track no CPU or memory
	} {
		if !strings.Contains(out, want+"\n") {
			t.Errorf("metrics lack %q:\n%s", want, out)
		}
	}
	// A node with 1 CPU per GPU, against the pods' 1 CPU per GPU, and another with none.
	shapes.AddNodeFree(&placement.NodeState{CPUMilli: 1000, GPUs: []placement.GPUState{{Model: "G2", Usable: true}}}, 1)
	shapes.ScoreContext()
	if out := scrape(t, reg); !strings.Contains(out, "tessera_extender_host_bound 0\n") {
		t.Errorf("a cluster with the CPU per GPU its pods ask is not host-bound:\n%s", out)
	}
	shapes.AddNodeFree(&placement.NodeState{CPUMilli: 100, GPUs: []placement.GPUState{{Model: "G2", Usable: true}}}, 1)
	shapes.ScoreContext()
	if out := scrape(t, reg); !strings.Contains(out, "tessera_extender_host_bound 1\n") {
		t.Errorf("a cluster with less CPU per GPU than its pods ask should be host-bound:\n%s", out)
	}
}

// The state's anomalies are exported as counters: GPU conflicts and expired reservations.
func TestStateMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	registerStateMetrics(reg, func() int64 { return 3 }, func() int64 { return 5 })
	out := scrape(t, reg)
	for _, want := range []string{"tessera_extender_state_conflicts_total 3", "tessera_extender_reservations_expired_total 5"} {
		if !strings.Contains(out, want) {
			t.Errorf("metrics lack %q:\n%s", want, out)
		}
	}
}
