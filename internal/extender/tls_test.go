package extender

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
)

// testCA issues certificates for the TLS tests.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newTestCA(t *testing.T, name string) *testCA {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue writes a certificate for cn (organizations orgs, DNS names dns, and 127.0.0.1) usable for
// both server and client auth, as Helm's genSignedCert makes them; it returns the cert and key files.
func (ca *testCA) issue(t *testing.T, dir, cn string, orgs, dns []string) (certFile, keyFile string) {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: cn, Organization: orgs},
		DNSNames: dns, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kder, _ := x509.MarshalECPrivateKey(key)
	certFile, keyFile = filepath.Join(dir, cn+".crt"), filepath.Join(dir, cn+".key")
	writeFile(t, certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	writeFile(t, keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}))
	return certFile, keyFile
}

func writeFile(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

// extenderTLS writes a CA and the extender's serving certificate into dir and returns the files
// (allowed clients: the scheduler's CommonName and the extender's own).
func extenderTLS(t *testing.T, dir string, ca *testCA) configv1.ExtenderTLS {
	t.Helper()
	cert, key := ca.issue(t, dir, "tessera-extender", nil, []string{"tessera-extender.tessera-system.svc"})
	caFile := filepath.Join(dir, "ca.crt")
	writeFile(t, caFile, ca.pem)
	return configv1.ExtenderTLS{CertFile: cert, KeyFile: key, ClientCAFile: caFile, AllowedClients: []string{"tessera-scheduler", "tessera-extender"}}
}

// testMaterial is the TLSMaterial of extenderTLS's files.
func testMaterial(t *testing.T, dir string, ca *testCA) (*TLSMaterial, configv1.ExtenderTLS) {
	t.Helper()
	files := extenderTLS(t, dir, ca)
	m, err := NewTLSMaterial(files)
	if err != nil {
		t.Fatal(err)
	}
	return m, files
}

// tlsServer serves h over TLS with the material's configuration (as the extender's listeners do).
func tlsServer(t *testing.T, m *TLSMaterial, h http.Handler) *httptest.Server {
	t.Helper()
	srv := httptest.NewUnstartedServer(h)
	srv.TLS = m.ServerConfig()
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv
}

// clientWith is an HTTPS client trusting ca that presents the given certificate (none when empty).
func clientWith(t *testing.T, ca *testCA, certFile, keyFile string) *http.Client {
	t.Helper()
	pool := x509.NewCertPool()
	pool.AddCert(ca.cert)
	cfg := &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	if certFile != "" {
		c, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			t.Fatal(err)
		}
		// Always sent, whatever CAs the server names as acceptable: a forged certificate must
		// reach the server's verification, not be held back by the client.
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &c, nil }
	}
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: cfg}}
}

// healthz calls GET /healthz through c and returns the status code, or an error when the
// connection is refused (a failed handshake).
func healthz(c *http.Client, url string) (int, error) {
	resp, err := c.Get(url + "/healthz")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, nil
}

// TestSecurityExtenderRequiresClientCert: the extender API over TLS answers only a client whose
// certificate chains to the client CA and names an allowed identity; a client without a
// certificate, with one from another CA, or with an identity not listed is refused at the
// handshake. The configuration requires and verifies client certificates, TLS 1.2 at least.
func TestSecurityExtenderRequiresClientCert(t *testing.T) {
	dir := t.TempDir()
	ca, other := newTestCA(t, "tessera-ca"), newTestCA(t, "other-ca")
	m, _ := testMaterial(t, dir, ca)
	cfg, err := m.ServerConfig().GetConfigForClient(&tls.ClientHelloInfo{})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.ClientAuth != tls.RequireAndVerifyClientCert || cfg.MinVersion < tls.VersionTLS12 {
		t.Fatalf("server TLS: ClientAuth %v, MinVersion %x: want RequireAndVerifyClientCert, TLS 1.2+", cfg.ClientAuth, cfg.MinVersion)
	}
	srv := tlsServer(t, m, newTestExtender(t, "tessera").Handler(func() bool { return true }))

	sched, schedKey := ca.issue(t, dir, "tessera-scheduler", nil, nil)
	byOrg, byOrgKey := ca.issue(t, dir, "someone", []string{"tessera-extender"}, nil)
	stranger, strangerKey := ca.issue(t, dir, "tenant-pod", []string{"tenants"}, nil)
	otherDir := t.TempDir()
	forged, forgedKey := other.issue(t, otherDir, "tessera-scheduler", nil, nil)
	for _, tc := range []struct {
		name      string
		cert, key string
		ok        bool
	}{
		{"no client certificate", "", "", false},
		{"the scheduler's name from another CA", forged, forgedKey, false},
		{"a certificate of the CA with an identity not allowed", stranger, strangerKey, false},
		{"the scheduler", sched, schedKey, true},
		{"an allowed Organization", byOrg, byOrgKey, true},
	} {
		code, err := healthz(clientWith(t, ca, tc.cert, tc.key), srv.URL)
		if tc.ok && (err != nil || code != http.StatusOK) {
			t.Errorf("%s: refused (%d, %v), want served", tc.name, code, err)
		}
		if !tc.ok && err == nil {
			t.Errorf("%s: served with HTTP %d, want the handshake refused", tc.name, code)
		}
	}
	// A bind without a verified client certificate never reaches the handler either.
	body, _ := json.Marshal(extenderv1.ExtenderBindingArgs{PodName: "p", PodNamespace: "default", Node: "n1"})
	if resp, err := clientWith(t, ca, "", "").Post(srv.URL+"/bind", "application/json", bytes.NewReader(body)); err == nil {
		resp.Body.Close()
		t.Fatalf("a bind without a client certificate was answered: HTTP %d", resp.StatusCode)
	}
}

// TestSecurityPeerForwardTLS: a replica passes a bind on to the leader over TLS, presenting the
// extender's certificate and verifying the leader's against the CA for the peer server name; it
// refuses a leader whose certificate another CA signed, and a leader URL in plain HTTP.
func TestSecurityPeerForwardTLS(t *testing.T) {
	node := testNode(testInventory("n1", 1, 8, "A100"), nil)
	cs, _ := fakeAPI(t, []runtime.Object{node, wholePod("p0", 1), wholePod("p1", 1)}...)
	leader, follower := newBinder(t, cs, "a", node), newBinder(t, cs, "b", node)
	leader.Leader, follower.Leader = &atomic.Bool{}, &atomic.Bool{}
	leader.Leader.Store(true)
	synced := func() bool { return true }

	dir := t.TempDir()
	ca := newTestCA(t, "tessera-ca")
	m, _ := testMaterial(t, dir, ca)
	// The leader records the client certificate each passed-on call presented.
	var presented atomic.Value
	ls := tlsServer(t, m, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.TLS != nil && len(r.TLS.PeerCertificates) > 0 {
			presented.Store(r.TLS.PeerCertificates[0].Subject.CommonName)
		}
		leader.Handler(synced).ServeHTTP(w, r)
	}))
	fs := tlsServer(t, m, follower.Handler(synced))
	follower.Forward = m.ForwardClient(5 * time.Second)
	// The advertised URL names an address, not the certificate's DNS name: the peer server name
	// (the certificate's first DNS name) is what is verified.
	follower.LeaderURL = func(context.Context) (string, error) { return ls.URL, nil }
	sched, schedKey := ca.issue(t, dir, "tessera-scheduler", nil, nil)
	scheduler := clientWith(t, ca, sched, schedKey)
	bind := func(pod string) string {
		t.Helper()
		body, _ := json.Marshal(extenderv1.ExtenderBindingArgs{PodName: pod, PodNamespace: "default", Node: "n1"})
		resp, err := scheduler.Post(fs.URL+"/bind", "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var res extenderv1.ExtenderBindingResult
		if err := json.NewDecoder(resp.Body).Decode(&res); err != nil {
			t.Fatal(err)
		}
		return res.Error
	}
	if e := bind("p0"); e != "" {
		t.Fatalf("bind passed on over TLS: %s", e)
	}
	if got, _ := presented.Load().(string); got != "tessera-extender" {
		t.Fatalf("the passed-on bind presented client certificate %q, want the extender's", got)
	}

	// A "leader" serving a certificate of another CA (with the same names) is not trusted.
	otherDir := t.TempDir()
	im, _ := testMaterial(t, otherDir, newTestCA(t, "other-ca"))
	var reached atomic.Bool
	is := httptest.NewUnstartedServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { reached.Store(true) }))
	is.TLS = &tls.Config{Certificates: []tls.Certificate{*must(im.current()).cert}}
	is.StartTLS()
	defer is.Close()
	follower.LeaderURL = func(context.Context) (string, error) { return is.URL, nil }
	if e := bind("p1"); !strings.Contains(e, "certificate") || reached.Load() {
		t.Fatalf("bind passed on to a leader with another CA's certificate: error %q, reached %t", e, reached.Load())
	}
	// A leader advertising plain HTTP gets nothing in plain text.
	follower.LeaderURL = func(context.Context) (string, error) { return strings.Replace(ls.URL, "https:", "http:", 1), nil }
	if e := bind("p1"); !strings.Contains(e, "not https") {
		t.Fatalf("bind passed on in plain HTTP: error %q", e)
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestExtenderTLSRotation: new certificate files are served from the next connection on, without a
// restart; a half-written rotation keeps the previous certificate.
func TestExtenderTLSRotation(t *testing.T) {
	dir := t.TempDir()
	ca := newTestCA(t, "tessera-ca")
	m, files := testMaterial(t, dir, ca)
	srv := tlsServer(t, m, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "ok") }))
	sched, schedKey := ca.issue(t, dir, "tessera-scheduler", nil, nil)
	serial := func() *big.Int {
		t.Helper()
		c := clientWith(t, ca, sched, schedKey)
		c.Transport.(*http.Transport).DisableKeepAlives = true
		resp, err := c.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		return resp.TLS.PeerCertificates[0].SerialNumber
	}
	before := serial()
	// Rotate: a new serving certificate (same CA) over the old files, with a later mtime.
	rot := t.TempDir()
	cert, key := ca.issue(t, rot, "tessera-extender", nil, []string{"tessera-extender.tessera-system.svc"})
	for src, dst := range map[string]string{cert: files.CertFile, key: files.KeyFile} {
		writeFile(t, dst, must(os.ReadFile(src)))
		later := time.Now().Add(2 * time.Second)
		if err := os.Chtimes(dst, later, later); err != nil {
			t.Fatal(err)
		}
	}
	after := serial()
	if after.Cmp(before) == 0 {
		t.Fatal("the rotated certificate is not served: still the first one")
	}
	// A half-written rotation (a key that does not match) keeps the current certificate.
	writeFile(t, files.KeyFile, []byte("not a key"))
	if got := serial(); got.Cmp(after) != 0 {
		t.Fatalf("after a broken rotation the server presents serial %v, want the last good %v", got, after)
	}
}
