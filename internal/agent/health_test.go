package agent_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/agent"
	"github.com/tessera-gpu/tessera/internal/gpu"
	"github.com/tessera-gpu/tessera/internal/testing/simagent"
)

// injectXID raises an XID once the agent's health watch has registered for it (before that the
// driver, and the sim, deliver it to nobody).
func injectXID(t *testing.T, b gpu.Backend, uuid string, xid uint64) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 10*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		err := b.(gpu.Faults).InjectXID(uuid, xid)
		if errors.Is(err, gpu.ErrNotWatched) {
			return false, nil
		}
		return err == nil, err
	})
	if err != nil {
		t.Fatalf("inject XID %d on %s: %v", xid, uuid, err)
	}
}

// healthAgent is an agent on the simulated node with its health persisted in dir.
func healthAgent(t *testing.T, dir string, b gpu.Backend, cfg agent.Config) *agent.Agent {
	t.Helper()
	cfg.HealthStatePath = filepath.Join(dir, "health.json")
	return simagent.Agent(t, dir, b, cfg)
}

// nodeEvents waits until the fake API server holds n events about the Node, and returns them.
func nodeEvents(t *testing.T, client *fake.Clientset, n int) []corev1.Event {
	t.Helper()
	var events []corev1.Event
	err := wait.PollUntilContextTimeout(context.Background(), 10*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := client.CoreV1().Events(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		events = list.Items
		return len(events) >= n, nil
	})
	if err != nil {
		t.Fatalf("waiting for %d Node events, have %+v: %v", n, events, err)
	}
	return events
}

// TestHealthEventsAndRecovery runs the agent's health watch on the simulated node: an XID makes
// the GPU unhealthy with a Warning event on the Node naming the XID; once the GPU has been quiet
// for a check interval and its probe passes it is healthy again, with a Normal event.
func TestHealthEventsAndRecovery(t *testing.T) { synctest.Test(t, healthEventsAndRecovery) }

// healthEventsAndRecovery runs in a synctest bubble: the check interval and the waits for the XID
// to be watched and for the events pass on the bubble's clock, at once.
func healthEventsAndRecovery(t *testing.T) {
	dir := t.TempDir()
	b := simagent.Backend(t, dir)
	client := fake.NewClientset()
	rec, stop := agent.NewEventRecorder(client, "node-a")
	defer stop()
	a := healthAgent(t, dir, b, agent.Config{Recorder: rec, Health: gpu.HealthOptions{CheckInterval: 20 * time.Millisecond}})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.WatchHealth(ctx) }()
	defer func() { cancel(); <-done }() // nothing may outlive the bubble
	uuid := a.Inventory().GPUs[2].UUID
	injectXID(t, b, uuid, 79)

	events := nodeEvents(t, client, 2)
	var warn, normal corev1.Event
	for _, e := range events {
		switch e.Reason {
		case agent.EventGPUUnhealthy:
			warn = e
		case agent.EventGPURecovered:
			normal = e
		}
	}
	if warn.Type != corev1.EventTypeWarning || warn.Reason != agent.EventGPUUnhealthy || !strings.Contains(warn.Message, "GPU 2 (") ||
		!strings.Contains(warn.Message, uuid) || !strings.Contains(warn.Message, "XID 79") {
		t.Errorf("unhealthy event %s %s %q", warn.Type, warn.Reason, warn.Message)
	}
	if normal.Type != corev1.EventTypeNormal || normal.Reason != agent.EventGPURecovered || !strings.Contains(normal.Message, uuid) {
		t.Errorf("recovery event %s %s %q", normal.Type, normal.Reason, normal.Message)
	}
	for _, e := range events {
		if e.InvolvedObject.Kind != "Node" || e.InvolvedObject.Name != "node-a" || e.Source.Component != "tessera-node" {
			t.Errorf("event about %+v from %+v", e.InvolvedObject, e.Source)
		}
	}
	if !a.Inventory().GPUs[2].Healthy {
		t.Error("inventory still says GPU 2 is unhealthy after the recovery event")
	}
}

// TestHealthPersistsAcrossRestart: an unhealthy GPU is still unhealthy in the first inventory of a
// restarted agent, before any health check; an unreadable state file makes every GPU suspect.
func TestHealthPersistsAcrossRestart(t *testing.T) {
	dir := t.TempDir()
	b := simagent.Backend(t, dir)
	a := healthAgent(t, dir, b, agent.Config{})
	bad := a.Inventory().GPUs[4].UUID
	a.HealthChanged(gpu.HealthEvent{UUID: bad, Reason: "XID 79", XID: 79})

	restarted := healthAgent(t, dir, b, agent.Config{})
	for _, g := range restarted.Inventory().GPUs {
		if g.Healthy == (g.UUID == bad) {
			t.Errorf("after restart GPU %d healthy=%v", g.Index, g.Healthy)
		}
	}
	if got := len(healthy(restarted.Devices(api.ResourceGPU))); got != 5 {
		t.Errorf("whole tokens healthy after restart: %d, want 5 (GPU 4 still out)", got)
	}
	// Recovered GPUs are saved as such.
	restarted.HealthChanged(gpu.HealthEvent{UUID: bad, Healthy: true, Reason: "periodic check passed"})
	again := healthAgent(t, dir, b, agent.Config{})
	if !again.Inventory().GPUs[4].Healthy {
		t.Error("a recovered GPU came back unhealthy after a restart")
	}

	if err := os.WriteFile(filepath.Join(dir, "health.json"), []byte("{not json"), 0o644); err != nil {
		t.Fatal(err)
	}
	corrupt := healthAgent(t, dir, b, agent.Config{})
	for _, g := range corrupt.Inventory().GPUs {
		if g.Healthy {
			t.Errorf("GPU %d healthy although the health state was unreadable", g.Index)
		}
	}
}

// TestWatchInventoryFiresOnHealthAndRefresh: the DRA driver republishes its slices when told, so
// every health change and every rediscovery must tell it (coalesced), and a repeated report of an
// unchanged health must not; Unhealthy carries the reason for the slices' taints.
func TestWatchInventoryFiresOnHealthAndRefresh(t *testing.T) {
	dir := t.TempDir()
	a := healthAgent(t, dir, simagent.Backend(t, dir), agent.Config{})
	ch := a.WatchInventory()
	fired := func() bool {
		select {
		case <-ch:
			return true
		default:
			return false
		}
	}
	fired() // the first Refresh, if it came after the watch
	bad := a.Inventory().GPUs[1].UUID
	a.HealthChanged(gpu.HealthEvent{UUID: bad, Reason: "XID 79", XID: 79})
	if !fired() {
		t.Error("a GPU turning unhealthy did not fire WatchInventory")
	}
	if why := a.Unhealthy()[bad]; why != "XID 79" {
		t.Errorf("Unhealthy()[%s] = %q, want the reason", bad, why)
	}
	a.HealthChanged(gpu.HealthEvent{UUID: bad, Reason: "XID 79 again", XID: 79})
	if fired() {
		t.Error("an unchanged health fired WatchInventory")
	}
	a.HealthChanged(gpu.HealthEvent{UUID: bad, Healthy: true, Reason: "periodic check passed"})
	if !fired() {
		t.Error("a recovery did not fire WatchInventory")
	}
	if err := a.Refresh(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !fired() {
		t.Error("a rediscovery did not fire WatchInventory")
	}
}
