package e2e

import (
	"errors"
	"io"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	schedconfigv1 "k8s.io/kube-scheduler/config/v1"
	"sigs.k8s.io/yaml"
)

// helmChart is the project's Helm chart.
func helmChart() string { return filepath.Join(repoRoot(), "deploy", "helm", "tessera") }

// helm runs the helm built by test/tools/install-helm.sh with its cache, config and data homes in
// a temporary directory (helm writes nothing to $HOME then).
func helm(t testing.TB, args ...string) (string, error) {
	t.Helper()
	home := t.TempDir()
	env := []string{"HELM_CACHE_HOME=" + filepath.Join(home, "cache"), "HELM_CONFIG_HOME=" + filepath.Join(home, "config"),
		"HELM_DATA_HOME=" + filepath.Join(home, "data")}
	return runEnv(t, 2*time.Minute, env, tool(t, "helm"), args...)
}

// chartExtender is the scheduler's extender entry as the chart renders it (templates/scheduler.yaml),
// pointed at urlPrefix: the e2e control planes call tessera-extender with the chart's settings
// (nodeCacheCapable, weight, verbs, timeout, managed resources), not with copies of them that could
// drift (the preemption verb included: TestExtenderPreemption). Not carried: enableHTTPS (the test
// extenders serve plain HTTP on loopback, rendered so with extender.tls.enabled=false;
// TestHelmInstall runs the chart's TLS).
func chartExtender(t testing.TB, urlPrefix string) *ExtenderConfig {
	t.Helper()
	out, err := helm(t, "template", "tessera", helmChart(), "--show-only", "templates/scheduler.yaml",
		"--set", "extender.tls.enabled=false", "--set", "extender.listenHost=127.0.0.1")
	if err != nil {
		t.Fatalf("helm template scheduler.yaml: %v\n%s", err, out)
	}
	// The rendered file holds the scheduler's ConfigMap among other objects (mode=second adds its own).
	var cfg *schedconfigv1.KubeSchedulerConfiguration
	dec := utilyaml.NewYAMLOrJSONDecoder(strings.NewReader(out), 4096)
	for {
		var cm corev1.ConfigMap
		if err := dec.Decode(&cm); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("decode chart scheduler.yaml: %v\n%s", err, out)
		}
		text, ok := cm.Data["config.yaml"]
		if cm.Kind != "ConfigMap" || !ok {
			continue
		}
		var c schedconfigv1.KubeSchedulerConfiguration
		if err := yaml.UnmarshalStrict([]byte(text), &c); err != nil {
			t.Fatalf("chart ConfigMap %s config.yaml: %v\n%s", cm.Name, err, text)
		}
		if c.Kind != "KubeSchedulerConfiguration" || cfg != nil {
			t.Fatalf("chart scheduler.yaml: ConfigMap %s is a second or no KubeSchedulerConfiguration (kind %q)", cm.Name, c.Kind)
		}
		cfg = &c
	}
	if cfg == nil {
		t.Fatalf("chart scheduler.yaml has no ConfigMap with a KubeSchedulerConfiguration:\n%s", out)
	}
	if len(cfg.Extenders) != 1 || cfg.Extenders[0].EnableHTTPS {
		t.Fatalf("chart scheduler config: want one plain-HTTP extender, got %+v", cfg.Extenders)
	}
	e := cfg.Extenders[0]
	x := &ExtenderConfig{URLPrefix: urlPrefix, FilterVerb: e.FilterVerb, PrioritizeVerb: e.PrioritizeVerb,
		BindVerb: e.BindVerb, NoBind: e.BindVerb == "", PreemptVerb: e.PreemptVerb, Weight: int(e.Weight), HTTPTimeout: e.HTTPTimeout.Duration,
		Ignorable: e.Ignorable, NodeCacheCapable: e.NodeCacheCapable, ManagedResources: []ManagedResource{}}
	for _, r := range e.ManagedResources {
		x.ManagedResources = append(x.ManagedResources, ManagedResource{Name: r.Name, IgnoredByScheduler: r.IgnoredByScheduler})
	}
	return x
}
