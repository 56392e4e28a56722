package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tessera-gpu/tessera/internal/placement"
	"github.com/tessera-gpu/tessera/internal/telemetry"
)

// TestRequestMetrics: each verb is timed under its result, read from what the extender answered.
func TestRequestMetrics(t *testing.T) {
	reg := telemetry.NewRegistry("tessera-extender")
	leader := &atomic.Bool{}
	m := newExtenderMetrics(reg, leader, true, func() (int64, int64) { return 4990, 10 }, func() int64 { return 55 }, func() int64 { return 77 })
	answers := map[string]string{
		"/filter":     `{"NodeNames":["n1"],"FailedNodes":{},"Error":""}`,
		"/prioritize": `[{"Host":"n1","Score":10}]`,
		"/bind":       `{"Error":"node n1: GPU over-commit"}`,
	}
	h := m.instrument(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/healthz" {
			io.WriteString(w, "ok")
			return
		}
		if _, err := io.ReadAll(r.Body); err != nil { // as the verbs do before decoding
			t.Errorf("read body: %v", err)
		}
		if strings.Contains(r.URL.RawQuery, "none") {
			io.WriteString(w, `{"NodeNames":[],"FailedNodes":{"n1":"no GPU fits"}}`)
			return
		}
		if strings.Contains(r.URL.RawQuery, "never") { // what the extender answers when no node can ever fit
			io.WriteString(w, `{"NodeNames":[],"FailedNodes":{},"FailedAndUnresolvableNodes":{"n1":"48 GiB per share, the largest GPU has 40"}}`)
			return
		}
		if strings.Contains(r.URL.RawQuery, "bad") {
			http.Error(w, "invalid extender request", http.StatusBadRequest)
			return
		}
		io.WriteString(w, answers[r.URL.Path])
	}))
	for _, target := range []string{"/filter", "/filter?none", "/filter?never", "/filter?bad", "/prioritize", "/bind", "/bind"} {
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
		`tessera_extender_request_read_seconds_count{verb="filter"} 4`,
		`tessera_extender_request_read_seconds_count{verb="bind"} 2`,
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
