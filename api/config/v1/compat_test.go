package v1

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// The config types moved from api/v1 to api/config/v1 with the same apiVersion, kinds and fields:
// the config files users and the chart already have keep decoding.

// TestHelmExtenderConfigDecodes renders the ExtenderConfig of deploy/helm/tessera (its config.yaml
// ConfigMap, with the chart's default values) and loads it.
func TestHelmExtenderConfigDecodes(t *testing.T) {
	tmpl, err := os.ReadFile("../../../deploy/helm/tessera/templates/extender.yaml")
	if err != nil {
		t.Fatal(err)
	}
	block := regexp.MustCompile(`(?s)  config\.yaml: \|\n(.*?)\n---`).FindSubmatch(tmpl)
	if block == nil {
		t.Fatal("no config.yaml block in the extender template")
	}
	values := strings.NewReplacer(
		"{{ .Values.extender.policy }}", "tessera",
		`{{ .Values.extender.inventoryMaxAge | quote }}`, `"5m"`,
		"{{ .Release.Namespace }}", "tessera-system",
		`{{ include "tessera.schedulerName" . | quote }}`, `"tessera-scheduler"`,
		"experimentPriorityClasses: {{ toJson . }}", `experimentPriorityClasses: ["batch-low"]`,
		"inferencePriorityClasses: {{ toJson . }}", `inferencePriorityClasses: ["serving"]`,
	)
	var doc []string
	for _, line := range strings.Split(string(block[1]), "\n") {
		if strings.Contains(line, "{{-") { // with/end: keep the lists the blocks render
			continue
		}
		doc = append(doc, strings.TrimPrefix(values.Replace(line), "    "))
	}
	rendered := strings.Join(doc, "\n") + "\n"
	if strings.Contains(rendered, "{{") {
		t.Fatalf("template expression left in the rendered config:\n%s", rendered)
	}
	c, err := LoadExtenderConfig(write(t, rendered))
	if err != nil {
		t.Fatalf("%v\n%s", err, rendered)
	}
	if c.Kind != KindExtenderConfig || c.Policy != api.PolicyTessera || c.InventoryMaxAge.Duration != 5*time.Minute ||
		c.LeaseNamespace != "tessera-system" || len(c.ExperimentPriorityClasses) != 1 || len(c.InferencePriorityClasses) != 1 ||
		len(c.SchedulerNames) != 1 || c.SchedulerNames[0] != "tessera-scheduler" {
		t.Errorf("rendered chart config decoded as %+v\n%s", c, rendered)
	}
}

// TestNodeConfigFileDecodes loads a NodeAgentConfig naming every field, as written before the move
// (test/e2e's DRA harness writes the dra fields the same way).
func TestNodeConfigFileDecodes(t *testing.T) {
	c, err := LoadNodeConfig(write(t, `apiVersion: tessera.dev/v1
kind: NodeAgentConfig
nodeName: gpu-1
backend: sim
nodeDescription: dgx-h100
driverRoot: /run/nvidia/driver
containerDriverRoot: /driver-root
devRoot: /
cdiHookPath: /usr/bin/nvidia-cdi-hook
simDriverDir: /usr/share/tessera/sim-driver
cdiDir: /var/run/cdi
cdiVendor: example.com
sharesPerGPU: 4
vcudaLibrary: /opt/tessera/libvcuda.so
stateDir: /run/tessera/sim
dataDir: /var/lib/tessera
runDir: /run/tessera
devicePluginDir: /var/lib/kubelet/device-plugins
podResourcesSocket: /var/lib/kubelet/pod-resources/kubelet.sock
nriSocket: /var/run/nri/nri.sock
nriPluginIndex: "60"
kataRuntimeHandler: kata-qemu
kubeconfig: /etc/kubeconfig
listen: 0.0.0.0:9445
rediscoverInterval: 2m
hookBinary: /usr/local/lib/tessera/tessera-node
adminNamespaces: [monitoring]
ignoredXIDs: [13, 31]
healthCheckInterval: 10s
dra: true
draRegistrarDir: /var/lib/kubelet/plugins_registry
draPluginDir: /var/lib/kubelet/plugins/gpu.tessera.dev
`))
	if err != nil {
		t.Fatal(err)
	}
	if c.NodeName != "gpu-1" || c.CDIVendor != "example.com" || c.SharesPerGPU != 4 || c.NRIPluginIndex != "60" ||
		c.RediscoverInterval.Duration != 2*time.Minute || !c.DRA || len(c.IgnoredXIDs) != 2 || c.AdminNamespaces[0] != "monitoring" {
		t.Errorf("decoded %+v", c)
	}
}

func write(t *testing.T, doc string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(p, []byte(doc), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}
