package extender

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"slices"
	"sync"
	"time"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
)

// The extender API can bind pods, so only the kube-scheduler (and the other replicas, passing verbs
// on to the leader) may call it: over TLS, with a client certificate that chains to the client CA
// and names an allowed identity. The files are read again whenever one changes (a Secret volume's
// update, cert-manager's renewal), so certificates rotate without a restart.

// TLSMaterial reads the extender's certificate, key and CA bundle, again after they change.
type TLSMaterial struct {
	files configv1.ExtenderTLS
	mu    sync.Mutex
	stamp string
	cur   *tlsState
}

// tlsState is one reading of the files.
type tlsState struct {
	cert       *tls.Certificate
	pool       *x509.CertPool
	serverName string // the name the leader's serving certificate must carry
	server     *tls.Config
}

// NewTLSMaterial reads the files once, so that a bad file stops the start with its error.
func NewTLSMaterial(files configv1.ExtenderTLS) (*TLSMaterial, error) {
	if files.CertFile == "" || files.KeyFile == "" || files.ClientCAFile == "" {
		return nil, errors.New("TLS needs a certificate, its key and a client CA file")
	}
	if len(files.AllowedClients) == 0 {
		return nil, errors.New("TLS needs the allowed client identities")
	}
	m := &TLSMaterial{files: files}
	if _, err := m.current(); err != nil {
		return nil, err
	}
	return m, nil
}

// current returns the material, reading the files again when their modification time or size
// changed. A failed reading keeps the previous material (a rotation caught half-written) and
// returns it; only the first reading's error is returned.
func (m *TLSMaterial) current() (*tlsState, error) {
	stamp := ""
	for _, p := range []string{m.files.CertFile, m.files.KeyFile, m.files.ClientCAFile} {
		if fi, err := os.Stat(p); err == nil {
			stamp += fmt.Sprintf("%d/%d;", fi.ModTime().UnixNano(), fi.Size())
		} else {
			stamp += "-;"
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cur != nil && stamp == m.stamp {
		return m.cur, nil
	}
	st, err := m.read()
	if err != nil {
		if m.cur != nil {
			return m.cur, nil
		}
		return nil, err
	}
	st.server = m.serverConfigFor(st) // one per reading: connections share it
	m.cur, m.stamp = st, stamp
	return st, nil
}

func (m *TLSMaterial) read() (*tlsState, error) {
	cert, err := tls.LoadX509KeyPair(m.files.CertFile, m.files.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("extender TLS certificate %s, key %s: %w", m.files.CertFile, m.files.KeyFile, err)
	}
	ca, err := os.ReadFile(m.files.ClientCAFile)
	if err != nil {
		return nil, fmt.Errorf("extender TLS client CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return nil, fmt.Errorf("extender TLS client CA %s: no PEM certificate in it", m.files.ClientCAFile)
	}
	st := &tlsState{cert: &cert, pool: pool, serverName: m.files.PeerServerName}
	if st.serverName == "" {
		leaf := cert.Leaf
		if leaf == nil {
			if leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
				return nil, fmt.Errorf("extender TLS certificate %s: %w", m.files.CertFile, err)
			}
		}
		if len(leaf.DNSNames) > 0 {
			st.serverName = leaf.DNSNames[0]
		} else {
			st.serverName = leaf.Subject.CommonName
		}
	}
	return st, nil
}

// ServerConfig is the listeners' TLS configuration: TLS 1.2 or later, the current certificate,
// and a client certificate required, verified against the client CA and checked against the
// allowed identities.
func (m *TLSMaterial) ServerConfig() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			st, err := m.current()
			if err != nil {
				return nil, err
			}
			return st.server, nil
		},
	}
}

func (m *TLSMaterial) serverConfigFor(st *tlsState) *tls.Config {
	return &tls.Config{
		MinVersion:       tls.VersionTLS12,
		Certificates:     []tls.Certificate{*st.cert},
		ClientAuth:       tls.RequireAndVerifyClientCert,
		ClientCAs:        st.pool,
		VerifyConnection: func(cs tls.ConnectionState) error { return m.allowed(cs.PeerCertificates) },
	}
}

// allowed checks the client certificate (already verified against the CA) names an allowed
// identity: its CommonName, one of its DNS names or one of its Organizations.
func (m *TLSMaterial) allowed(peer []*x509.Certificate) error {
	if len(peer) == 0 {
		return errors.New("tessera-extender: a client certificate is required")
	}
	c := peer[0]
	ids := append([]string{c.Subject.CommonName}, c.DNSNames...)
	ids = append(ids, c.Subject.Organization...)
	for _, id := range ids {
		if id != "" && slices.Contains(m.files.AllowedClients, id) {
			return nil
		}
	}
	return fmt.Errorf("tessera-extender: client certificate %q (organizations %q) is not an allowed client", c.Subject.CommonName, c.Subject.Organization)
}

// ForwardClient is the HTTP client a replica passes verbs on to the leader with: it presents the
// extender's certificate as its client certificate and verifies the leader's serving certificate
// against the CA, for the peer server name (the advertised URL names a pod IP, which the
// certificate does not). Each connection reads the current material.
func (m *TLSMaterial) ForwardClient(timeout time.Duration) *http.Client {
	return &http.Client{Timeout: timeout, Transport: httpsOnly{&http.Transport{
		DialTLSContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			st, err := m.current()
			if err != nil {
				return nil, err
			}
			d := &tls.Dialer{Config: &tls.Config{
				MinVersion:   tls.VersionTLS12,
				Certificates: []tls.Certificate{*st.cert},
				RootCAs:      st.pool,
				ServerName:   st.serverName,
			}}
			return d.DialContext(ctx, network, addr)
		},
		TLSHandshakeTimeout: 10 * time.Second,
		MaxIdleConnsPerHost: 4,
	}}}
}

// httpsOnly refuses to pass a verb on in plain HTTP: with TLS on, the leader's URL must be https.
type httpsOnly struct{ rt http.RoundTripper }

func (h httpsOnly) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.URL.Scheme != "https" {
		return nil, fmt.Errorf("the leader advertises %s, not https: with TLS a verb is passed on over TLS only (--advertise-url https://...)", r.URL.Redacted())
	}
	return h.rt.RoundTrip(r)
}
