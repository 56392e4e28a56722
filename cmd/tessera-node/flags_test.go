package main

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	cli "github.com/urfave/cli/v3"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
)

func TestFlagsAndConfigFile(t *testing.T) {
	cfgFile := filepath.Join(t.TempDir(), "node.yaml")
	os.WriteFile(cfgFile, []byte("apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\nbackend: sim\ncdiDir: /from/file\nnriSocket: /file/nri.sock\nsharesPerGPU: 4\nrediscoverInterval: 30s\n"), 0o644)
	cfg, err := loadRunFlags(t, "--config", cfgFile, "--cdi-dir", "/from/flag", "--listen", "0.0.0.0:9999")
	if err != nil {
		t.Fatal(err)
	}
	// A set flag beats the file, the file beats the default, the default fills the rest.
	if cfg.CDIDir != "/from/flag" || cfg.NRISocket != "/file/nri.sock" || cfg.Backend != "sim" || cfg.SharesPerGPU != 4 ||
		cfg.RediscoverInterval.Duration != 30*time.Second || cfg.Listen != "0.0.0.0:9999" || cfg.NodeName != "host-a" || cfg.DataDir != "/var/lib/tessera" {
		t.Errorf("merged config %+v", cfg)
	}
	for args, want := range map[string]string{
		"--backend=cuda":             `backend: Invalid value: must be nvml (a real NVIDIA driver) or sim (the simulated node), got "cuda"`,
		"--run-dir=relative":         `runDir: Invalid value: must be an absolute path, got "relative"`,
		"--listen=9400":              `listen: Invalid value: must be host:port`,
		"--rediscover-interval=10ms": "rediscoverInterval: Invalid value: must be at least 1s",
	} {
		if _, err := loadRunFlags(t, args); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: error %v, want %q", args, err, want)
		}
	}
}

func TestHealthFlags(t *testing.T) {
	cfgFile := filepath.Join(t.TempDir(), "node.yaml")
	os.WriteFile(cfgFile, []byte("apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\nignoredXIDs: [13, 94]\nhealthCheckInterval: 10s\n"), 0o644)
	load := func(args ...string) (*configv1.NodeConfig, error) { return loadRunFlags(t, args...) }
	for _, tc := range []struct {
		args     []string
		xids     []uint64
		interval time.Duration
	}{
		{nil, configv1.DefaultIgnoredXIDs, configv1.DefaultHealthCheckInterval},
		{[]string{"--config", cfgFile}, []uint64{13, 94}, 10 * time.Second},
		{[]string{"--config", cfgFile, "--ignored-xids=none", "--health-check-interval=2m"}, []uint64{}, 2 * time.Minute},
		{[]string{"--ignored-xids", "43, 79"}, []uint64{43, 79}, configv1.DefaultHealthCheckInterval},
	} {
		cfg, err := load(tc.args...)
		if err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		if !slices.Equal(cfg.IgnoredXIDs, tc.xids) || cfg.IgnoredXIDs == nil || cfg.HealthCheckInterval.Duration != tc.interval {
			t.Errorf("%v: ignored XIDs %v (want %v), interval %s (want %s)", tc.args, cfg.IgnoredXIDs, tc.xids, cfg.HealthCheckInterval.Duration, tc.interval)
		}
	}
	for args, want := range map[string]string{
		"--ignored-xids=13,x":           `"x" is not an XID`,
		"--ignored-xids=0":              "ignoredXIDs[0]: Invalid value: must be an XID between 1 and 999",
		"--health-check-interval=100ms": "healthCheckInterval: Invalid value: must be at least 1s",
	} {
		if _, err := load(args); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: error %v, want %q", args, err, want)
		}
	}
}

// loadRunFlags parses the flags of `tessera-node run` (on node host-a) as urfave/cli does and
// merges them with the config file they name.
func loadRunFlags(t *testing.T, args ...string) (*configv1.NodeConfig, error) {
	t.Helper()
	var f nodeFlags
	var cfg *configv1.NodeConfig
	var loadErr error
	cmd := command("t", "", append(f.flags(), f.runFlags("host-a")...), func(_ context.Context, cmd *cli.Command) error {
		cfg, loadErr = f.load(cmd)
		return nil
	})
	cmd.Writer, cmd.ErrWriter = io.Discard, io.Discard
	if err := cmd.Run(context.Background(), append([]string{"t"}, args...)); err != nil {
		t.Fatal(err)
	}
	return cfg, loadErr
}

// TestEnvVars: every flag is also an environment variable, TESSERA_NODE_<FLAG>; it beats the config
// file and loses to the command line.
func TestEnvVars(t *testing.T) {
	cfgFile := filepath.Join(t.TempDir(), "node.yaml")
	os.WriteFile(cfgFile, []byte("apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\ncdiDir: /from/file\nnriSocket: /file/nri.sock\nsharesPerGPU: 4\n"), 0o644)
	t.Setenv("TESSERA_NODE_CONFIG", cfgFile)
	t.Setenv("TESSERA_NODE_CDI_DIR", "/from/env")
	t.Setenv("TESSERA_NODE_SHARES_PER_GPU", "6")
	t.Setenv("TESSERA_NODE_HEALTH_CHECK_INTERVAL", "45s")
	t.Setenv("TESSERA_NODE_DRA", "true")
	t.Setenv("TESSERA_NODE_ADMIN_NAMESPACE", "monitoring")
	cfg, err := loadRunFlags(t, "--shares-per-gpu=8")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.CDIDir != "/from/env" || cfg.NRISocket != "/file/nri.sock" || cfg.SharesPerGPU != 8 ||
		cfg.HealthCheckInterval.Duration != 45*time.Second || !cfg.DRA || !slices.Equal(cfg.AdminNamespaces, []string{"monitoring"}) {
		t.Errorf("merged config %+v", cfg)
	}
}

// TestChartFlags parses the flags deploy/helm/tessera/templates/node-agent.yaml passes to
// `tessera-node run` (bare --dra, repeated --admin-namespace).
func TestChartFlags(t *testing.T) {
	cfg, err := loadRunFlags(t, "--backend=nvml", "--driver-root=/", "--container-driver-root=/driver-root",
		"--cdi-hook-path=/usr/bin/nvidia-cdi-hook", "--node-name=gpu-1", "--shares-per-gpu=10", "--cdi-dir=/var/run/cdi",
		"--vendor=tessera.dev", "--nri-socket=/var/run/nri/nri.sock", "--data-dir=/var/lib/tessera", "--run-dir=/run/tessera",
		"--device-plugin-dir=/var/lib/kubelet/device-plugins", "--pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock",
		"--vcuda-library=/usr/local/lib/tessera/libvcuda.so", "--hook-binary=/usr/local/lib/tessera/tessera-node",
		"--admin-namespace=monitoring", "--admin-namespace=a,b", "--listen=0.0.0.0:9445", "--dra",
		"--dra-registrar-dir=/var/lib/kubelet/plugins_registry", "--dra-plugin-dir=/var/lib/kubelet/plugins/gpu.tessera.dev")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.NodeName != "gpu-1" || cfg.ContainerDriverRoot != "/driver-root" || cfg.CDIDir != "/var/run/cdi" || !cfg.DRA ||
		!slices.Equal(cfg.AdminNamespaces, []string{"monitoring", "a,b"}) || cfg.Listen != "0.0.0.0:9445" || cfg.SharesPerGPU != 10 {
		t.Errorf("parsed %+v", cfg)
	}
}

// TestComputeGuardFlags: the computeGuard section's defaults, and the file and flags merge.
func TestComputeGuardFlags(t *testing.T) {
	cfg, err := loadRunFlags(t)
	if err != nil {
		t.Fatal(err)
	}
	c := cfg.ComputeGuard
	if !c.On() || c.Window.Duration != 10*time.Second || c.Grace.Duration != 20*time.Second || c.TolerancePercent != 15 || c.Action != "Kill" ||
		c.FeedbackInterval.Duration != 200*time.Millisecond {
		t.Errorf("defaults: %+v", c)
	}
	cfgFile := filepath.Join(t.TempDir(), "node.yaml")
	os.WriteFile(cfgFile, []byte("apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\ncomputeGuard:\n  window: 30s\n  action: Event\n  feedbackInterval: 1s\n"), 0o644)
	cfg, err = loadRunFlags(t, "--config", cfgFile, "--compute-guard-grace=1m")
	if err != nil {
		t.Fatal(err)
	}
	if c := cfg.ComputeGuard; !c.On() || c.Window.Duration != 30*time.Second || c.Grace.Duration != time.Minute || c.Action != "Event" ||
		c.FeedbackInterval.Duration != time.Second {
		t.Errorf("merged: %+v", c)
	}
	if cfg, err := loadRunFlags(t, "--compute-guard=false"); err != nil || cfg.ComputeGuard.On() {
		t.Errorf("--compute-guard=false: %+v %v", cfg.ComputeGuard, err)
	}
	// The feedback interval's bounds are accepted, past them refused with the field named.
	for _, ok := range []string{"50ms", "5s"} {
		if cfg, err := loadRunFlags(t, "--compute-guard-feedback-interval="+ok); err != nil || cfg.ComputeGuard.FeedbackInterval.Duration.String() != ok {
			t.Errorf("--compute-guard-feedback-interval=%s: %+v %v", ok, cfg, err)
		}
	}
	for _, bad := range []string{"49ms", "5001ms"} {
		want := "computeGuard.feedbackInterval: Invalid value: must be between 50ms"
		if _, err := loadRunFlags(t, "--compute-guard-feedback-interval="+bad); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("--compute-guard-feedback-interval=%s: error %v, want %q", bad, err, want)
		}
	}
}

// TestMemoryGuardFlags: the memoryGuard section and --host-proc merge like every other field:
// flag > TESSERA_NODE_* > config file > default, field by field inside the section.
func TestMemoryGuardFlags(t *testing.T) {
	cfg, err := loadRunFlags(t)
	if err != nil {
		t.Fatal(err)
	}
	m := cfg.MemoryGuard
	if !m.On() || m.Interval.Duration != time.Second || m.Grace.Duration != 3*time.Second || m.ToleranceBytes != 64<<20 ||
		m.TolerancePercent != 2 || cfg.HostProc != "/proc" {
		t.Errorf("defaults: %+v host-proc %q", m, cfg.HostProc)
	}
	cfgFile := filepath.Join(t.TempDir(), "node.yaml")
	os.WriteFile(cfgFile, []byte("apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\nmemoryGuard:\n  interval: 2s\n  grace: 10s\n  tolerancePercent: 5\n"), 0o644)
	t.Setenv("TESSERA_NODE_MEMORY_GUARD_GRACE", "20s")
	cfg, err = loadRunFlags(t, "--config", cfgFile, "--memory-guard-tolerance-bytes=1048576", "--host-proc=/host/proc")
	if err != nil {
		t.Fatal(err)
	}
	m = cfg.MemoryGuard
	if !m.On() || m.Interval.Duration != 2*time.Second || m.Grace.Duration != 20*time.Second || m.ToleranceBytes != 1<<20 ||
		m.TolerancePercent != 5 || cfg.HostProc != "/host/proc" {
		t.Errorf("merged: %+v host-proc %q", m, cfg.HostProc)
	}
	if cfg, err := loadRunFlags(t, "--memory-guard=false"); err != nil || cfg.MemoryGuard.On() {
		t.Errorf("--memory-guard=false: %v %v", cfg, err)
	}
	os.WriteFile(cfgFile, []byte("apiVersion: tessera.dev/v1\nkind: NodeAgentConfig\nmemoryGuard:\n  enabled: false\n"), 0o644)
	if cfg, err := loadRunFlags(t, "--config", cfgFile); err != nil || cfg.MemoryGuard.On() {
		t.Errorf("enabled: false in the file: %+v %v", cfg.MemoryGuard, err)
	}
	for args, want := range map[string]string{
		"--memory-guard-interval=10ms":          "memoryGuard.interval: Invalid value: must be between 100ms and 1m",
		"--memory-guard-grace=500ms":            "memoryGuard.grace: Invalid value: must be at least memoryGuard.interval",
		"--memory-guard-tolerance-bytes=-1":     "memoryGuard.toleranceBytes: Invalid value",
		"--host-proc=proc":                      `hostProc: Invalid value: must be an absolute path, got "proc"`,
		"--compute-guard-window=1s":             "computeGuard.window: Invalid value: must be at least twice memoryGuard.interval",
		"--compute-guard-grace=10ms":            "computeGuard.grace: Invalid value: must be at least memoryGuard.interval",
		"--compute-guard-tolerance-percent=101": "computeGuard.tolerancePercent: Invalid value: must be between 1 and 100",
		"--compute-guard-action=kill":           `computeGuard.action: Invalid value: must be Kill (the share's GPU processes) or Event`,
	} {
		if _, err := loadRunFlags(t, args); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: error %v, want %q", args, err, want)
		}
	}
}
