package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"syscall"

	"golang.org/x/sys/unix"
)

// listeners are the extender's sockets: the API (the scheduler's), /metrics and /healthz when apart,
// and the peer listener other replicas pass binds on to.
type listeners struct {
	api, metrics, peer net.Listener
}

// listen opens the listeners. Replicas on one host network (hostNetwork pods, a test cluster without
// CNI) share the API and metrics ports with SO_REUSEPORT; each needs a port of its own for forwarded
// binds, since a shared one could hand a bind back to a replica that is not the leader.
func listen(o *options) (*listeners, error) {
	var shared net.ListenConfig
	if o.reusePort {
		shared.Control = func(_, _ string, c syscall.RawConn) error {
			var serr error
			if err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1) }); err != nil {
				return err
			}
			return serr
		}
	}
	l := &listeners{}
	var err error
	open := func(lc net.ListenConfig, addr string) net.Listener {
		if err != nil || addr == "" {
			return nil
		}
		var ln net.Listener
		if ln, err = lc.Listen(context.Background(), "tcp", addr); err != nil {
			err = fmt.Errorf("listen on %s: %w", addr, err)
		}
		return ln
	}
	l.api = open(shared, o.listen)
	l.metrics = open(shared, o.metricsListen)
	l.peer = open(net.ListenConfig{}, o.peerListen)
	if err != nil {
		l.close()
		return nil, err
	}
	return l, nil
}

func (l *listeners) close() {
	for _, ln := range []net.Listener{l.api, l.metrics, l.peer} {
		if ln != nil {
			ln.Close()
		}
	}
}

// advertiseURL is the URL this replica stands for election with: --advertise-url, whose port 0
// stands for the peer listener's port.
func advertiseURL(raw string, peer net.Listener) (string, error) {
	if raw == "" {
		return "", nil
	}
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		return "", fmt.Errorf("--advertise-url %q: want http://HOST:PORT", raw)
	}
	if u.Port() != "0" {
		return raw, nil
	}
	if peer == nil {
		return "", errors.New("--advertise-url has port 0, which stands for the --peer-listen port: set --peer-listen")
	}
	_, port, err := net.SplitHostPort(peer.Addr().String())
	if err != nil {
		return "", fmt.Errorf("peer listener address: %w", err)
	}
	u.Host = net.JoinHostPort(u.Hostname(), port)
	return u.String(), nil
}
