package main

import (
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestFlagsAndConfigFile(t *testing.T) {
	cfgFile := filepath.Join(t.TempDir(), "node.yaml")
	os.WriteFile(cfgFile, []byte("apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\nbackend: sim\ncdiDir: /from/file\nnriSocket: /file/nri.sock\nsharesPerGPU: 4\nrediscoverInterval: 30s\n"), 0o644)
	parse := func(args ...string) (*nodeFlags, *flag.FlagSet) {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		var f nodeFlags
		f.register(fs)
		f.registerRun(fs, "host-a")
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		return &f, fs
	}
	f, fs := parse("--config", cfgFile, "--cdi-dir", "/from/flag", "--listen", "0.0.0.0:9999")
	cfg, err := f.load(fs)
	if err != nil {
		t.Fatal(err)
	}
	// A set flag beats the file, the file beats the default, the default fills the rest.
	if cfg.CDIDir != "/from/flag" || cfg.NRISocket != "/file/nri.sock" || cfg.Backend != "sim" || cfg.SharesPerGPU != 4 ||
		cfg.RediscoverInterval.Duration != 30*time.Second || cfg.Listen != "0.0.0.0:9999" || cfg.NodeName != "host-a" || cfg.DataDir != "/var/lib/tessera" {
		t.Errorf("merged config %+v", cfg)
	}
	for args, want := range map[string]string{
		"--backend=cuda":             `backend: must be nvml (a real NVIDIA driver) or sim (the simulated node), got "cuda"`,
		"--run-dir=relative":         `runDir: must be an absolute path, got "relative"`,
		"--listen=9400":              `listen: must be host:port`,
		"--rediscover-interval=10ms": "rediscoverInterval: must be at least 1s",
	} {
		f, fs := parse(args)
		if _, err := f.load(fs); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: error %v, want %q", args, err, want)
		}
	}
}
