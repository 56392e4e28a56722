package e2e

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// PKI is a throw-away certificate authority for a loopback control plane, written as PEM files
// into Dir. Certificates are generated in Go (ECDSA P-256, fast and with no openssl needed); the
// service-account signing key is RSA, which every Kubernetes version accepts.
type PKI struct {
	Dir    string
	CACert string // path of the CA certificate (PEM)
	CAKey  string // path of the CA private key (PEM)

	ca    *x509.Certificate
	caKey *ecdsa.PrivateKey
}

// newPKI creates the CA in dir.
func newPKI(dir string) (*PKI, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "tessera-e2e-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(10 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	ca, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	p := &PKI{Dir: dir, CACert: filepath.Join(dir, "ca.crt"), CAKey: filepath.Join(dir, "ca.key"), ca: ca, caKey: key}
	if err := writePEM(p.CACert, "CERTIFICATE", der); err != nil {
		return nil, err
	}
	if err := writeECKey(p.CAKey, key); err != nil {
		return nil, err
	}
	return p, nil
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	return n
}

// CertSpec describes a leaf certificate: a client certificate when Hosts is empty, otherwise a
// serving (and client) certificate for those DNS names and IP addresses.
type CertSpec struct {
	CommonName    string
	Organizations []string
	Hosts         []string
}

// Issue signs a key pair for spec and writes Dir/<name>.crt and Dir/<name>.key; it returns their paths.
func (p *PKI) Issue(name string, spec CertSpec) (certFile, keyFile string, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: spec.CommonName, Organization: spec.Organizations},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(10 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if len(spec.Hosts) > 0 {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
		for _, h := range spec.Hosts {
			if ip := net.ParseIP(h); ip != nil {
				tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
			} else {
				tmpl.DNSNames = append(tmpl.DNSNames, h)
			}
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca, &key.PublicKey, p.caKey)
	if err != nil {
		return "", "", err
	}
	certFile, keyFile = filepath.Join(p.Dir, name+".crt"), filepath.Join(p.Dir, name+".key")
	if err := writePEM(certFile, "CERTIFICATE", der); err != nil {
		return "", "", err
	}
	if err := writeECKey(keyFile, key); err != nil {
		return "", "", err
	}
	return certFile, keyFile, nil
}

// serviceAccountKeys writes an RSA key pair for signing service-account tokens.
func (p *PKI) serviceAccountKeys() (pub, priv string, err error) {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return "", "", err
	}
	pubDER, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return "", "", err
	}
	pub, priv = filepath.Join(p.Dir, "sa.pub"), filepath.Join(p.Dir, "sa.key")
	if err := writePEM(pub, "PUBLIC KEY", pubDER); err != nil {
		return "", "", err
	}
	if err := writePEM(priv, "RSA PRIVATE KEY", x509.MarshalPKCS1PrivateKey(key)); err != nil {
		return "", "", err
	}
	return pub, priv, nil
}

func writeECKey(path string, key *ecdsa.PrivateKey) error {
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	return writePEM(path, "EC PRIVATE KEY", der)
}

func writePEM(path, typ string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}

// writeKubeconfig writes a kubeconfig for server, trusting caFile and authenticating with a client certificate.
func writeKubeconfig(path, server, caFile, certFile, keyFile string) error {
	return os.WriteFile(path, []byte(fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: %s
    certificate-authority: %s
users:
- name: u
  user:
    client-certificate: %s
    client-key: %s
contexts:
- name: e2e
  context: {cluster: e2e, user: u, namespace: default}
current-context: e2e
`, server, caFile, certFile, keyFile)), 0o600)
}
