package deviceplugin

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// Options configures a Manager. The zero value serves in the kubelet's standard directory.
type Options struct {
	// PluginDir is the kubelet's device-plugin directory, where the plugin sockets are created.
	// Default: /var/lib/kubelet/device-plugins.
	PluginDir string
	// KubeletSocket is the kubelet's registration socket. Default: PluginDir/kubelet.sock. The
	// kubelet looks for a plugin's socket in its own directory, so it must be PluginDir's.
	KubeletSocket string
	// PreferredAllocation says for which resources the kubelet should ask GetPreferredAllocation.
	// Default: DefaultPreferredAllocation.
	PreferredAllocation func(resource string) bool
	// PollInterval is how often the sockets are checked even without a directory event, the safety
	// net for missed or unavailable inotify events. Default: 2 s.
	PollInterval time.Duration
	// Logger receives structured logs (nil: discarded).
	Logger *slog.Logger
	// ObserveAllocate, when set, is told how long each kubelet Allocate call of a resource took and
	// its error (the node agent's latency histogram).
	ObserveAllocate func(resource string, took time.Duration, err error)
	// SocketTag ends every socket's name (tessera-<resource>-<tag>.sock). Default: a new one per
	// process start, so that a restarted agent never registers an endpoint path the kubelet may still
	// hold for its predecessor. kubelet 1.37 refuses a registration whose socket path it already has
	// connected ("device plugin already connected"), and drops its client for that path when the
	// refused attempt fails, so the predecessor's endpoint is never disconnected and every retry is
	// refused until the kubelet restarts (seen after a kill -9 of the agent in the e2e suite).
	SocketTag string
}

// DefaultPreferredAllocation asks for preferred allocations only for hardware-bound devices (MIG
// instances, mdev vGPUs), whose IDs are real devices with topology. nvidia.com/gpu and
// tessera.dev/vgpu are fungible tokens counted by the kubelet; which GPU a container gets is
// decided by the extender and realised by the NRI plugin, so a kubelet preference would mean nothing.
func DefaultPreferredAllocation(resource string) bool {
	return strings.HasPrefix(resource, api.MIGResourcePrefix) || strings.HasPrefix(resource, api.MdevResourcePrefix)
}

// Manager runs one device plugin per resource of a Source and keeps each registered with the
// kubelet, across kubelet restarts and changes of the resource set. It calls the Source's methods
// from several goroutines at once (gRPC handlers and its own loop), and is the only reader of
// Source.Changed.
type Manager struct {
	src  Source
	opts Options
	log  *slog.Logger

	// watch reports directory changes; tests replace it to exercise polling alone.
	watch func(ctx context.Context, dir string, log *slog.Logger) (<-chan struct{}, error)

	mu      sync.Mutex
	plugins map[string]*managed // by resource; written only by Run's goroutine
}

type managed struct {
	plugin *plugin
	cancel context.CancelFunc
}

// NewManager returns a Manager for src; Run starts it.
func NewManager(src Source, opts Options) *Manager {
	if opts.PluginDir == "" {
		opts.PluginDir = pluginapi.DevicePluginPath
	}
	opts.PluginDir = filepath.Clean(opts.PluginDir)
	if opts.KubeletSocket == "" {
		opts.KubeletSocket = filepath.Join(opts.PluginDir, filepath.Base(pluginapi.KubeletSocket))
	}
	if opts.PreferredAllocation == nil {
		opts.PreferredAllocation = DefaultPreferredAllocation
	}
	if opts.PollInterval <= 0 {
		opts.PollInterval = 2 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.SocketTag == "" {
		opts.SocketTag = strconv.FormatInt(time.Now().UnixNano(), 36)
	}
	return &Manager{
		src:     src,
		opts:    opts,
		log:     opts.Logger.With("component", "deviceplugin"),
		watch:   watchDir,
		plugins: make(map[string]*managed),
	}
}

// Registered reports, per served resource, whether it is registered with the current kubelet, for
// the node agent's /healthz. A resource missing from the map is not served at all.
func (m *Manager) Registered() map[string]bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make(map[string]bool, len(m.plugins))
	for r, mp := range m.plugins {
		out[r] = mp.plugin.registered.Load()
	}
	return out
}

// Run serves until ctx ends, then stops every server and removes its socket before returning.
// Registration failures are logged and retried, never returned: the kubelet may start after us.
func (m *Manager) Run(ctx context.Context) error {
	if err := os.MkdirAll(m.opts.PluginDir, 0o750); err != nil {
		return fmt.Errorf("device plugin directory: %w", err)
	}
	defer m.stopAll()

	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	dirChanged, err := m.watch(watchCtx, filepath.Dir(m.opts.KubeletSocket), m.log)
	if err != nil {
		// Polling alone still notices a kubelet restart, a little later.
		m.log.Warn("cannot watch the device plugin directory; polling only", "err", err, "interval", m.opts.PollInterval)
	}
	// A ticker in the one select, not wait.Until: the poll, the Source's changes and the
	// directory's events all run on this goroutine, which alone writes m.plugins.
	poll := time.NewTicker(m.opts.PollInterval)
	defer poll.Stop()

	kubelet := statID(m.opts.KubeletSocket)
	m.log.Info("device plugin manager starting", "dir", m.opts.PluginDir, "kubelet_socket", m.opts.KubeletSocket,
		"kubelet_present", kubelet != fileID{})
	m.reconcile(ctx)

	for {
		select {
		case <-ctx.Done():
			m.log.Info("device plugin manager stopping")
			return nil
		case <-m.src.Changed():
			m.reconcile(ctx)
		case _, ok := <-dirChanged:
			if !ok {
				dirChanged = nil // the watch ended; polling carries on
				continue
			}
			kubelet = m.checkSockets(kubelet)
		case <-poll.C:
			kubelet = m.checkSockets(kubelet)
		}
	}
}

// reconcile starts a plugin for each new resource, stops those the Source no longer lists, and
// refreshes the device lists of the rest. Only Run's goroutine writes m.plugins, so it reads the
// map without the lock; the lock guards writes against Registered, and is never held across a
// call into the Source (which may take its own locks).
func (m *Manager) reconcile(ctx context.Context) {
	want := make(map[string]bool)
	for _, r := range m.src.Resources() {
		want[r] = true
	}
	for r, mp := range m.plugins {
		if !want[r] {
			m.log.Info("resource no longer offered: stopping its device plugin", "resource", r)
			m.mu.Lock()
			delete(m.plugins, r)
			m.mu.Unlock()
			mp.cancel()
			<-mp.plugin.done
		}
	}
	for _, r := range slices.Sorted(maps.Keys(want)) {
		if mp, ok := m.plugins[r]; ok {
			mp.plugin.server.refresh()
			continue
		}
		log := m.log.With("resource", r)
		srv := newServer(r, m.src, m.opts.PreferredAllocation(r), log)
		srv.observe = m.opts.ObserveAllocate
		p := newPlugin(srv, m.opts.PluginDir, m.opts.SocketTag, m.opts.KubeletSocket, log)
		pctx, cancel := context.WithCancel(ctx)
		m.mu.Lock()
		m.plugins[r] = &managed{plugin: p, cancel: cancel}
		m.mu.Unlock()
		log.Info("starting device plugin", "preferred_allocation", srv.preferred)
		go p.run(pctx)
	}
}

// checkSockets looks at the directory after an event or a poll tick: a kubelet.sock that is new
// (by identity) means the kubelet restarted and every plugin must register again; otherwise each
// plugin checks that its own socket is still there. It returns the kubelet socket identity now seen.
func (m *Manager) checkSockets(last fileID) fileID {
	now := statID(m.opts.KubeletSocket)
	switch {
	case now == last:
		for _, mp := range m.plugins {
			mp.plugin.checkSocket()
		}
	case now == fileID{}:
		m.log.Warn("kubelet socket gone; waiting for the kubelet to come back", "kubelet_socket", m.opts.KubeletSocket)
		for _, mp := range m.plugins {
			mp.plugin.registered.Store(false)
			mp.plugin.checkSocket()
		}
	default:
		// The restart recreates every socket, so no separate socket check is needed.
		m.log.Info("kubelet socket (re)created: registering every resource again", "kubelet_socket", m.opts.KubeletSocket)
		for _, mp := range m.plugins {
			mp.plugin.kubeletRestarted()
		}
	}
	return now
}

func (m *Manager) stopAll() {
	m.mu.Lock()
	all := slices.Collect(maps.Values(m.plugins))
	clear(m.plugins)
	m.mu.Unlock()
	for _, mp := range all {
		mp.cancel()
	}
	for _, mp := range all {
		<-mp.plugin.done
	}
}
