package main

import (
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
)

// TestListenSharedPorts: two replicas with --reuse-port share the API and metrics ports, each gets a
// peer port of its own, and the advertised URL names it. Without --reuse-port the second replica
// cannot listen.
func TestListenSharedPorts(t *testing.T) {
	first, err := listen(&options{listen: "127.0.0.1:0", reusePort: true, peerListen: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer first.close()
	shared := first.api.Addr().String()
	second, err := listen(&options{listen: shared, reusePort: true, peerListen: "127.0.0.1:0"})
	if err != nil {
		t.Fatalf("second replica with --reuse-port: %v", err)
	}
	defer second.close()
	if first.peer.Addr().String() == second.peer.Addr().String() {
		t.Fatalf("both replicas got peer address %s", first.peer.Addr())
	}
	if l, err := listen(&options{listen: shared}); err == nil {
		l.close()
		t.Fatalf("a replica without --reuse-port listened on the shared %s", shared)
	}
	got, err := advertiseURL("http://127.0.0.1:0", second.peer)
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(second.peer.Addr().String())
	if got != "http://127.0.0.1:"+port {
		t.Errorf("advertised %q, want the peer port %s", got, port)
	}
	if got, _ := advertiseURL("http://10.0.0.7:8888", nil); got != "http://10.0.0.7:8888" {
		t.Errorf("a fixed --advertise-url became %q", got)
	}
	if _, err := advertiseURL("http://10.0.0.7:0", nil); err == nil || !strings.Contains(err.Error(), "--peer-listen") {
		t.Errorf("port 0 without --peer-listen: %v, want an error naming --peer-listen", err)
	}
}

// TestSecurityPlainHTTPOnlyOnLoopback: without TLS the extender API listens in plain HTTP only on
// loopback; any other address (the chart's 0.0.0.0, a pod IP, all interfaces) is refused with an
// error naming the TLS flags; the advertised scheme must match the served one.
func TestSecurityPlainHTTPOnlyOnLoopback(t *testing.T) {
	for _, o := range []options{{listen: "127.0.0.1:8888"}, {listen: "[::1]:8888", peerListen: "127.0.0.1:0"}, {listen: "localhost:8888"},
		{listen: "127.0.0.1:8888", advertiseURL: "http://127.0.0.1:0"}} {
		if m, err := serveTLS(&o, configv1.ExtenderTLS{}); err != nil || m != nil {
			t.Errorf("%+v: %v, want plain HTTP allowed", o, err)
		}
	}
	for _, o := range []options{{listen: "0.0.0.0:8888"}, {listen: ":8888"}, {listen: "10.0.0.7:8888"}, {listen: "127.0.0.1:8888", peerListen: "0.0.0.0:0"}} {
		if _, err := serveTLS(&o, configv1.ExtenderTLS{}); err == nil || !strings.Contains(err.Error(), "--tls-cert-file") {
			t.Errorf("%+v: %v, want plain HTTP refused naming the TLS flags", o, err)
		}
	}
	tlsFiles := configv1.ExtenderTLS{CertFile: "/nonexistent.crt", KeyFile: "/nonexistent.key", ClientCAFile: "/ca", AllowedClients: []string{"s"}}
	if _, err := serveTLS(&options{listen: "0.0.0.0:8888", advertiseURL: "http://10.0.0.1:0"}, tlsFiles); err == nil || !strings.Contains(err.Error(), "advertise https://") {
		t.Errorf("TLS with an http advertise URL: %v", err)
	}
	if _, err := serveTLS(&options{listen: "127.0.0.1:8888", advertiseURL: "https://127.0.0.1:0"}, configv1.ExtenderTLS{}); err == nil {
		t.Error("plain HTTP advertised as https was accepted")
	}
	if _, err := serveTLS(&options{listen: "0.0.0.0:8888", advertiseURL: "https://10.0.0.1:0"}, tlsFiles); err == nil || !strings.Contains(err.Error(), "nonexistent") {
		t.Errorf("TLS with missing files: %v, want the file's error", err)
	}
}

// TestServeTLSWrapsAPIAndPeer: with TLS, both the API and the peer listener speak TLS only (a plain
// HTTP request gets 400, an HTTPS one is served); the metrics listener stays plain.
func TestServeTLSWrapsAPIAndPeer(t *testing.T) {
	l, err := listen(&options{listen: "127.0.0.1:0", peerListen: "127.0.0.1:0", metricsListen: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.close()
	borrowed := httptest.NewTLSServer(nil) // for its certificate
	defer borrowed.Close()
	l.serveTLS(&tls.Config{Certificates: borrowed.TLS.Certificates})
	ok := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	for _, ln := range []net.Listener{l.api, l.peer, l.metrics} {
		go func() { _ = http.Serve(ln, ok) }()
	}
	get := func(c *http.Client, url string) int {
		resp, err := c.Get(url)
		if err != nil {
			t.Fatalf("%s: %v", url, err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, ln := range []net.Listener{l.api, l.peer} {
		if code := get(http.DefaultClient, "http://"+ln.Addr().String()); code != http.StatusBadRequest {
			t.Errorf("plain HTTP to %s: %d, want 400", ln.Addr(), code)
		}
		if code := get(borrowed.Client(), "https://"+ln.Addr().String()); code != http.StatusOK {
			t.Errorf("HTTPS to %s: %d", ln.Addr(), code)
		}
	}
	if code := get(http.DefaultClient, "http://"+l.metrics.Addr().String()); code != http.StatusOK {
		t.Errorf("plain HTTP to the metrics listener: %d", code)
	}
}
