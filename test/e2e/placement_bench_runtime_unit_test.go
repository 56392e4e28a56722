package e2e

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/tessera-gpu/tessera/internal/telemetry"
)

// TestScrapeGoRuntimeReadsTheExtendersRegistry reads the Go runtime series from a registry made as
// tessera-extender makes its own: GOMAXPROCS and the GC's pauses must be there for the profile.
func TestScrapeGoRuntimeReadsTheExtendersRegistry(t *testing.T) {
	srv := httptest.NewServer(telemetry.MetricsHandler(telemetry.NewRegistry("tessera-extender")))
	defer srv.Close()
	got, err := scrapeGoRuntime(http.DefaultClient, srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"go_sched_gomaxprocs_threads=", "go_gc_gogc_percent=", "go_gc_duration_seconds_count=", `go_gc_duration_seconds{quantile="1"}=`} {
		if !strings.Contains(got, want) {
			t.Errorf("scrapeGoRuntime lacks %s: %s", want, got)
		}
	}
	if strings.Contains(got, "go_goroutines") {
		t.Errorf("scrapeGoRuntime printed a series it was not asked for: %s", got)
	}
}
