package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/fsatomic"
	"github.com/tessera-gpu/tessera/internal/gpu"
)

// Reasons of the Node events the agent records for GPU health changes.
const (
	EventGPUUnhealthy = "GPUUnhealthy"
	EventGPURecovered = "GPURecovered"
)

// healthState is the health file in the data dir: what was unhealthy, so that a restart does not
// declare a broken GPU good before a check has passed.
type healthState struct {
	APIVersion string            `json:"apiVersion"`
	Unhealthy  map[string]string `json:"unhealthy"`
}

// loadHealth reads the persisted health. A file that cannot be read makes every GPU suspect at the
// first Refresh (fail closed): they come back as soon as the health check passes.
func (a *Agent) loadHealth() {
	if a.cfg.HealthStatePath == "" {
		return
	}
	data, err := os.ReadFile(a.cfg.HealthStatePath)
	if errors.Is(err, os.ErrNotExist) {
		return
	}
	var st healthState
	if err == nil {
		err = api.DecodeYAML(data, &st, "GPU health state "+a.cfg.HealthStatePath)
	}
	if err == nil && st.APIVersion != api.Version {
		err = fmt.Errorf("GPU health state %s: apiVersion %q, want %q", a.cfg.HealthStatePath, st.APIVersion, api.Version)
	}
	if err != nil {
		a.log.Error("GPU health state unreadable: every GPU is unhealthy until its health check passes", "err", err)
		a.suspectAll = "health state unreadable after a restart (" + err.Error() + ")"
		return
	}
	maps.Copy(a.unhealthy, st.Unhealthy)
}

// saveHealthLocked persists the unhealthy set; a.mu is held.
func (a *Agent) saveHealthLocked() {
	if a.cfg.HealthStatePath == "" {
		return
	}
	data, err := json.MarshalIndent(healthState{APIVersion: api.Version, Unhealthy: a.unhealthy}, "", "  ")
	if err == nil {
		err = fsatomic.WriteFile(a.cfg.HealthStatePath, data, 0o600)
	}
	if err != nil {
		a.log.Error("persist GPU health; after a restart it would start from the last saved state", "path", a.cfg.HealthStatePath, "err", err)
	}
}

// suspectUnknownLocked applies an unreadable health state to the GPUs just discovered; a.mu is held.
func (a *Agent) suspectUnknownLocked(n *gpu.Node) {
	if a.suspectAll == "" {
		return
	}
	for _, g := range n.GPUs {
		if _, bad := a.unhealthy[g.UUID]; !bad {
			a.unhealthy[g.UUID] = a.suspectAll
		}
	}
	a.suspectAll = ""
	a.saveHealthLocked()
}

// WatchHealth keeps GPU health current until ctx ends: it starts from the persisted state, and
// every change is persisted, recorded as a Node event and passed on to the device plugins.
func (a *Agent) WatchHealth(ctx context.Context) error {
	opts := a.cfg.Health
	a.mu.RLock()
	opts.Unhealthy = maps.Clone(a.unhealthy)
	a.mu.RUnlock()
	return a.backend.WatchHealth(ctx, opts, a.healthChanged)
}

func (a *Agent) healthChanged(e gpu.HealthEvent) {
	a.mu.Lock()
	_, wasBad := a.unhealthy[e.UUID]
	if e.Healthy == !wasBad {
		a.mu.Unlock()
		return
	}
	if e.Healthy {
		delete(a.unhealthy, e.UUID)
	} else {
		a.unhealthy[e.UUID] = e.Reason
	}
	a.saveHealthLocked()
	what := a.describeLocked(e.UUID)
	a.mu.Unlock()
	if e.Healthy {
		a.log.Info("GPU healthy again", "uuid", e.UUID, "reason", e.Reason)
	} else {
		a.log.Warn("GPU unhealthy", "uuid", e.UUID, "reason", e.Reason)
	}
	if a.cfg.Recorder != nil {
		ref := NodeRef(a.cfg.NodeName)
		if e.Healthy {
			a.cfg.Recorder.Eventf(ref, corev1.EventTypeNormal, EventGPURecovered, "%s is healthy again: %s", what, e.Reason)
		} else {
			a.cfg.Recorder.Eventf(ref, corev1.EventTypeWarning, EventGPUUnhealthy, "%s is unhealthy: %s", what, e.Reason)
		}
	}
	a.notify()
	a.notifyInventory()
	if a.publish != nil {
		a.publish(a.Inventory())
	}
}

// NodeRef is the node as an Event's involved object (a Node's UID is its name as the kubelet
// records its own events, so kubectl describe node finds them).
func NodeRef(node string) *corev1.ObjectReference {
	return &corev1.ObjectReference{Kind: "Node", Name: node, UID: types.UID(node)}
}

// describeLocked names a GPU or MIG instance for people: "GPU 2 (GPU-...)"; a.mu is held.
func (a *Agent) describeLocked(uuid string) string {
	if a.node != nil {
		if g := a.node.GPUByUUID(uuid); g != nil {
			return fmt.Sprintf("GPU %d (%s, %s)", g.Index, g.Model, uuid)
		}
		if g, m := a.node.MIGByUUID(uuid); m != nil {
			return fmt.Sprintf("MIG %s on GPU %d (%s)", m.Profile, g.Index, uuid)
		}
	}
	return uuid
}
