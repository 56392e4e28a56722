package e2e

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	sigyaml "sigs.k8s.io/yaml"
)

// chartObjects renders the chart with args and returns its objects by kind/name.
func chartObjects(t *testing.T, args ...string) map[string][]byte {
	t.Helper()
	out, err := helm(t, append([]string{"template", "tessera", helmChart(), "--namespace", "tessera-system"}, args...)...)
	if err != nil {
		t.Fatalf("helm template %v: %v\n%s", args, err, out)
	}
	objs := map[string][]byte{}
	dec := utilyaml.NewYAMLOrJSONDecoder(strings.NewReader(out), 4096)
	for {
		var doc map[string]any
		if err := dec.Decode(&doc); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		if doc == nil {
			continue
		}
		meta, _ := doc["metadata"].(map[string]any)
		raw, _ := sigyaml.Marshal(doc)
		objs[doc["kind"].(string)+"/"+meta["name"].(string)] = raw
	}
	return objs
}

func chartSecret(t *testing.T, objs map[string][]byte, name string) *corev1.Secret {
	t.Helper()
	var s corev1.Secret
	if raw, ok := objs["Secret/"+name]; !ok {
		t.Fatalf("the chart renders no Secret %s", name)
	} else if err := sigyaml.Unmarshal(raw, &s); err != nil {
		t.Fatal(err)
	}
	return &s
}

// TestHelmExtenderTLS renders the chart's TLS wiring (no cluster): the generated CA signs the
// extender's serving certificate (the Service's names, 127.0.0.1, usable for client auth when
// passing verbs on) and the scheduler's client certificate; the extender serves TLS with them and
// allows exactly the scheduler's and its own identity; the scheduler calls https with its client
// certificate (enableHTTPS, tlsConfig) and mounts it in mode=second; plain HTTP off loopback and an
// http extenderURL with TLS are refused at render.
func TestHelmExtenderTLS(t *testing.T) {
	objs := chartObjects(t)
	ext, sched := chartSecret(t, objs, "tessera-extender-tls"), chartSecret(t, objs, "tessera-scheduler-tls")
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ext.Data["ca.crt"]) || string(ext.Data["ca.crt"]) != string(sched.Data["ca.crt"]) {
		t.Fatal("the extender's and the scheduler's Secrets do not carry one CA")
	}
	leaf := func(s *corev1.Secret) *x509.Certificate {
		pair, err := tls.X509KeyPair(s.Data["tls.crt"], s.Data["tls.key"])
		if err != nil {
			t.Fatalf("Secret %s: %v", s.Name, err)
		}
		c, err := x509.ParseCertificate(pair.Certificate[0])
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	srv, cli := leaf(ext), leaf(sched)
	for _, v := range []struct {
		name  string
		usage x509.ExtKeyUsage
	}{{"tessera-extender.tessera-system.svc", x509.ExtKeyUsageServerAuth}, {"127.0.0.1", x509.ExtKeyUsageServerAuth}, {"", x509.ExtKeyUsageClientAuth}} {
		if _, err := srv.Verify(x509.VerifyOptions{Roots: pool, DNSName: v.name, KeyUsages: []x509.ExtKeyUsage{v.usage}}); err != nil {
			t.Errorf("the extender's certificate for %q (usage %v): %v", v.name, v.usage, err)
		}
	}
	if _, err := cli.Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil || cli.Subject.CommonName != "tessera-scheduler" {
		t.Errorf("the scheduler's client certificate %q: %v", cli.Subject.CommonName, err)
	}

	var d appsv1.Deployment
	if err := sigyaml.Unmarshal(objs["Deployment/tessera-extender"], &d); err != nil {
		t.Fatal(err)
	}
	args := d.Spec.Template.Spec.Containers[0].Args
	for _, want := range []string{"--tls-cert-file=/etc/tessera-tls/tls.crt", "--tls-key-file=/etc/tessera-tls/tls.key",
		"--tls-client-ca-file=/etc/tessera-tls/ca.crt", "--tls-allowed-clients=tessera-scheduler,tessera-extender",
		"--tls-peer-server-name=tessera-extender.tessera-system.svc", "--advertise-url=https://$(POD_IP):8888"} {
		if !slices.Contains(args, want) {
			t.Errorf("extender args lack %s: %q", want, args)
		}
	}
	if v := d.Spec.Template.Spec.Volumes; len(v) != 2 || v[1].Secret == nil || v[1].Secret.SecretName != "tessera-extender-tls" {
		t.Errorf("the extender does not mount its TLS Secret: %+v", v)
	}
	cm := objs["ConfigMap/tessera-scheduler-config"]
	for _, want := range []string{"urlPrefix: https://tessera-extender.tessera-system.svc:8888", "enableHTTPS: true",
		"certFile: /etc/tessera-scheduler-tls/tls.crt", "keyFile: /etc/tessera-scheduler-tls/tls.key", "caFile: /etc/tessera-scheduler-tls/ca.crt"} {
		if !strings.Contains(string(cm), want) {
			t.Errorf("the scheduler configuration lacks %q:\n%s", want, cm)
		}
	}
	var sd appsv1.Deployment
	if err := sigyaml.Unmarshal(objs["Deployment/tessera-scheduler"], &sd); err != nil {
		t.Fatal(err)
	}
	if v := sd.Spec.Template.Spec.Volumes; len(v) != 2 || v[1].Secret == nil || v[1].Secret.SecretName != "tessera-scheduler-tls" ||
		sd.Spec.Template.Spec.Containers[0].VolumeMounts[1].MountPath != "/etc/tessera-scheduler-tls" {
		t.Errorf("the chart's scheduler does not mount its client certificate: %+v", sd.Spec.Template.Spec)
	}

	// An operator's Secrets (cert-manager's): nothing generated, theirs mounted.
	objs = chartObjects(t, "--set", "extender.tls.existingSecret=ext-cert", "--set", "scheduler.tls.existingSecret=sched-cert")
	if _, ok := objs["Secret/tessera-extender-tls"]; ok {
		t.Error("Secrets generated beside extender.tls.existingSecret")
	}
	for _, want := range []string{"secretName: ext-cert", "secretName: sched-cert"} {
		if !strings.Contains(string(objs["Deployment/tessera-extender"])+string(objs["Deployment/tessera-scheduler"]), want) {
			t.Errorf("no volume with %s", want)
		}
	}
	// Plain HTTP only on loopback; with TLS the scheduler calls https only.
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--set", "extender.tls.enabled=false"}, "only on loopback"},
		{[]string{"--set", "scheduler.extenderURL=http://10.0.0.1:8888"}, "serves https only"},
		{[]string{"--set", "extender.tls.existingSecret=ext-cert"}, "scheduler.tls.existingSecret"},
	} {
		if out, err := helm(t, append([]string{"template", "tessera", helmChart()}, tc.args...)...); err == nil || !strings.Contains(out, tc.want) {
			t.Errorf("helm template %v: %v, want an error with %q\n%s", tc.args, err, tc.want, tail(out, 5))
		}
	}
	objs = chartObjects(t, "--set", "extender.tls.enabled=false", "--set", "extender.listenHost=127.0.0.1")
	if _, ok := objs["Secret/tessera-extender-tls"]; ok || !strings.Contains(string(objs["ConfigMap/tessera-scheduler-config"]), "enableHTTPS: false") {
		t.Error("extender.tls.enabled=false on loopback still renders TLS")
	}
}
