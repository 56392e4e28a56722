package e2e

import (
	"os"
	"testing"
)

// TestMain removes the commands built for this run (a few hundred MB) when the tests end.
func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}
