package telemetry

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"

	nrilog "github.com/containerd/nri/pkg/log"
	"github.com/sirupsen/logrus"
	"k8s.io/klog/v2"
)

// TestLogSetupRoutesLibraries: klog (client-go), NRI's logger and logrus (containerd, ttrpc) all
// come out of the one slog handler, in its format and at its verbosity.
func TestLogSetupRoutesLibraries(t *testing.T) {
	var buf bytes.Buffer
	log, err := LogOptions{Verbosity: 2, Format: "json"}.Setup(&buf)
	if err != nil {
		t.Fatal(err)
	}
	log.Info("from slog")
	klog.InfoS("from klog", "k", "v")
	klog.V(2).InfoS("from klog v2")
	klog.V(3).InfoS("from klog v3")
	nrilog.Infof(context.Background(), "from nri %d", 1)
	logrus.WithField("f", "x").Warn("from logrus")
	logrus.Debug("from logrus debug")
	klog.Flush()

	got := map[string]map[string]any{}
	for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("not one JSON format: %q: %v", line, err)
		}
		got[m["msg"].(string)] = m
	}
	for _, want := range []string{"from slog", "from klog", "from klog v2", "from nri 1", "from logrus"} {
		if got[want] == nil {
			t.Errorf("%q did not reach the log:\n%s", want, buf.String())
		}
	}
	for _, not := range []string{"from klog v3", "from logrus debug"} {
		if got[not] != nil {
			t.Errorf("%q logged above -v=2", not)
		}
	}
	if m := got["from logrus"]; m != nil && (m["level"] != "WARN" || m["f"] != "x") {
		t.Errorf("logrus entry lost its level or fields: %v", m)
	}
	if m := got["from klog v2"]; m != nil && m["level"] != "V2" {
		t.Errorf("klog V(2) line at level %v, want V2", m["level"])
	}
	if m := got["from nri 1"]; m != nil && m["component"] != "nri" {
		t.Errorf("NRI line without component: %v", m)
	}
}

func TestLogSetupRejectsUnknownFormat(t *testing.T) {
	if _, err := (LogOptions{Format: "xml"}).Setup(&bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), "--log-format") {
		t.Fatalf("want a --log-format error, got %v", err)
	}
}

// TestLogrusAndNRILoggerGoToTheirSlog: the logrus logger made for an API that wants one, and the
// NRI logger given to a plugin's stub, write into the slog logger they were made from, not
// logrus's or NRI's global.
func TestLogrusAndNRILoggerGoToTheirSlog(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, nil))
	l := Logrus(log)
	l.WithField("f", "x").Warningf("from the hook %d", 1)
	l.Debugf("hook debug")
	NRILogger(log).Warnf(context.Background(), "from the stub %d", 2)
	out := buf.String()
	for _, want := range []string{`level=WARN msg="from the hook 1" f=x`, `level=WARN msg="from the stub 2" component=nri`} {
		if !strings.Contains(out, want) {
			t.Errorf("want %q in:\n%s", want, out)
		}
	}
	if strings.Contains(out, "hook debug") {
		t.Errorf("a debug line passed an Info logger:\n%s", out)
	}
}
