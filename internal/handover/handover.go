// Package handover passes a node's one-per-node duties from a running node agent to its successor,
// so that a DaemonSet rolling update with maxSurge can run two agents on one node at once.
//
// Two duties must never run twice: the NRI plugin (two plugins named tessera both set
// NVIDIA_VISIBLE_DEVICES on every container, and NRI fails a container whose field two plugins set,
// so every container of the node would be refused) and, when both agents share the node's network,
// the metrics port. The holder of the seat runs them. The seat is an exclusive flock on
// <dir>/agent.seat.lock, so the kernel frees it the moment its holder dies (kill -9 included), and
// a claim file <dir>/agent.seat names the newest agent that asked for it: the holder polls the
// claim, and once it names another agent it stops its duties and lets go. The newest agent wins,
// as a DaemonSet rolling update wants: the new agent takes over as soon as it starts, so its own
// readiness (NRI connected, /healthz answering) is what the DaemonSet controller waits for before
// it deletes the old pod. Between the old plugin's disconnect and the new one's connect (one poll
// interval) no Tessera plugin is connected: containers holding Tessera devices are then refused
// by the CDI specs' realisation hook, as during an agent restart.
package handover

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/tessera-gpu/tessera/internal/fsatomic"
)

// Options configures Take.
type Options struct {
	// Dir holds the seat's files; every agent of the node must use the same directory (the
	// node's run directory, a hostPath).
	Dir string
	// Name says who this agent is in logs and in the claim file (its pod name; default the host
	// name). The claim also carries the process id and start time, so a restarted container of
	// the same pod is another claimant.
	Name string
	// Interval is how often the seat's lock (while waiting) and the claim (while holding) are
	// looked at. Default 200 ms: the gap between the old plugin's disconnect and the new one's
	// connect is at most about this long.
	Interval time.Duration
	// Log receives the handover's lines (nil: discarded).
	Log *slog.Logger

	busy func() // tests: told of every attempt that found the seat taken or the port in use
}

// Claim is one agent's request for the seat: who asked, and the network namespace it runs in
// (the metrics port collides only between agents that share one).
type Claim struct {
	ID    string
	NetNS string
}

// Seat is the held seat. Yielding is closed once a newer agent has claimed it; the holder then
// stops its duties and calls Release.
type Seat struct {
	opts      Options
	self      Claim
	lock      *os.File
	yielding  chan struct{}
	successor Claim
	stop      chan struct{}
	watching  sync.WaitGroup
	release   sync.Once
}

// The seat's files in Options.Dir (an uninstall removes them).
const (
	lockName  = "agent.seat.lock"
	claimName = "agent.seat"
)

// Files are the names of the seat's files in Options.Dir.
func Files() []string { return []string{claimName, lockName} }

// Held reports whether another process holds the seat in dir now (a probe of its lock that lets go
// at once); a missing lock file is a free seat.
func Held(dir string) bool {
	lock, err := os.Open(filepath.Join(dir, lockName))
	if err != nil {
		return false
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return errors.Is(err, syscall.EWOULDBLOCK)
	}
	syscall.Flock(int(lock.Fd()), syscall.LOCK_UN)
	return false
}

// Take claims the seat for this agent and waits until it holds it (the previous holder has seen
// the claim and let go, or died). It returns ctx's error if ctx ends first.
func Take(ctx context.Context, opts Options) (*Seat, error) {
	if opts.Interval <= 0 {
		opts.Interval = 200 * time.Millisecond
	}
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	if opts.Name == "" {
		opts.Name, _ = os.Hostname()
	}
	opts.Log = opts.Log.With("component", "handover")
	if err := os.MkdirAll(opts.Dir, 0o750); err != nil {
		return nil, fmt.Errorf("seat directory: %w", err)
	}
	self := Claim{ID: fmt.Sprintf("%s/%d/%s", opts.Name, os.Getpid(), strconv.FormatInt(time.Now().UnixNano(), 36)), NetNS: netNS()}
	if err := writeClaim(filepath.Join(opts.Dir, claimName), self); err != nil {
		return nil, err
	}
	lock, err := os.OpenFile(filepath.Join(opts.Dir, lockName), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open the seat's lock: %w", err)
	}
	// The lock is tried at once, then once an interval until it is free or ctx ends.
	waiting := false
	err = wait.PollUntilContextCancel(ctx, opts.Interval, true, func(context.Context) (bool, error) {
		err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return true, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			return false, fmt.Errorf("lock %s: %w", lock.Name(), err)
		}
		if opts.busy != nil {
			opts.busy()
		}
		if !waiting {
			waiting = true
			opts.Log.Info("another agent of this node holds the NRI plugin and the metrics port; waiting for it to hand them over", "claim", self.ID)
		}
		return false, nil
	})
	if err != nil {
		lock.Close()
		return nil, err
	}
	s := &Seat{opts: opts, self: self, lock: lock, yielding: make(chan struct{}), stop: make(chan struct{})}
	opts.Log.Info("holding the node's NRI plugin and metrics port", "claim", self.ID, "waited", waiting)
	s.watching.Add(1)
	go s.watch()
	return s, nil
}

// watch closes yielding once the claim file names another agent; it looks once an interval, the
// first an interval after the seat was taken, until then or until Release.
func (s *Seat) watch() {
	defer s.watching.Done()
	_ = wait.PollUntilContextCancel(wait.ContextForChannel(s.stop), s.opts.Interval, false, func(context.Context) (bool, error) {
		c, err := readClaim(filepath.Join(s.opts.Dir, claimName))
		if err != nil {
			// Unreadable or gone (a hand-cleaned run directory): keep the seat; only a claim by
			// another agent moves it.
			return false, nil
		}
		if c.ID == s.self.ID {
			return false, nil
		}
		s.successor = c
		s.opts.Log.Info("a newer agent of this node claimed the NRI plugin and metrics port: handing them over", "successor", c.ID)
		close(s.yielding)
		return true, nil
	})
}

// Yielding is closed once a newer agent has claimed the seat.
func (s *Seat) Yielding() <-chan struct{} { return s.yielding }

// SuccessorSharesNetwork reports whether the agent that claimed the seat runs in this agent's
// network namespace (both on the host network), so it needs the metrics port this one has. Only
// meaningful once Yielding is closed; an unknown namespace on either side counts as shared.
func (s *Seat) SuccessorSharesNetwork() bool {
	select {
	case <-s.yielding:
	default:
		return false
	}
	return s.successor.NetNS == "" || s.self.NetNS == "" || s.successor.NetNS == s.self.NetNS
}

// Release lets go of the seat; the caller must have stopped its duties first. It is idempotent.
func (s *Seat) Release() {
	s.release.Do(func() {
		close(s.stop)
		s.watching.Wait()
		s.lock.Close() // closing the last descriptor releases the flock
		s.opts.Log.Info("released the node's NRI plugin and metrics port")
	})
}

// Listen listens on the TCP address addr for the seat's holder. An address in use is waited for
// (the port is the seat's too): an agent of a release before the handover holds it for its whole
// life, and its successor must not connect a second NRI plugin beside it, so it waits until that
// agent is gone. It returns ctx's error if ctx ends first, and ErrYielded if the seat is claimed
// meanwhile.
func (s *Seat) Listen(ctx context.Context, addr string) (net.Listener, error) {
	// A claim by a newer agent ends the wait as ctx does, at once rather than at the next try.
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(wait.ContextForChannel(s.yielding), cancel)()
	var ln net.Listener
	waiting := false
	err := wait.PollUntilContextCancel(lctx, s.opts.Interval, true, func(context.Context) (bool, error) {
		var err error
		ln, err = net.Listen("tcp", addr)
		if err == nil {
			return true, nil
		}
		if !errors.Is(err, syscall.EADDRINUSE) {
			return false, fmt.Errorf("listen for /metrics on %s: %w", addr, err)
		}
		if s.opts.busy != nil {
			s.opts.busy()
		}
		if !waiting {
			waiting = true
			s.opts.Log.Warn("the metrics port is in use, by an agent of a release without the handover or another program; waiting for it before connecting the NRI plugin",
				"listen", addr, "err", err)
		}
		return false, nil
	})
	switch {
	case err == nil:
		return ln, nil
	case lctx.Err() == nil || !errors.Is(err, lctx.Err()):
		return nil, err // the listen's own error
	case ctx.Err() != nil:
		return nil, ctx.Err()
	}
	return nil, ErrYielded
}

// ErrYielded: the seat was claimed by a newer agent before its duties started.
var ErrYielded = errors.New("a newer agent claimed the seat")

func writeClaim(path string, c Claim) error {
	if err := fsatomic.WriteFile(path, []byte(c.ID+"\n"+c.NetNS+"\n"), 0o600); err != nil {
		return fmt.Errorf("claim the seat: %w", err)
	}
	return nil
}

// readClaim reads a claim file: two lines, the ID and the network namespace. The file lives in a
// root-only hostPath and is written by agents only; it is read bounded all the same.
func readClaim(path string) (Claim, error) {
	f, err := os.Open(path)
	if err != nil {
		return Claim{}, err
	}
	defer f.Close()
	buf := make([]byte, 1024)
	n, err := f.Read(buf)
	if n == 0 {
		return Claim{}, fmt.Errorf("read %s: empty (%v)", path, err)
	}
	id, ns, _ := bytes.Cut(buf[:n], []byte("\n"))
	if len(id) == 0 {
		return Claim{}, fmt.Errorf("read %s: no claimant", path)
	}
	return Claim{ID: string(id), NetNS: strings.TrimSpace(string(ns))}, nil
}

// netNS names this process's network namespace (e.g. net:[4026531840]); empty when unknown.
func netNS() string {
	ns, err := os.Readlink("/proc/self/ns/net")
	if err != nil {
		return ""
	}
	return ns
}
