package v1

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
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
		"apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\nbackend: cuda\n":              `backend: must be nvml (a real NVIDIA driver) or sim (the simulated node), got "cuda"`,
		"apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\nbackend: sim\nbackend: sim\n": `key "backend" already set`,
		"apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\ncdiDirectory: /x\n":           "cdiDirectory: unknown field",
		"apiVersion: v2\nkind: NodeAgentConfig\n":                                         `apiVersion: must be "tessera.dev/v1"`,
		"apiVersion: tessera.dev/v1\nkind: ExtenderConfig\n":                              `kind: must be "NodeAgentConfig"`,
		"apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\nsharesPerGPU: 5000\n":         "sharesPerGPU: must be between 1 and 1024",
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
		if err := DecodeYAML(data, &c, "config"); err != nil {
			return
		}
		c.Defaults()
		_ = c.Validate() // must not panic on anything that decodes
	})
}
