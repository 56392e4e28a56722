package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/url"
	"syscall"

	"golang.org/x/sys/unix"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
	"github.com/tessera-gpu/tessera/internal/extender"
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

// serveTLS wraps the API and peer listeners in TLS; /metrics and /healthz apart stay plain.
func (l *listeners) serveTLS(cfg *tls.Config) {
	l.api = tls.NewListener(l.api, cfg)
	if l.peer != nil {
		l.peer = tls.NewListener(l.peer, cfg)
	}
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

// overrideTLS sets the config's tls fields the flags set.
func overrideTLS(cfg *configv1.ExtenderTLS, flags configv1.ExtenderTLS) {
	for _, f := range []struct {
		dst *string
		v   string
	}{{&cfg.CertFile, flags.CertFile}, {&cfg.KeyFile, flags.KeyFile}, {&cfg.ClientCAFile, flags.ClientCAFile}, {&cfg.PeerServerName, flags.PeerServerName}} {
		if f.v != "" {
			*f.dst = f.v
		}
	}
	if len(flags.AllowedClients) > 0 {
		cfg.AllowedClients = flags.AllowedClients
	}
}

// serveTLS reads the TLS material when TLS is configured (nil when not). The extender API can bind
// pods: without TLS it is served only on loopback (tests, a scheduler on the same host), and a
// verb is passed on to the leader only in the scheme the API is served in.
func serveTLS(o *options, files configv1.ExtenderTLS) (*extender.TLSMaterial, error) {
	scheme := "http"
	if files.Enabled() {
		scheme = "https"
	}
	if o.advertiseURL != "" {
		if u, err := url.Parse(o.advertiseURL); err == nil && u.Scheme != scheme {
			return nil, fmt.Errorf("--advertise-url %q: the extender API is served over %s here, advertise %s://", o.advertiseURL, scheme, scheme)
		}
	}
	if files.Enabled() {
		return extender.NewTLSMaterial(files)
	}
	for flag, addr := range map[string]string{"--listen": o.listen, "--peer-listen": o.peerListen} {
		if addr != "" && !loopback(addr) {
			return nil, fmt.Errorf("%s %s: the extender API (which binds pods) is served in plain HTTP only on loopback; "+
				"set --tls-cert-file, --tls-key-file, --tls-client-ca-file and --tls-allowed-clients (or the config's tls) to serve it on %s", flag, addr, addr)
		}
	}
	return nil, nil
}

// loopback reports whether a listen address is on loopback only.
func loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
