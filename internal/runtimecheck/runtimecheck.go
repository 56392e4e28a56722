// Package runtimecheck says, at the node agent's start, when the container runtime lacks what
// Tessera needs, neither of which the kubelet sees: with NRI off no GPU container can start (the CDI
// specs' realisation hook refuses every one the NRI plugin did not realise), and with CDI off, or
// off the agent's CDI directory, containerd drops the CDI names the device plugins and DRA hand out,
// so a pod granted a GPU runs without it. Each finding is a Warning log line and a Warning Event on
// the Node naming the setting to change.
//
// NRI is judged by the plugin itself: no Synchronize from the runtime within NRIGrace. That is the
// one signal that covers every cause (NRI disabled, another socket_path, a registration refused)
// without reading containerd's configuration, which the agent's container does not have and which
// may be split over imports and defaults. CDI is judged by the configuration containerd runs with,
// as its CRI Status (verbose) reports it ("config": enableCDI, cdiSpecDirs, in containerd 1.7 and
// 2.x alike): what containerd decided after defaults, drop-ins and its version's rules, not what a
// file says.
package runtimecheck

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/record"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/tessera-gpu/tessera/internal/agent"
)

// Events of the runtime check: the runtime lacks what Tessera needs, the message names the setting.
const (
	EventNRIUnavailable = "NRIUnavailable"
	EventCDIUnavailable = "CDIUnavailable"
)

// NRIGrace is how long after start the NRI plugin may take to be synchronised with the runtime
// before the runtime check reports NRI missing (containerd registers a plugin within its
// plugin_registration_timeout, 5 s by default).
const NRIGrace = 30 * time.Second

// NRIProblem says what is wrong when the plugin is not synchronised after waiting; "" when it is.
func NRIProblem(socket string, synced bool, waited time.Duration) string {
	if synced {
		return ""
	}
	const fix = "set [plugins.'io.containerd.nri.v1.nri'] disable = false and socket_path = '%s' in containerd's config (containerd 2.x has it on by default, 1.7 off) and restart containerd; until then no GPU container starts on this node"
	if _, err := os.Stat(socket); errors.Is(err, fs.ErrNotExist) {
		return fmt.Sprintf("containerd's NRI is off or listens elsewhere: no NRI socket at %s; "+fix, socket, socket)
	}
	return fmt.Sprintf("the runtime has not synchronised with Tessera's NRI plugin on %s in %s (is NRI enabled? see containerd's log for plugin \"tessera\"); "+fix, socket, waited, socket)
}

// criConfig is what containerd's CRI Status (verbose) reports in info["config"] that matters here.
type criConfig struct {
	EnableCDI   *bool    `json:"enableCDI"`
	CDISpecDirs []string `json:"cdiSpecDirs"`
}

// CDIProblem reads the runtime's verbose CRI status info and says what is wrong for CDI specs
// written to cdiDir: "" when nothing is. known is false when the info does not say (a runtime that
// is not containerd), so nothing can be concluded.
func CDIProblem(info map[string]string, cdiDir string) (problem string, known bool, err error) {
	raw, ok := info["config"]
	if !ok {
		return "", false, nil
	}
	var c criConfig
	if err := json.Unmarshal([]byte(raw), &c); err != nil {
		return "", false, fmt.Errorf("the runtime's CRI status config: %w", err)
	}
	if c.EnableCDI == nil {
		return "", false, nil
	}
	const where = "in [plugins.'io.containerd.cri.v1.runtime'] of containerd's config ([plugins.\"io.containerd.grpc.v1.cri\"] in 1.7) and restart containerd; until then containers granted GPUs start without them"
	if !*c.EnableCDI {
		return "containerd has CDI off (enableCDI false): set enable_cdi = true " + where, true, nil
	}
	if !slices.ContainsFunc(c.CDISpecDirs, func(d string) bool { return filepath.Clean(d) == filepath.Clean(cdiDir) }) {
		return fmt.Sprintf("containerd reads CDI specs from %v, not from %s where tessera-node writes them: add '%s' to cdi_spec_dirs %s", c.CDISpecDirs, cdiDir, cdiDir, where), true, nil
	}
	return "", true, nil
}

// CRIStatusInfo asks the runtime at socket for its verbose status info.
func CRIStatusInfo(ctx context.Context, socket string) (map[string]string, error) {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("CRI socket %s: %w", socket, err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	resp, err := runtimeapi.NewRuntimeServiceClient(conn).Status(ctx, &runtimeapi.StatusRequest{Verbose: true})
	if err != nil {
		return nil, fmt.Errorf("CRI Status on %s: %w", socket, err)
	}
	return resp.GetInfo(), nil
}

// Check is the start-up check of the runtime's NRI and CDI.
type Check struct {
	Node, NRISocket, CRISocket, CDIDir string
	// Synced says whether the NRI plugin is synchronised with the runtime.
	Synced func() bool
	Events record.EventRecorder // nil: log only
	Log    *slog.Logger
	// After waits before the NRI verdict (time.After; tests pass one that returns at once).
	After func(time.Duration) <-chan time.Time
}

// Run checks CDI at once and NRI after NRIGrace, reporting what it finds, then returns.
func (r *Check) Run(ctx context.Context) {
	r.checkCDI(ctx)
	select {
	case <-ctx.Done():
		return
	case <-r.After(NRIGrace):
	}
	if p := NRIProblem(r.NRISocket, r.Synced(), NRIGrace); p != "" {
		r.warn(EventNRIUnavailable, p)
		return
	}
	r.Log.Info("NRI check: the plugin is synchronised with the runtime", "nriSocket", r.NRISocket)
}

func (r *Check) checkCDI(ctx context.Context) {
	if _, err := os.Stat(r.CRISocket); errors.Is(err, fs.ErrNotExist) {
		r.Log.Info("CDI check skipped: no CRI socket (mount the runtime's socket and set --cri-socket to check)", "criSocket", r.CRISocket)
		return
	}
	info, err := CRIStatusInfo(ctx, r.CRISocket)
	if err != nil {
		r.Log.Warn("CDI check: cannot ask the runtime", "err", err)
		return
	}
	p, known, err := CDIProblem(info, r.CDIDir)
	switch {
	case err != nil:
		r.Log.Warn("CDI check: cannot read the runtime's status", "err", err)
	case !known:
		r.Log.Info("CDI check: the runtime's CRI status does not say whether CDI is on (not containerd?)", "criSocket", r.CRISocket)
	case p != "":
		r.warn(EventCDIUnavailable, p)
	default:
		r.Log.Info("CDI check: containerd has CDI on and reads the CDI directory", "cdiDir", r.CDIDir)
	}
}

func (r *Check) warn(reason, msg string) {
	r.Log.Warn(msg, "reason", reason)
	if r.Events != nil {
		r.Events.Event(agent.NodeRef(r.Node), corev1.EventTypeWarning, reason, msg)
	}
}
