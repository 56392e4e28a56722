package main

import (
	"net"
	"strings"
	"testing"
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
