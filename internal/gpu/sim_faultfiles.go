package gpu

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// FaultsDir is where a test outside the agent's process breaks the simulated GPUs: a file
// xid-<GPU or MIG UUID> holding an XID (decimal) raises that XID once, as Faults.InjectXID does, and
// is removed. Only the simulated node reads it, in its own state directory (root's, as the agent's),
// never a real one: the e2e suite uses it to fail a GPU under a running agent.
func FaultsDir(stateDir string) string { return filepath.Join(stateDir, "faults") }

// faultFilesInterval is how often the simulated node looks for fault files.
const faultFilesInterval = 200 * time.Millisecond

// watchFaultFiles raises the XIDs of fault files, looking once a faultFilesInterval, until ctx ends.
func (b *simBackend) watchFaultFiles(ctx context.Context, log *slog.Logger) {
	dir := FaultsDir(b.stateDir)
	_ = wait.PollUntilContextCancel(ctx, faultFilesInterval, false, func(context.Context) (bool, error) {
		names, err := os.ReadDir(dir)
		if err != nil {
			return false, nil // no fault written yet
		}
		for _, n := range names {
			uuid, ok := strings.CutPrefix(n.Name(), "xid-")
			if !ok {
				continue
			}
			path := filepath.Join(dir, n.Name())
			data, err := os.ReadFile(path)
			os.Remove(path)
			if err != nil {
				continue
			}
			xid, err := strconv.ParseUint(strings.TrimSpace(string(data)), 10, 64)
			if err == nil {
				err = b.InjectXID(uuid, xid)
			}
			if err != nil {
				log.Warn("simulated node: fault file not applied", "file", path, "err", err)
				continue
			}
			log.Info("simulated node: XID injected from a fault file", "uuid", uuid, "xid", xid)
		}
		return false, nil
	})
}
