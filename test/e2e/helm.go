package e2e

import (
	"path/filepath"
	"testing"
	"time"
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
