package deviceplugin

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// plugin is the life of one resource's endpoint: its socket, the gRPC server on it, and its
// registration with the kubelet. One goroutine (run) owns the socket and the server, so restarts,
// socket checks and retries never interleave; Register calls run beside it and report back to it.
type plugin struct {
	server        *server
	socketPath    string
	kubeletSocket string
	log           *slog.Logger

	registered atomic.Bool
	restartCh  chan struct{} // the kubelet restarted: serve anew and register again
	checkCh    chan struct{} // the directory changed: is our socket still there?
	done       chan struct{} // closed when run returns

	// Owned by run.
	grpc     *grpc.Server
	socketID fileID
}

func newPlugin(srv *server, dir, tag, kubeletSocket string, log *slog.Logger) *plugin {
	path := filepath.Join(dir, socketName(srv.resource, tag))
	return &plugin{
		server:        srv,
		socketPath:    path,
		kubeletSocket: kubeletSocket,
		log:           log.With("socket", path),
		restartCh:     make(chan struct{}, 1),
		checkCh:       make(chan struct{}, 1),
		done:          make(chan struct{}),
	}
}

// socketName derives the socket's file name from the resource name and the process's tag, e.g.
// nvidia.com/gpu, tag x1 -> tessera-nvidia.com_gpu-x1.sock: distinct per resource and per agent
// start (Options.SocketTag), and recognisably ours among other vendors' plugins in the shared
// directory. Without a tag: tessera-nvidia.com_gpu.sock (what agents before tags used).
func socketName(resource, tag string) string {
	name := socketStem(resource)
	if tag != "" {
		name += "-" + tag
	}
	return name + ".sock"
}

// socketStem is the part of resource's socket names that does not change from start to start.
func socketStem(resource string) string {
	return "tessera-" + strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '.', r == '-':
			return r
		}
		return '_'
	}, resource)
}

// removeStaleSockets removes the sockets of this resource that earlier agents left (killed, they
// could not remove their own) and that nobody serves any more: a socket that accepts a connection
// belongs to a live agent (one being replaced) and stays.
func (p *plugin) removeStaleSockets() {
	stem := socketStem(p.server.resource)
	dir := filepath.Dir(p.socketPath)
	for _, pattern := range []string{stem + ".sock", stem + "-*.sock"} {
		matches, _ := filepath.Glob(filepath.Join(dir, pattern))
		for _, m := range matches {
			if m == p.socketPath {
				continue
			}
			// A tag never contains '-' (base 36), so a longer resource name sharing our stem is not matched.
			if tag := strings.TrimSuffix(strings.TrimPrefix(filepath.Base(m), stem), ".sock"); strings.Contains(strings.TrimPrefix(tag, "-"), "-") {
				continue
			}
			if c, err := net.DialTimeout("unix", m, 200*time.Millisecond); err == nil {
				c.Close()
				continue
			}
			if err := os.Remove(m); err == nil {
				p.log.Info("removed a socket an earlier agent left", "stale", m)
			}
		}
	}
}

// signal sends a coalesced, non-blocking notification.
func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

func (p *plugin) kubeletRestarted() { p.registered.Store(false); signal(p.restartCh) }
func (p *plugin) checkSocket()      { signal(p.checkCh) }

// regResult is the outcome of one registration attempt; gen tells a current attempt from one a
// restart has superseded.
type regResult struct {
	gen int
	err error
}

// run serves and registers until ctx ends, then stops the server and removes the socket.
//
// Register runs in its own goroutine: the kubelet dials our socket back inside the call and may
// wait up to 10 s for it (for instance when the socket was deleted meanwhile), and the loop must
// stay free to notice that and start over rather than wait it out.
func (p *plugin) run(ctx context.Context) {
	defer close(p.done)
	defer p.stopServing()

	var (
		bo        = registrationBackoff()
		failures  int // since the last success or restart
		gen       int
		cancelReg = context.CancelFunc(func() {})
		results   = make(chan regResult)
		retry     = time.NewTimer(0)
	)
	retry.Stop()
	defer func() { cancelReg(); retry.Stop() }()

	attempt := func() {
		retry.Stop()
		cancelReg()
		gen++
		// A kubelet told to dial a socket that is gone would hang the registration: serve anew first.
		if p.grpc != nil && statID(p.socketPath) != p.socketID {
			p.stopServing()
		}
		if p.grpc == nil {
			if err := p.serve(); err != nil {
				wait := bo.Step()
				failures++
				p.log.Error("cannot serve device plugin socket; retrying", "err", err, "retry_in", wait)
				retry.Reset(wait)
				return
			}
		}
		rctx, cancel := context.WithCancel(ctx)
		cancelReg = cancel
		g := gen
		go func() {
			err := register(rctx, p.kubeletSocket, filepath.Base(p.socketPath), p.server.resource, p.server.options())
			select {
			case results <- regResult{gen: g, err: err}:
			case <-ctx.Done():
			}
		}()
	}

	attempt()
	for {
		select {
		case <-ctx.Done():
			return
		case r := <-results:
			if r.gen != gen {
				continue // superseded by a restart
			}
			if r.err != nil {
				wait := bo.Step()
				failures++
				p.log.Warn("registration with the kubelet failed; retrying", "err", r.err, "attempt", failures, "retry_in", wait)
				retry.Reset(wait)
				continue
			}
			bo, failures = registrationBackoff(), 0
			p.registered.Store(true)
			p.log.Info("registered with the kubelet", "kubelet_socket", p.kubeletSocket)
		case <-p.restartCh:
			p.log.Info("kubelet restarted: recreating socket and registering again")
			p.restart()
			bo, failures = registrationBackoff(), 0
			attempt()
		case <-p.checkCh:
			if len(p.restartCh) > 0 {
				continue // a queued restart recreates the socket anyway; one registration is enough
			}
			if p.grpc != nil && statID(p.socketPath) != p.socketID {
				// The kubelet wipes the directory when it starts; without our socket it cannot
				// reach us even if it still has us registered.
				p.log.Info("socket removed or replaced: recreating it and registering again")
				p.restart()
				bo, failures = registrationBackoff(), 0
				attempt()
			}
		case <-retry.C:
			attempt()
		}
	}
}

// restart drops the current server so the next attempt serves on a fresh socket; the caller starts
// the backoff over because the cause (a new kubelet) is likely gone now.
func (p *plugin) restart() {
	p.registered.Store(false)
	p.stopServing()
}

// serve listens on the socket and starts the gRPC server on it.
func (p *plugin) serve() error {
	p.removeStaleSockets()
	// A socket left by an earlier run (or another process using our name) would make Listen fail.
	if err := os.Remove(p.socketPath); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove stale socket %s: %w", p.socketPath, err)
	}
	// sun_path holds 108 bytes including the terminating NUL; say so rather than "invalid argument".
	if len(p.socketPath) > 107 {
		return fmt.Errorf("socket path %s is %d bytes, longer than a unix socket allows (107)", p.socketPath, len(p.socketPath))
	}
	lis, err := net.Listen("unix", p.socketPath)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", p.socketPath, err)
	}
	// We remove the socket ourselves, and only if it is still ours: Go's unlink-on-close would
	// delete whatever file has the name by then.
	lis.(*net.UnixListener).SetUnlinkOnClose(false)
	p.socketID = statID(p.socketPath)
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p.server)
	go func() {
		if err := srv.Serve(lis); err != nil {
			p.log.Error("device plugin gRPC server stopped", "err", err)
		}
	}()
	p.grpc = srv
	p.log.Debug("serving")
	return nil
}

// stopServing stops the gRPC server (ending ListAndWatch streams) and removes the socket if the
// file is still the one we created.
func (p *plugin) stopServing() {
	if p.grpc == nil {
		return
	}
	p.grpc.Stop()
	p.grpc = nil
	p.registered.Store(false)
	if id := statID(p.socketPath); id != (fileID{}) && id == p.socketID {
		if err := os.Remove(p.socketPath); err != nil && !errors.Is(err, fs.ErrNotExist) {
			p.log.Warn("cannot remove socket", "err", err)
		}
	}
	p.socketID = fileID{}
}
