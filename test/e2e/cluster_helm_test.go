package e2e

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/yaml"
	sigyaml "sigs.k8s.io/yaml"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
)

// HelmDryRun renders the chart with helm template (extra arguments: values, namespace) and applies
// the output to the cluster's API server with a server-side dry run; it returns kubectl's output
// and the number of rendered objects.
func HelmDryRun(t testing.TB, kubeconfig string, args ...string) (string, int) {
	t.Helper()
	manifest, err := helm(t, append([]string{"template", "tessera", helmChart()}, args...)...)
	if err != nil {
		t.Fatalf("helm template %v: %v\n%s", args, err, manifest)
	}
	objects := len(regexp.MustCompile(`(?m)^kind: `).FindAllString(manifest, -1))
	out, err := runStdin(t, 2*time.Minute, manifest, tool(t, "kubectl"), "--kubeconfig", kubeconfig, "apply", "--dry-run=server", "-f", "-")
	if err != nil {
		t.Fatalf("kubectl apply --dry-run=server of helm template %v: %v\n%s\n--- manifest:\n%s", args, err, out, manifest)
	}
	return out, objects
}

// TestClusterHelmTemplate renders deploy/helm/tessera with helm (test/tools/install-helm.sh) and
// applies it to a real API server (the same control plane StartCluster runs, without the node, which
// a server-side dry run never reaches) with `kubectl apply --dry-run=server`: every object must be
// accepted by the API server's validation and admission, in the default and a custom namespace and
// in both scheduler modes. `helm lint` must pass too, and the binaries must accept the flags the
// chart passes them.
func TestClusterHelmTemplate(t *testing.T) {
	if out, err := helm(t, "lint", "--strict", helmChart()); err != nil {
		t.Errorf("helm lint --strict: %v\n%s", err, out)
	}
	cp := StartControlPlane(t, ControlPlaneOptions{NoScheduler: true})
	cp.CreateNamespace(t, "tessera-system")
	for _, args := range [][]string{
		nil,
		{"--namespace", "tessera-system", "--set", "scheduler.mode=default", "--set", "extender.replicas=1",
			"--set", "extender.networkPolicy.extraFrom[0].ipBlock.cidr=10.0.0.0/24"},
		{"--namespace", "tessera-system", "--set", "runtimeClass.create=false", "--set", "node.backend=sim",
			"--set", "metrics.grafanaDashboard.enabled=true", "--set", "image.node.digest=sha256:" + strings.Repeat("0", 64), "--set", "extender.warmMemo=false",
			"--set", "imagePullSecrets[0].name=regcred"},
		{"--namespace", "tessera-system", "-f", filepath.Join(helmChart(), "values-gpu-operator.yaml")},
		{"--namespace", "tessera-system", "-f", filepath.Join(helmChart(), "values-gpu-operator-host-driver.yaml")},
		// The operator's values (a mirror, logs, extra env, annotations, HAMi's names, the update strategy).
		{"--namespace", "tessera-system", "--set", "global.imageRegistry=mirror.example.com", "--set", "node.log.format=json",
			"--set", "node.extraEnv[0].name=A", "--set", "node.extraEnv[0].value=b", "--set", "extender.podAnnotations.a=b",
			"--set", "metrics.hamiMetrics=true", "--set", "node.updateStrategy.maxUnavailable=10%", "--set", "scheduler.extraArgs[0]=--v=2"},
		// The migration policies, which render only where the API server serves them (as this one does).
		{"--namespace", "tessera-system", "--api-versions", "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy",
			"--set", "admission.migration.alibabaMemoryUnit=MiB"},
	} {
		out, n := HelmDryRun(t, cp.Kubeconfig, args...)
		accepted := strings.Count(out, "(server dry run)")
		t.Logf("helm template %v: %d objects, %d accepted by the API server (dry run)", args, n, accepted)
		if n == 0 || accepted != n {
			t.Errorf("helm template %v rendered %d objects, the API server accepted %d:\n%s", args, n, accepted, out)
		}
	}
	// Fail closed: a NetworkPolicy that would shut out the default scheduler is refused at render.
	if out, err := helm(t, "template", "tessera", helmChart(), "--set", "scheduler.mode=default"); err == nil || !strings.Contains(out, "extender.networkPolicy.extraFrom") {
		t.Errorf("scheduler.mode=default without extraFrom rendered (want an error naming extender.networkPolicy.extraFrom): %v\n%s", err, out)
	}
	// The ServiceMonitors need the Prometheus Operator's CRDs, which this API server lacks: render only.
	if out, err := helm(t, "template", "tessera", helmChart(), "--set", "metrics.serviceMonitor.enabled=true"); err != nil || strings.Count(out, "kind: ServiceMonitor") != 2 {
		t.Errorf("metrics.serviceMonitor.enabled=true: %v, want 2 ServiceMonitors\n%s", err, out)
	}
	checkChartMatchesBinaries(t)
}

// checkChartMatchesBinaries checks what the API server cannot: that tessera-node and
// tessera-extender accept the arguments the chart gives them, and that the chart's ExtenderConfig
// loads.
func checkChartMatchesBinaries(t *testing.T) {
	manifest, err := helm(t, "template", "tessera", helmChart())
	if err != nil {
		t.Fatalf("helm template: %v\n%s", err, manifest)
	}
	dec := yaml.NewYAMLOrJSONDecoder(strings.NewReader(manifest), 4096)
	checked := map[string]bool{}
	for {
		var doc map[string]any
		if err := dec.Decode(&doc); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("decode rendered chart: %v", err)
		}
		raw, _ := sigyaml.Marshal(doc)
		var spec *corev1.PodSpec
		switch doc["kind"] {
		case "DaemonSet":
			var ds appsv1.DaemonSet
			if err := sigyaml.Unmarshal(raw, &ds); err != nil {
				t.Fatal(err)
			}
			spec = &ds.Spec.Template.Spec
		case "Deployment":
			var d appsv1.Deployment
			if err := sigyaml.Unmarshal(raw, &d); err != nil {
				t.Fatal(err)
			}
			spec = &d.Spec.Template.Spec
		case "ConfigMap":
			var cm corev1.ConfigMap
			if err := sigyaml.Unmarshal(raw, &cm); err != nil {
				t.Fatal(err)
			}
			if cfg, ok := cm.Data["config.yaml"]; ok && strings.Contains(cfg, "kind: "+configv1.KindExtenderConfig) {
				f := filepath.Join(t.TempDir(), "config.yaml")
				if err := os.WriteFile(f, []byte(cfg), 0o644); err != nil {
					t.Fatal(err)
				}
				if _, err := configv1.LoadExtenderConfig(f); err != nil {
					t.Errorf("the chart's ExtenderConfig (ConfigMap %s) does not load: %v\n%s", cm.Name, err, cfg)
				}
				checked["ExtenderConfig"] = true
			}
		}
		if spec == nil {
			continue
		}
		for _, c := range spec.Containers {
			bin := map[string]string{"tessera-node": "tessera-node", "tessera-extender": "tessera-extender"}[c.Name]
			if bin == "" {
				continue
			}
			// Flags are parsed in order, so an unknown one fails before -help ends the parse.
			out, err := runCmd(t, time.Minute, tesseraBinary(t, bin), append(append([]string{}, c.Args...), "-help")...)
			if err != nil || strings.Contains(out, "flag provided but not defined") {
				t.Errorf("%s does not accept the chart's args %q: %v\n%s", bin, c.Args, err, out)
			}
			checked[bin] = true
		}
	}
	for _, want := range []string{"tessera-node", "tessera-extender", "ExtenderConfig"} {
		if !checked[want] {
			t.Errorf("the rendered chart has no %s to check", want)
		}
	}
}
