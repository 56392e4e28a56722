package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// TestChartSchemaStrict: values.schema.json declares every value values.yaml has, and every object
// it describes with properties refuses keys it does not list, so a misspelled key fails the install
// instead of being ignored (install.md promises that). helm refuses misspellings in each block.
func TestChartSchemaStrict(t *testing.T) {
	var schema map[string]any
	raw, err := os.ReadFile(filepath.Join(helmChart(), "values.schema.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &schema); err != nil {
		t.Fatalf("values.schema.json: %v", err)
	}
	var values map[string]any
	raw, err = os.ReadFile(filepath.Join(helmChart(), "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(raw, &values); err != nil {
		t.Fatalf("values.yaml: %v", err)
	}
	var undeclared []string
	var walkValues func(v any, s map[string]any, path string)
	walkValues = func(v any, s map[string]any, path string) {
		m, ok := v.(map[string]any)
		props, _ := s["properties"].(map[string]any)
		if !ok || props == nil {
			return // a leaf, or a free-form map (labels, nodeSelector, a Kubernetes type)
		}
		for k, x := range m {
			sub, ok := props[k].(map[string]any)
			if !ok {
				undeclared = append(undeclared, path+k)
				continue
			}
			walkValues(x, sub, path+k+".")
		}
	}
	walkValues(values, schema, "")
	sort.Strings(undeclared)
	if len(undeclared) > 0 {
		t.Errorf("values.yaml has values values.schema.json does not declare: %v", undeclared)
	}
	var loose []string
	var walkSchema func(n any, path string)
	walkSchema = func(n any, path string) {
		switch n := n.(type) {
		case map[string]any:
			if _, ok := n["properties"]; ok && n["additionalProperties"] != false {
				loose = append(loose, path)
			}
			for k, v := range n {
				walkSchema(v, path+"/"+k)
			}
		case []any:
			for i, v := range n {
				walkSchema(v, path+"/"+string(rune('0'+i)))
			}
		}
	}
	walkSchema(schema, "")
	sort.Strings(loose)
	if len(loose) > 0 {
		t.Errorf("schema objects that accept unknown keys (want additionalProperties: false): %v", loose)
	}

	for _, key := range []string{"imageRegistry", "global.imageRegistri", "image.node.pullpolicy", "node.driveRoot",
		"node.updateStrategy.maxSurg", "node.log.formt", "extender.tls.enable", "scheduler.mod", "dra.enable",
		"admission.migration.setSchedular", "metrics.serviceMonitor.enable", "metrics.hamiMetric", "metrics.hamiLegacyMetric", "runtimeClass.creat"} {
		out, err := helm(t, "template", "tessera", helmChart(), "--set", key+"=x")
		last := key[strings.LastIndex(key, ".")+1:]
		if err == nil || !strings.Contains(out, "'"+last+"' not allowed") {
			t.Errorf("helm template --set %s=x: %v, want the schema to refuse %q\n%s", key, err, last, out)
		}
	}
	for _, bad := range [][]string{
		{"admission.migration.alibabaMemoryUnit=KiB", "alibabaMemoryUnit"},
		{"node.log.format=xml", "format"},
		{"image.extender.pullPolicy=Sometimes", "pullPolicy"},
		{"node.extraArgs[0]=v=4", "extraArgs"},
	} {
		if out, err := helm(t, "template", "tessera", helmChart(), "--set", bad[0]); err == nil || !strings.Contains(out, bad[1]) {
			t.Errorf("helm template --set %s: %v, want a schema error naming %s\n%s", bad[0], err, bad[1], out)
		}
	}
}

// renderedObjects renders the chart with args and decodes every object.
func renderedObjects(t *testing.T, args ...string) []map[string]any {
	t.Helper()
	out, err := helm(t, append([]string{"template", "tessera", helmChart()}, args...)...)
	if err != nil {
		t.Fatalf("helm template %v: %v\n%s", args, err, out)
	}
	var objs []map[string]any
	dec := utilyaml.NewYAMLOrJSONDecoder(strings.NewReader(out), 4096)
	for {
		var o map[string]any
		if err := dec.Decode(&o); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("decode helm template %v: %v", args, err)
		}
		if o != nil {
			objs = append(objs, o)
		}
	}
	return objs
}

// podTemplate returns a workload's pod template (nil for other kinds).
func podTemplate(o map[string]any) map[string]any {
	if k := o["kind"]; k != "DaemonSet" && k != "Deployment" {
		return nil
	}
	spec, _ := o["spec"].(map[string]any)
	tpl, _ := spec["template"].(map[string]any)
	return tpl
}

func valueAt(m any, path ...string) any {
	for _, p := range path {
		mm, ok := m.(map[string]any)
		if !ok {
			return nil
		}
		m = mm[p]
	}
	return m
}

// TestChartOperatorValues: the values an operator sets for a mirror, logs, extra flags and
// annotations reach every component, and every object carries the chart's version labels.
func TestChartOperatorValues(t *testing.T) {
	chart, err := os.ReadFile(filepath.Join(helmChart(), "Chart.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var meta struct{ Name, Version, AppVersion string }
	if err := yaml.Unmarshal(chart, &meta); err != nil {
		t.Fatal(err)
	}
	// Every chart version has its section in docs/upgrade.md saying what changed.
	upgrade, err := os.ReadFile(filepath.Join(repoRoot(), "docs", "upgrade.md"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(upgrade), " to "+meta.Version+"\n") {
		t.Errorf("docs/upgrade.md has no section ending \"to %s\" for the chart's version", meta.Version)
	}
	objs := renderedObjects(t, "--set", "global.imageRegistry=mirror.example.com:5000/",
		"--set", "image.extender.pullPolicy=Always",
		"--set", "node.log.level=4", "--set", "node.log.format=json", "--set", "extender.log.format=json", "--set", "scheduler.log.level=3",
		"--set", "node.extraArgs[0]=--rediscover-interval=30s", "--set", "extender.extraArgs[0]=--warm-memo=false",
		"--set", "node.extraEnv[0].name=GODEBUG", "--set", "node.extraEnv[0].value=x=1",
		"--set", "node.podAnnotations.team=gpu", "--set", "extender.podAnnotations.team=gpu", "--set", "scheduler.podAnnotations.team=gpu",
		"--set", "metrics.hamiMetrics=true", "--set", "metrics.hamiLegacyMetrics=true")
	seen := map[string]bool{}
	for _, o := range objs {
		name := valueAt(o, "metadata", "name")
		labels, _ := valueAt(o, "metadata", "labels").(map[string]any)
		if labels["helm.sh/chart"] != meta.Name+"-"+meta.Version || labels["app.kubernetes.io/version"] != meta.AppVersion {
			t.Errorf("%s %s: labels %v lack helm.sh/chart=%s-%s and app.kubernetes.io/version=%s", o["kind"], name, labels, meta.Name, meta.Version, meta.AppVersion)
		}
		tpl := podTemplate(o)
		if tpl == nil {
			continue
		}
		if valueAt(tpl, "metadata", "annotations", "team") != "gpu" {
			t.Errorf("%s %s: pod annotations %v, want team=gpu", o["kind"], name, valueAt(tpl, "metadata", "annotations"))
		}
		containers, _ := valueAt(tpl, "spec", "containers").([]any)
		inits, _ := valueAt(tpl, "spec", "initContainers").([]any)
		for _, c := range append(containers, inits...) {
			c := c.(map[string]any)
			img, _ := c["image"].(string)
			if !strings.HasPrefix(img, "mirror.example.com:5000/") || strings.Contains(img, "ghcr.io") || strings.Contains(img, "registry.k8s.io") {
				t.Errorf("container %s: image %q, want it from mirror.example.com:5000/ in place of its registry", c["name"], img)
			}
			var args []string
			argv, _ := c["args"].([]any)
			for _, a := range argv {
				args = append(args, a.(string))
			}
			joined := strings.Join(args, " ")
			switch c["name"] {
			case "tessera-node":
				seen["node"] = true
				if args[len(args)-1] != "--rediscover-interval=30s" || !strings.Contains(joined, "--v=4 --log-format=json") || !strings.Contains(joined, "--hami-metrics --hami-legacy-metrics") {
					t.Errorf("tessera-node args %q: want --v=4 --log-format=json, --hami-metrics --hami-legacy-metrics, and extraArgs last", args)
				}
				if env, _ := json.Marshal(c["env"]); !strings.Contains(string(env), `{"name":"GODEBUG","value":"x=1"}`) {
					t.Errorf("tessera-node env %s lacks node.extraEnv", env)
				}
				if c["imagePullPolicy"] != "IfNotPresent" {
					t.Errorf("tessera-node pullPolicy %v, want image.pullPolicy's IfNotPresent", c["imagePullPolicy"])
				}
			case "tessera-extender":
				seen["extender"] = true
				if args[len(args)-1] != "--warm-memo=false" || !strings.Contains(joined, "--v=0 --log-format=json") {
					t.Errorf("tessera-extender args %q: want --v=0 --log-format=json and extraArgs last", args)
				}
				if c["imagePullPolicy"] != "Always" {
					t.Errorf("tessera-extender pullPolicy %v, want image.extender.pullPolicy's Always", c["imagePullPolicy"])
				}
			case "kube-scheduler":
				seen["scheduler"] = true
				if !strings.Contains(joined, "--v=3 --logging-format=text") {
					t.Errorf("kube-scheduler args %q: want --v=3 --logging-format=text", args)
				}
			}
		}
		if o["kind"] == "DaemonSet" {
			if s := valueAt(o, "spec", "updateStrategy", "rollingUpdate", "maxSurge"); s != float64(0) && s != int64(0) {
				t.Errorf("DaemonSet maxSurge %v (%T), want 0", s, s)
			}
		}
	}
	for _, c := range []string{"node", "extender", "scheduler"} {
		if !seen[c] {
			t.Errorf("no %s container rendered", c)
		}
	}
	// maxSurge: the new agent starts beside the old one (internal/handover). Under hostNetwork the
	// agent declares no container port (the API server would make it a hostPort, and the scheduler
	// would keep the surge pod off the node) and the probes name the port by number.
	for _, hostNetwork := range []bool{true, false} {
		for _, o := range renderedObjects(t, "--set", "node.updateStrategy.maxSurge=1", "--set", "node.updateStrategy.maxUnavailable=0",
			"--set", fmt.Sprintf("node.hostNetwork=%t", hostNetwork)) {
			if o["kind"] != "DaemonSet" {
				continue
			}
			if s := valueAt(o, "spec", "updateStrategy", "rollingUpdate", "maxSurge"); s != float64(1) && s != int64(1) {
				t.Errorf("hostNetwork %t: DaemonSet maxSurge %v (%T), want 1", hostNetwork, s, s)
			}
			containers, _ := valueAt(o, "spec", "template", "spec", "containers").([]any)
			for _, c := range containers {
				if valueAt(c, "name") != "tessera-node" {
					continue
				}
				if ports := valueAt(c, "ports"); (ports != nil) == hostNetwork {
					t.Errorf("hostNetwork %t with maxSurge: container ports %v", hostNetwork, ports)
				}
				for _, probe := range [][]string{{"readinessProbe", "httpGet", "port"}, {"livenessProbe", "tcpSocket", "port"}} {
					if p := valueAt(c, probe...); p != float64(9445) && p != int64(9445) {
						t.Errorf("hostNetwork %t: %v = %v, want the metrics port 9445 by number", hostNetwork, probe, p)
					}
				}
			}
		}
	}
	// Without hamiMetrics and hamiLegacyMetrics the agent serves Tessera's names only.
	for _, o := range renderedObjects(t) {
		if o["kind"] == "DaemonSet" {
			if b, _ := json.Marshal(o); strings.Contains(string(b), "--hami-") {
				t.Error("the agent gets a --hami-* flag by default")
			}
		}
	}
}

// TestDashboard: the Grafana dashboard has one source, the chart's dashboards/tessera.json
// (deploy/grafana/tessera.json links to it and the chart's ConfigMap carries it as is); it joins
// dcgm-exporter's series on UUID alone (dcgm-exporter spells its node label Hostname or hostname
// by version), filters Tessera's by hostname, and offers namespace and pod variables that every
// per-container panel applies.
func TestDashboard(t *testing.T) {
	src := filepath.Join(helmChart(), "dashboards", "tessera.json")
	raw, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(repoRoot(), "deploy", "grafana", "tessera.json")
	if target, err := os.Readlink(link); err != nil || filepath.Join(filepath.Dir(link), target) != src {
		t.Errorf("%s: want a link to %s (one dashboard source), got %q, %v", link, src, target, err)
	}
	var d struct {
		Templating struct{ List []struct{ Name string } }
		Panels     []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("dashboard: %v", err)
	}
	vars := map[string]bool{}
	for _, v := range d.Templating.List {
		vars[v.Name] = true
	}
	for _, want := range []string{"datasource", "node", "namespace", "pod"} {
		if !vars[want] {
			t.Errorf("dashboard lacks the variable %s", want)
		}
	}
	perPod := false
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			e := tg.Expr
			if strings.Contains(e, "Hostname") {
				t.Errorf("panel %q: %s names Hostname (dcgm-exporter's old label; Tessera's is hostname)", p.Title, e)
			}
			// UUID, and GPU_I_ID for MIG instances: the labels every dcgm-exporter version fills the same.
			onUUID := strings.Contains(e, "on (UUID)") || strings.Contains(e, "on (UUID, GPU_I_ID)")
			if strings.Contains(e, "DCGM_") && (!onUUID || strings.Contains(e, "DCGM_FI_DEV_GPU_UTIL{") || strings.Contains(e, "DCGM_FI_PROF_GR_ENGINE_ACTIVE{")) {
				t.Errorf("panel %q: %s must select dcgm-exporter's series by joining on (UUID) only", p.Title, e)
			}
			// dcgm-exporter's own pod labels come from the kubelet's device IDs (Tessera's tokens):
			// its series reach pods through tessera_container_gpu_info.
			if strings.Contains(e, "DCGM_") && strings.Contains(e, "group_right tessera_container_gpu_info{") {
				perPod = true
			}
			if strings.Contains(e, "tessera_container_") && (!strings.Contains(e, `namespace=~"$namespace"`) || !strings.Contains(e, `pod=~"$pod"`)) {
				t.Errorf("panel %q: %s ignores the namespace and pod variables", p.Title, e)
			}
		}
	}
	if !perPod {
		t.Error("no panel puts dcgm-exporter's series on pods through tessera_container_gpu_info")
	}
	for _, o := range renderedObjects(t, "--set", "metrics.grafanaDashboard.enabled=true") {
		if o["kind"] == "ConfigMap" {
			if got, ok := valueAt(o, "data", "tessera.json").(string); ok && got != strings.TrimSuffix(string(raw), "\n") {
				t.Error("the chart's dashboard ConfigMap differs from dashboards/tessera.json")
			} else if ok {
				return
			}
		}
	}
	t.Error("metrics.grafanaDashboard.enabled=true rendered no ConfigMap with tessera.json")
}

// TestChartGPUOperatorValues renders the chart with each values file docs/gpu-operator.md gives for
// the GPU Operator (the operator's driver container, a driver installed on the host) and checks the
// objects: the agent reads the driver where that setup puts it and runs the operator's
// nvidia-cdi-hook, runs only on GPU nodes while the operator lets a device plugin run there (its MIG
// manager and driver manager pause that label), and the chart leaves the nvidia-cdi RuntimeClass to
// the operator. The operator-side values the doc lists are its v26.7.0 names.
func TestChartGPUOperatorValues(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join(repoRoot(), "docs", "gpu-operator.md"))
	if err != nil {
		t.Fatal(err)
	}
	operator, err := os.ReadFile(filepath.Join(repoRoot(), "docs", "examples", "gpu-operator-values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var ov map[string]any
	if err := yaml.Unmarshal(operator, &ov); err != nil {
		t.Fatalf("docs/examples/gpu-operator-values.yaml: %v", err)
	}
	// The operator's device plugin would advertise nvidia.com/gpu beside the agent; its toolkit's
	// NRI plugin is left off (the agent's validator refuses GPU CDI devices it adds to unprivileged
	// containers); its runtime refuses NVIDIA_VISIBLE_DEVICES from unprivileged containers.
	for path, want := range map[string]any{"devicePlugin.enabled": false, "cdi.enabled": true, "cdi.nriPluginEnabled": false,
		"toolkit.enabled": true, "migManager.enabled": true, "dcgmExporter.enabled": true, "mig.strategy": "mixed"} {
		if got := valueAt(ov, strings.Split(path, ".")...); got != want {
			t.Errorf("gpu-operator-values.yaml %s = %v, want %v", path, got, want)
		}
	}
	if env, _ := json.Marshal(valueAt(ov, "toolkit", "env")); !strings.Contains(string(env), `{"name":"ACCEPT_NVIDIA_VISIBLE_DEVICES_ENVVAR_WHEN_UNPRIVILEGED","value":"false"}`) {
		t.Errorf("gpu-operator-values.yaml toolkit.env %s lacks ACCEPT_NVIDIA_VISIBLE_DEVICES_ENVVAR_WHEN_UNPRIVILEGED=false", env)
	}
	for file, driverRoot := range map[string]string{"values-gpu-operator.yaml": "/run/nvidia/driver", "values-gpu-operator-host-driver.yaml": "/"} {
		if !strings.Contains(string(doc), "deploy/helm/tessera/"+file) {
			t.Errorf("docs/gpu-operator.md does not name %s", file)
		}
		agent := false
		for _, o := range renderedObjects(t, "-f", filepath.Join(helmChart(), file)) {
			if o["kind"] == "RuntimeClass" {
				t.Errorf("%s: the chart renders RuntimeClass %v, which the operator creates", file, valueAt(o, "metadata", "name"))
			}
			if o["kind"] != "DaemonSet" || valueAt(o, "metadata", "name") != "tessera-node" {
				continue
			}
			agent = true
			tpl := podTemplate(o)
			sel, _ := valueAt(tpl, "spec", "nodeSelector").(map[string]any)
			if sel["nvidia.com/gpu.present"] != "true" || sel["nvidia.com/gpu.deploy.device-plugin"] != "true" {
				t.Errorf("%s: agent nodeSelector %v, want nvidia.com/gpu.present and nvidia.com/gpu.deploy.device-plugin true", file, sel)
			}
			containers, _ := valueAt(tpl, "spec", "containers").([]any)
			for _, c := range containers {
				if c := c.(map[string]any); c["name"] == "tessera-node" {
					args, _ := json.Marshal(c["args"])
					for _, want := range []string{`"--driver-root=` + driverRoot + `"`, `"--cdi-hook-path=/usr/local/nvidia/toolkit/nvidia-cdi-hook"`} {
						if !strings.Contains(string(args), want) {
							t.Errorf("%s: agent args %s lack %s", file, args, want)
						}
					}
				}
			}
			volumes, _ := valueAt(tpl, "spec", "volumes").([]any)
			for _, v := range volumes {
				if v := v.(map[string]any); v["name"] == "driver-root" && valueAt(v, "hostPath", "path") != driverRoot {
					t.Errorf("%s: driver-root volume %v, want host path %s", file, v, driverRoot)
				}
			}
		}
		if !agent {
			t.Errorf("%s: no tessera-node DaemonSet rendered", file)
		}
	}
}

// TestChartSimDescription: node.simDescription hands the simulated agent a host file describing its
// node (one DaemonSet, a different file on each node: TestMultiNode's A100 and H100 nodes), mounted
// read-only at the path the flag names; on the nvml backend the value is refused, naming the fix.
// The simulated agent has a /tmp (an emptyDir; the image has none): its mdev parents' sysfs tree is
// made there, and without it the agent of an A100 description exits at start.
func TestChartSimDescription(t *testing.T) {
	const path = "/var/lib/tessera-sim/node.yaml"
	var agent map[string]any
	for _, o := range renderedObjects(t, "--set", "node.backend=sim", "--set", "node.simDescription="+path) {
		if o["kind"] == "DaemonSet" {
			agent = podTemplate(o)
		}
	}
	c := valueAt(agent, "spec", "containers").([]any)[0].(map[string]any)
	var args []string
	for _, a := range c["args"].([]any) {
		args = append(args, a.(string))
	}
	if !slices.Contains(args, "--node-description="+path) {
		t.Errorf("the agent's args %v lack --node-description=%s", args, path)
	}
	var mounted, volume, tmp bool
	for _, m := range c["volumeMounts"].([]any) {
		m := m.(map[string]any)
		mounted = mounted || m["mountPath"] == path && m["readOnly"] == true
		tmp = tmp || m["mountPath"] == "/tmp"
	}
	if !tmp {
		t.Errorf("the simulated agent has no /tmp mounted: %v", c["volumeMounts"])
	}
	for _, v := range valueAt(agent, "spec", "volumes").([]any) {
		volume = volume || valueAt(v, "hostPath", "path") == path && valueAt(v, "hostPath", "type") == "File"
	}
	if !mounted || !volume {
		t.Errorf("%s: read-only mount %v, hostPath File volume %v; want both", path, mounted, volume)
	}
	out, err := helm(t, "template", "tessera", helmChart(), "--set", "node.simDescription="+path)
	if err == nil || !strings.Contains(out, "set node.backend=sim") {
		t.Errorf("node.simDescription on the nvml backend: %v, want it refused naming node.backend=sim:\n%s", err, out)
	}
}

// TestChartDRAClaims: with DRA on (the default) the extender reads claims (--dra-claims: allocated
// claims count on their node, the claims of pods sent to it are placed by the policy) and may read
// what that needs, the claims and their templates, and nothing more of resource.k8s.io; with
// dra.enabled=false or dra.extenderClaims=false it gets neither the flag nor the rights.
func TestChartDRAClaims(t *testing.T) {
	for _, tc := range []struct {
		args []string
		on   bool
	}{{nil, true}, {[]string{"--set", "dra.enabled=false"}, false}, {[]string{"--set", "dra.extenderClaims=false"}, false}} {
		var args []string
		var rules []any
		for _, o := range renderedObjects(t, tc.args...) {
			switch {
			case o["kind"] == "Deployment" && valueAt(o, "metadata", "name") == "tessera-extender":
				for _, a := range valueAt(podTemplate(o), "spec", "containers").([]any)[0].(map[string]any)["args"].([]any) {
					args = append(args, a.(string))
				}
			case o["kind"] == "ClusterRole" && valueAt(o, "metadata", "name") == "tessera-extender":
				for _, r := range o["rules"].([]any) {
					if slices.Contains(valueAt(r, "apiGroups").([]any), any("resource.k8s.io")) {
						rules = append(rules, r)
					}
				}
			}
		}
		if args == nil {
			t.Fatalf("%v: no tessera-extender Deployment rendered", tc.args)
		}
		if got := slices.Contains(args, "--dra-claims=true"); got != tc.on {
			t.Errorf("%v: the extender's args %v: --dra-claims=true %v, want %v", tc.args, args, got, tc.on)
		}
		want := "[]"
		if tc.on {
			want = "[map[apiGroups:[resource.k8s.io] resources:[resourceclaims resourceclaimtemplates] verbs:[get list watch]]]"
		}
		if got := fmt.Sprint(rules); got != want {
			t.Errorf("%v: the extender's resource.k8s.io rules %s, want %s", tc.args, got, want)
		}
	}
}
