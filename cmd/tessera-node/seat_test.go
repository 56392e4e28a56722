package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	nriadapt "github.com/containerd/nri/pkg/adaptation"
	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/tessera-gpu/tessera/internal/agent"
	"github.com/tessera-gpu/tessera/internal/handover"
	"github.com/tessera-gpu/tessera/internal/nri"
	"github.com/tessera-gpu/tessera/internal/testing/simagent"
)

// seatNode is one node as two agents of a rolling update with maxSurge share it: containerd's NRI
// (NRI's own runtime adaptation on a socket), the run directory and the host network's metrics
// address.
type seatNode struct {
	t      *testing.T
	dir    string
	sock   string
	rt     *nriadapt.Adaptation
	agent  *agent.Agent
	listen string
	// registered and registerWait are the agents' device-plugin registration check and its wait
	// (default: registered at once).
	registered   func() bool
	registerWait time.Duration

	mu      sync.Mutex
	created map[string][]string // agent name -> container IDs its NRI plugin answered
	n       atomic.Int64
}

func newSeatNode(t *testing.T) *seatNode {
	dir, err := os.MkdirTemp("/tmp", "tsr-seat-") // short: the NRI socket's path must fit
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	n := &seatNode{t: t, dir: dir, sock: filepath.Join(dir, "nri.sock"), created: map[string][]string{}}
	n.rt, err = nriadapt.New("containerd", "2.2.9",
		func(ctx context.Context, cb nriadapt.SyncCB) error { _, err := cb(ctx, nil, nil); return err },
		func(context.Context, []*nriadapt.ContainerUpdate) ([]*nriadapt.ContainerUpdate, error) {
			return nil, nil
		},
		nriadapt.WithSocketPath(n.sock), nriadapt.WithPluginPath(filepath.Join(dir, "plugins")), nriadapt.WithPluginConfigPath(filepath.Join(dir, "conf")))
	if err != nil {
		t.Fatal(err)
	}
	if err := n.rt.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.rt.Stop)
	n.agent, _ = simagent.New(t, filepath.Join(dir, "agent"), agent.Config{})
	l, err := net.Listen("tcp", "127.0.0.1:0") // a free port, as the chart's metricsPort
	if err != nil {
		t.Fatal(err)
	}
	n.listen = l.Addr().String()
	l.Close()
	return n
}

// seatAgent is one node agent's seat duties: its NRI plugin and its /healthz, which names it.
type seatAgent struct {
	name       string
	plugin     *nri.Plugin
	handedOver chan struct{}
	done       chan error
	stop       context.CancelFunc
}

func (n *seatNode) start(name string) *seatAgent {
	t := n.t
	if n.registered == nil {
		n.registered = func() bool { return true }
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	plugin := nri.New(nri.Config{StateDir: filepath.Join(n.dir, "run"), Log: log,
		OnCreate: func(_ *nriapi.PodSandbox, c *nriapi.Container, _ time.Duration, refusal error) {
			if refusal == nil {
				n.mu.Lock()
				n.created[name] = append(n.created[name], c.GetId())
				n.mu.Unlock()
			}
		}}, n.agent, nil, nil)
	a := &seatAgent{name: name, plugin: plugin, handedOver: make(chan struct{}), done: make(chan error, 1)}
	d := &nodeDuties{seat: handover.Options{Dir: filepath.Join(n.dir, "run"), Name: name, Interval: 5 * time.Millisecond, Log: log},
		listen: n.listen,
		serve: func(ln net.Listener) *http.Server {
			mux := http.NewServeMux()
			mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, name) })
			srv := &http.Server{Handler: mux}
			go srv.Serve(ln)
			return srv
		},
		nri:        func(ctx context.Context) error { return plugin.Run(ctx, n.sock) },
		registered: n.registered, registerWait: n.registerWait,
		handedOver: func() { close(a.handedOver) },
		log:        log}
	ctx, cancel := context.WithCancel(context.Background())
	a.stop = cancel
	go func() { a.done <- d.run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-a.done:
			if err != nil {
				t.Errorf("%s: %v", name, err)
			}
		case <-time.After(waitTimeout):
			t.Errorf("%s: duties did not stop", name)
		}
	})
	return a
}

// create asks the runtime to create a plain container, as the kubelet would; NRI calls every
// connected plugin.
func (n *seatNode) create() (string, error) {
	id := fmt.Sprintf("c%d", n.n.Add(1))
	pod := &nriapi.PodSandbox{Id: "sb-" + id, Name: "p-" + id, Namespace: "ns", Uid: "uid-" + id}
	c := &nriapi.Container{Id: id, PodSandboxId: pod.Id, Name: "main", State: nriapi.ContainerState_CONTAINER_CREATED, Linux: &nriapi.LinuxContainer{}}
	_, err := n.rt.CreateContainer(context.Background(), &nriadapt.CreateContainerRequest{Pod: pod, Container: c})
	return id, err
}

func (n *seatNode) answeredBy(id string) []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	var who []string
	for name, ids := range n.created {
		for _, c := range ids {
			if c == id {
				who = append(who, name)
			}
		}
	}
	return who
}

// healthz is who answers the node's metrics address ("" when nobody does).
func (n *seatNode) healthz() string {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get("http://" + n.listen + "/healthz")
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

const waitTimeout = 20 * time.Second

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s did not happen within %v", what, waitTimeout)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestTwoNRIPluginsConflict is why the NRI plugin is a one-per-node duty: two Tessera plugins
// connected at once (two agents of a rolling update with maxSurge, without the seat) both set
// NVIDIA_VISIBLE_DEVICES, and NRI fails every container of the node.
func TestTwoNRIPluginsConflict(t *testing.T) {
	n := newSeatNode(t)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for range 2 {
		p := nri.New(nri.Config{StateDir: filepath.Join(n.dir, "run"), Log: log}, n.agent, nil, nil)
		go p.Run(ctx, n.sock)
		waitUntil(t, "the plugin connecting", p.Synced)
	}
	if _, err := n.create(); err == nil || !strings.Contains(err.Error(), "both tried to set") {
		t.Fatalf("a container with two Tessera plugins connected: %v, want NRI's conflict", err)
	}
}

// TestRollingUpdateHandsOverTheNodeDuties: the old agent holds the NRI plugin and the metrics port;
// a new agent starts beside it (maxSurge); the old one hands both over and stops its device
// plugins, the new one connects and answers the port. Containers created all the while are never
// refused for two Tessera plugins setting the same fields, each is answered by at most one agent,
// and after the handover only the new one answers. (A container in flight at the instant the old
// plugin disconnects is refused with the closed connection, and the kubelet retries it, as at any
// agent restart.)
func TestRollingUpdateHandsOverTheNodeDuties(t *testing.T) {
	n := newSeatNode(t)
	old := n.start("old")
	waitUntil(t, "the old agent connecting to NRI and serving /healthz", func() bool { return old.plugin.Synced() && n.healthz() == "old" })
	if id, err := n.create(); err != nil || strings.Join(n.answeredBy(id), ",") != "old" {
		t.Fatalf("container %s: %v, answered by %v, want the old agent alone", id, err, n.answeredBy(id))
	}

	// Containers keep coming during the handover.
	var refusedInFlight atomic.Int64
	stopCreating := make(chan struct{})
	creating := make(chan error, 1)
	go func() {
		for {
			select {
			case <-stopCreating:
				creating <- nil
				return
			default:
			}
			id, err := n.create()
			if err != nil && !strings.Contains(err.Error(), "ttrpc: closed") {
				creating <- fmt.Errorf("container %s during the handover: %w", id, err)
				return
			}
			if err != nil {
				// In flight when the old plugin disconnected: refused, and the kubelet retries it,
				// as at any agent restart.
				refusedInFlight.Add(1)
				continue
			}
			if who := n.answeredBy(id); len(who) > 1 {
				creating <- fmt.Errorf("container %s answered by %v during the handover", id, who)
				return
			}
		}
	}()

	updated := n.start("new")
	select {
	case <-old.handedOver:
	case <-time.After(waitTimeout):
		t.Fatal("the old agent did not hand over (its device plugins still run)")
	}
	waitUntil(t, "the new agent connecting to NRI and serving /healthz", func() bool { return updated.plugin.Synced() && n.healthz() == "new" })
	close(stopCreating)
	if err := <-creating; err != nil {
		t.Fatal(err)
	}
	t.Logf("containers created during the handover: %d, refused because in flight at the old plugin's disconnect: %d", n.n.Load()-1, refusedInFlight.Load())
	if old.plugin.Synced() {
		t.Error("the old agent's NRI plugin is still connected after the handover")
	}
	// The plugin reports itself synced inside its Synchronize, a moment before the runtime puts it
	// in its invocation order: a container created in that moment reaches no plugin (on a node, a
	// GPU container then fails the realisation hook; CreateContainer here has none). The first
	// container any agent answers must be the new one's, and so must the next.
	var first string
	waitUntil(t, "a container reaching an agent after the handover", func() bool {
		id, err := n.create()
		first = id
		return err == nil && len(n.answeredBy(id)) > 0
	})
	if who := strings.Join(n.answeredBy(first), ","); who != "new" {
		t.Fatalf("container %s after the handover answered by %v, want the new agent alone", first, who)
	}
	if id, err := n.create(); err != nil || strings.Join(n.answeredBy(id), ",") != "new" {
		t.Fatalf("container %s after the handover: %v, answered by %v, want the new agent alone", id, err, n.answeredBy(id))
	}

	// The old pod is deleted: the new agent goes on alone.
	old.stop()
	if err := <-old.done; err != nil {
		t.Fatalf("old agent: %v", err)
	}
	old.done <- nil // for the cleanup
	if id, err := n.create(); err != nil || strings.Join(n.answeredBy(id), ",") != "new" || n.healthz() != "new" {
		t.Fatalf("container %s after the old pod went: %v, answered by %v, /healthz %q", id, err, n.answeredBy(id), n.healthz())
	}
}

// TestHandoverToPodNetworkKeepsTheListener: a successor in its own network namespace (the chart's
// node.hostNetwork=false) gets the NRI plugin, but not this agent's metrics port, which it does not
// need: the old agent keeps answering its own pod's probes until it is stopped.
func TestHandoverToPodNetworkKeepsTheListener(t *testing.T) {
	n := newSeatNode(t)
	old := n.start("old")
	waitUntil(t, "the old agent connecting to NRI and serving /healthz", func() bool { return old.plugin.Synced() && n.healthz() == "old" })
	// The claim a successor in another network namespace writes (internal/handover's claim file:
	// its ID, then its namespace).
	if err := os.WriteFile(filepath.Join(n.dir, "run", "agent.seat"), []byte("successor/1/x\nnet:[1]\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	select {
	case <-old.handedOver:
	case <-time.After(waitTimeout):
		t.Fatal("the old agent did not hand over")
	}
	waitUntil(t, "the old agent's NRI plugin disconnecting", func() bool { return !old.plugin.Synced() })
	if who := n.healthz(); who != "old" {
		t.Errorf("after a handover to an agent in another network, /healthz answered by %q, want the old agent still", who)
	}
}

// TestFirstAgentServesAtOnce: with no agent holding the seat (a node's first agent, one restarted
// after a crash) the duties start without waiting for the device plugins to register: the wait is
// only for a handover, and on a node without a kubelet yet (the GPU bundle's guard phase) /metrics
// and NRI would otherwise stay down for the whole wait. Mutation: waiting whether or not the seat is
// held fails it.
func TestFirstAgentServesAtOnce(t *testing.T) {
	n := newSeatNode(t)
	n.registered = func() bool { return false }
	n.registerWait = time.Hour
	a := n.start("first")
	waitUntil(t, "the first agent serving /healthz and NRI while its device plugins are not registered", func() bool {
		return a.plugin.Synced() && n.healthz() == "first"
	})
}

// TestWaitRegisteredSchedule pins the wait for the device plugins' registration before a handover
// on a synctest bubble's clock: registered plugins are seen at once, without waiting; later ones at
// the next look (every registerPoll); plugins never registered hold the seat back registerWait and
// no longer; the context's end ends the wait at once.
func TestWaitRegisteredSchedule(t *testing.T) { synctest.Test(t, waitRegisteredSchedule) }

func waitRegisteredSchedule(t *testing.T) {
	var looks atomic.Int64 // synctest.Wait orders nothing for the race detector
	var ready atomic.Bool
	d := &nodeDuties{registered: func() bool { looks.Add(1); return ready.Load() }, registerWait: 10 * time.Second}
	wait := func(ctx context.Context, when string, wantTook time.Duration, wantLooks ...int64) {
		t.Helper()
		looks.Store(0)
		start := time.Now()
		done := make(chan time.Duration, 1)
		go func() {
			d.waitRegistered(ctx)
			done <- time.Since(start)
		}()
		select {
		case took := <-done:
			if took != wantTook {
				t.Errorf("%s: the wait took %v, want %v", when, took, wantTook)
			}
		case <-time.After(2 * d.registerWait):
			t.Fatalf("%s: still waiting after %v (registerWait %v)", when, 2*d.registerWait, d.registerWait)
		}
		if n := looks.Load(); n < wantLooks[0] || n > wantLooks[len(wantLooks)-1] {
			t.Errorf("%s: %d looks at the registration, want %v", when, n, wantLooks)
		}
	}
	ready.Store(true)
	wait(context.Background(), "registered already", 0, 1)
	ready.Store(false)
	go func() {
		time.Sleep(registerPoll*5/2 + registerPoll/10)
		ready.Store(true)
	}()
	wait(context.Background(), "registered 2.6 polls in", 3*registerPoll, 4)
	ready.Store(false)
	// The last look falls at registerWait or is cut by it: both end there.
	wait(context.Background(), "never registered", d.registerWait, int64(d.registerWait/registerPoll), int64(d.registerWait/registerPoll)+1)
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		time.Sleep(registerPoll * 5 / 2)
		cancel()
	}()
	wait(ctx, "stopped 2.5 polls in", registerPoll*5/2, 3)
}
