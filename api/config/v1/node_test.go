package v1

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	api "github.com/tessera-gpu/tessera/api/v1"
)

func TestLoadNodeConfig(t *testing.T) {
	dir := t.TempDir()
	write := func(s string) string {
		p := filepath.Join(dir, "c.yaml")
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	c, err := LoadNodeConfig(write("apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\nbackend: sim\nsharesPerGPU: 4\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.Backend != "sim" || c.SharesPerGPU != 4 || c.CDIDir != DefaultCDIDir || c.CDIVendor != DefaultCDIVendor {
		t.Fatalf("loaded %+v", c)
	}
	if c, err := LoadNodeConfig(""); err != nil || c.Backend != DefaultBackend {
		t.Fatalf("defaults: %+v %v", c, err)
	}
	for doc, want := range map[string]string{
		"apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\nbackend: cuda\n":              `backend: Invalid value: must be nvml (a real NVIDIA driver) or sim (the simulated node), got "cuda"`,
		"apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\nbackend: sim\nbackend: sim\n": `key "backend" already set`,
		"apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\ncdiDirectory: /x\n":           "cdiDirectory: Forbidden: unknown field",
		"apiVersion: v2\nkind: NodeAgentConfig\n":                                         `apiVersion: Invalid value: must be "tessera.dev/v1"`,
		"apiVersion: tessera.dev/v1\nkind: ExtenderConfig\n":                              `kind: Invalid value: must be "NodeAgentConfig"`,
		"apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\nsharesPerGPU: 5000\n":         "sharesPerGPU: Invalid value: must be between 1 and 1024",
	} {
		if _, err := LoadNodeConfig(write(doc)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("config %q: error %v, want it to contain %q", doc, err, want)
		}
	}
	if _, err := LoadNodeConfig(filepath.Join(dir, "missing.yaml")); err == nil || !strings.Contains(err.Error(), "read node agent config") {
		t.Errorf("missing file: %v", err)
	}
}

func FuzzDecodeNodeConfig(f *testing.F) {
	f.Add([]byte("apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\nbackend: sim\n"))
	f.Add([]byte("{a: [1, {b: c}]}"))
	f.Fuzz(func(t *testing.T, data []byte) {
		var c NodeConfig
		if err := api.DecodeYAML(data, &c, "config"); err != nil {
			return
		}
		c.Defaults()
		_ = c.Validate() // must not panic on anything that decodes
	})
}

func TestNodeConfigHealth(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.yaml")
	load := func(body string) (*NodeConfig, error) {
		if err := os.WriteFile(p, []byte("apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\n"+body), 0o644); err != nil {
			t.Fatal(err)
		}
		return LoadNodeConfig(p)
	}
	for body, want := range map[string][]uint64{
		"":                         DefaultIgnoredXIDs,
		"ignoredXIDs: [79]\n":      {79},
		"ignoredXIDs: []\n":        {}, // explicitly none, not the default
		"ignoredXIDs: [13, 999]\n": {13, 999},
	} {
		c, err := load(body)
		if err != nil {
			t.Fatalf("%q: %v", body, err)
		}
		if !slices.Equal(c.IgnoredXIDs, want) || c.IgnoredXIDs == nil {
			t.Errorf("%q: ignored XIDs %v, want %v", body, c.IgnoredXIDs, want)
		}
		if c.HealthCheckInterval.Duration != DefaultHealthCheckInterval {
			t.Errorf("%q: health check interval %s", body, c.HealthCheckInterval.Duration)
		}
	}
	for body, want := range map[string]string{
		"ignoredXIDs: [0]\n":          "ignoredXIDs[0]: Invalid value: must be an XID between 1 and 999",
		"ignoredXIDs: [1000]\n":       "ignoredXIDs[0]: Invalid value: must be an XID between 1 and 999",
		"ignoredXIDs: \"13,31\"\n":    "ignoredXIDs: Invalid value: expected []uint64",
		"ignoreXIDs: [13]\n":          "ignoreXIDs: Forbidden: unknown field",
		"healthCheckInterval: 10ms\n": "healthCheckInterval: Invalid value: must be at least 1s",
	} {
		if _, err := load(body); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: error %v, want %q", body, err, want)
		}
	}
	// Defaults hand out a copy: changing one config's list does not change the default.
	c, _ := load("")
	c.IgnoredXIDs[0] = 1
	if DefaultIgnoredXIDs[0] != 13 {
		t.Error("the default ignored XIDs were shared with a config")
	}
}

// TestNodeConfigMemoryGuard: the memoryGuard section defaults to on (1s, 3s, max(64 MiB, 2%)) and
// refuses what would kill on one sample or never sample.
func TestNodeConfigMemoryGuard(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.yaml")
	load := func(body string) (*NodeConfig, error) {
		if err := os.WriteFile(p, []byte("apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\n"+body), 0o644); err != nil {
			t.Fatal(err)
		}
		return LoadNodeConfig(p)
	}
	c, err := load("")
	if err != nil {
		t.Fatal(err)
	}
	if m := c.MemoryGuard; !m.On() || m.Interval.Duration != DefaultMemoryGuardInterval || m.Grace.Duration != DefaultMemoryGuardGrace ||
		m.ToleranceBytes != DefaultMemoryGuardTolerance || m.TolerancePercent != DefaultMemoryGuardPercent || c.HostProc != "/proc" {
		t.Errorf("defaults %+v", m)
	}
	if c, err := load("memoryGuard:\n  enabled: false\n"); err != nil || c.MemoryGuard.On() {
		t.Errorf("enabled: false: %v", err)
	}
	for body, want := range map[string]string{
		"memoryGuard:\n  interval: 50ms\n":       "memoryGuard.interval: Invalid value: must be between 100ms and 1m",
		"memoryGuard:\n  interval: 5s\n":         "memoryGuard.grace: Invalid value: must be at least memoryGuard.interval",
		"memoryGuard:\n  grace: 1h\n":            "memoryGuard.grace: Invalid value",
		"memoryGuard:\n  tolerancePercent: 90\n": "memoryGuard.tolerancePercent: Invalid value: must be between 0 and 50",
		"memoryGuard:\n  toleranceBytes: -5\n":   "memoryGuard.toleranceBytes: Invalid value",
		"memoryGuard:\n  killAfter: 3\n":         "memoryGuard.killAfter: Forbidden: unknown field",
		"draUnhealthyEffect: PreferNoSchedule\n": "draUnhealthyEffect: Invalid value: must be NoSchedule or NoExecute",
		"draDynamicMIG: true\n":                  "draDynamicMIG: Invalid value: needs dra: true",
		"hostProc: proc\n":                       "hostProc: Invalid value: must be an absolute path",
	} {
		if _, err := load(body); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: error %v, want %q", body, err, want)
		}
	}
}
