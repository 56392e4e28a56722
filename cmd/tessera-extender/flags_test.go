package main

import (
	"errors"
	"flag"
	"io"
	"testing"
)

// TestParseFlags parses the flags the chart passes (deploy/helm/tessera/templates/extender.yaml)
// and reads the same from environment variables, which the command line overrides.
func TestParseFlags(t *testing.T) {
	o, err := parseFlags([]string{"--listen=0.0.0.0:8888", "--config=/etc/tessera/config.yaml", "--identity=pod-1",
		"--leader-elect=true", "--reuse-port=true", "--peer-listen=0.0.0.0:0", "--advertise-url=http://10.0.0.1:0",
		"--filter-pick-one=true", "--warm-memo=false", "--metrics-listen=0.0.0.0:9447", "-v=2"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.listen != "0.0.0.0:8888" || o.config != "/etc/tessera/config.yaml" || o.identity != "pod-1" || !o.leaderElect ||
		!o.reusePort || o.peerListen != "0.0.0.0:0" || o.advertiseURL != "http://10.0.0.1:0" || !o.pickOne || o.warmMemo ||
		o.metricsListen != "0.0.0.0:9447" || o.log.Verbosity != 2 || o.qps != 100 || o.policySet || len(o.schedulerNames) != 0 {
		t.Errorf("parsed %+v", o)
	}
	t.Setenv("TESSERA_EXTENDER_POLICY", "fgd")
	t.Setenv("TESSERA_EXTENDER_KUBE_API_QPS", "7")
	t.Setenv("TESSERA_EXTENDER_WARM_MEMO", "false")
	t.Setenv("TESSERA_EXTENDER_SCHEDULER_NAMES", "tessera-scheduler,default-scheduler")
	if o, err = parseFlags([]string{"--kube-api-qps", "9"}, io.Discard); err != nil {
		t.Fatal(err)
	}
	if o.policy != "fgd" || !o.policySet || o.qps != 9 || o.warmMemo || !o.leaderElect ||
		len(o.schedulerNames) != 2 || o.schedulerNames[1] != "default-scheduler" {
		t.Errorf("with environment: %+v", o)
	}
	if o, err = parseFlags([]string{"--scheduler-names=a", "--scheduler-names=b"}, io.Discard); err != nil || len(o.schedulerNames) != 2 || o.schedulerNames[0] != "a" {
		t.Errorf("--scheduler-names twice: %v %q", err, o.schedulerNames)
	}
	if o, err = parseFlags([]string{"--tls-cert-file=/tls/tls.crt", "--tls-key-file=/tls/tls.key", "--tls-client-ca-file=/tls/ca.crt",
		"--tls-allowed-clients=tessera-scheduler,tessera-extender"}, io.Discard); err != nil || o.tls.CertFile != "/tls/tls.crt" ||
		o.tls.KeyFile != "/tls/tls.key" || o.tls.ClientCAFile != "/tls/ca.crt" || len(o.tls.AllowedClients) != 2 {
		t.Errorf("TLS flags: %v %+v", err, o.tls)
	}
	if _, err := parseFlags([]string{"--help"}, io.Discard); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("--help: %v", err)
	}
	if _, err := parseFlags([]string{"--no-such-flag"}, io.Discard); err == nil {
		t.Error("an unknown flag was accepted")
	}
}
