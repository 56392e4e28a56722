package telemetry

import (
	"net/http"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	versioncollector "github.com/prometheus/client_golang/prometheus/collectors/version"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// NewRegistry is a registry with the Go runtime, process and <program>_build_info collectors
// (program: tessera_node, tessera_extender).
func NewRegistry(program string) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		versioncollector.NewCollector(strings.ReplaceAll(program, "-", "_")),
	)
	return reg
}

// MetricsHandler serves reg in the exposition format the scraper negotiates; a collector error
// still serves the metrics that were gathered.
func MetricsHandler(reg *prometheus.Registry) http.Handler {
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError, Registry: reg})
}

// LatencyBuckets are the buckets of Tessera's request histograms, in seconds: a CreateContainer or
// Allocate takes about a millisecond, a bind with its API writes tens of milliseconds; the top
// buckets catch API server stalls.
var LatencyBuckets = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}

// Result labels of the request histograms.
const (
	ResultOK    = "ok"
	ResultError = "error"
)

// Result is the result label of err.
func Result(err error) string {
	if err != nil {
		return ResultError
	}
	return ResultOK
}
