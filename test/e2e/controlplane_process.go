package e2e

import (
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Process is one long-running binary of a test stack (etcd, kube-apiserver, an extender...): it can
// be stopped and started again with the same arguments, and its output is appended to one log file
// across restarts. It runs in its own process group, so stopping it also ends what it spawned.
type Process struct {
	Name string
	Bin  string
	Args []string
	Env  []string // added to the test's environment
	Log  string   // path of the log file
	// CPUs, when set, is the process's CPU affinity from its start (startOnCPUs); nil inherits this
	// process's.
	CPUs []int

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

// Start launches the process (again, after Stop or Kill). It does not wait for it to be ready.
func (p *Process) Start(t testing.TB) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil {
		t.Fatalf("%s is already running (pid %d)", p.Name, p.cmd.Process.Pid)
	}
	log, err := os.OpenFile(p.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(log, "===== %s start: %s %s\n", time.Now().Format(time.RFC3339Nano), p.Bin, strings.Join(p.Args, " "))
	cmd := exec.Command(p.Bin, p.Args...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.Env = append(os.Environ(), p.Env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	start := cmd.Start
	if p.CPUs != nil {
		start = func() error { return startOnCPUs(cmd, p.CPUs) }
	}
	if err := start(); err != nil {
		log.Close()
		t.Fatalf("start %s: %v", p.Name, err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); log.Close(); close(done) }()
	p.cmd, p.done = cmd, done
}

// Running reports whether the process was started and has not exited.
func (p *Process) Running() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return false
	}
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// Pid is the process id, 0 when not started.
func (p *Process) Pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return 0
	}
	return p.cmd.Process.Pid
}

// Stop ends the process gracefully: SIGTERM, then SIGKILL after 10 s. It is a no-op when not running.
func (p *Process) Stop(t testing.TB) { p.signal(t, syscall.SIGTERM, 10*time.Second) }

// Kill ends the process abruptly with SIGKILL, as a crash would.
func (p *Process) Kill(t testing.TB) { p.signal(t, syscall.SIGKILL, 0) }

func (p *Process) signal(t testing.TB, sig syscall.Signal, grace time.Duration) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return
	}
	pid := p.cmd.Process.Pid
	syscall.Kill(-pid, sig)
	select {
	case <-p.done:
	case <-time.After(grace):
		syscall.Kill(-pid, syscall.SIGKILL)
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			t.Errorf("%s (pid %d) did not exit after SIGKILL", p.Name, pid)
		}
	}
	// children that left the group are not ours to chase; those in it die with it
	syscall.Kill(-pid, syscall.SIGKILL)
	p.cmd, p.done = nil, nil
}

// LogTail returns the last n lines of the process's log.
func (p *Process) LogTail(n int) string {
	data, _ := os.ReadFile(p.Log)
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// freePort returns a TCP port on 127.0.0.1 that nothing listens on right now, that it has not
// returned before in this process, and that no other test process on the machine holds. Several
// stacks may run on one machine at once (go test runs packages in parallel; other checkouts), so no
// port is hard-coded; and a port handed out is often bound only later (the extender's, after the
// control plane has started), so meanwhile:
//   - the kernel may hand it to an outbound connection (once etcd's client took the extender's port
//     that way and TestDRA failed in CI): ports come from below the kernel's ephemeral range, which
//     outbound connections never use;
//   - another test process may pick it too: each port handed out is locked in a machine-wide
//     register (pickPort, lockPort) until this process exits.
func freePort(t testing.TB) int {
	t.Helper()
	portRegister.once.Do(func() {
		path := filepath.Join(os.TempDir(), "tessera-e2e-ports.lock")
		portRegister.f, portRegister.err = os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o666)
	})
	if portRegister.err != nil {
		t.Fatalf("freePort: open the port register: %v", portRegister.err)
	}
	lo, hi := portRange()
	port, err := pickPort(portRegister.f, lo, hi, &handedOut)
	if err != nil {
		t.Fatalf("freePort: %v", err)
	}
	return port
}

// pickPort returns a port in [lo, hi) not in used that it could lock in the register f and bind on
// 127.0.0.1 (then closed), and adds it to used. It scans from a random port, so that processes
// starting together do not contend for the same ones.
func pickPort(f *os.File, lo, hi int, used *sync.Map) (int, error) {
	start := rand.IntN(hi - lo)
	for i := range hi - lo {
		port := lo + (start+i)%(hi-lo)
		if _, taken := used.Load(port); taken {
			continue
		}
		ok, err := lockPort(f, port)
		if err != nil {
			return 0, err
		}
		if !ok {
			continue // another test process holds it
		}
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			continue // in use outside the register (left locked: no test should take it either)
		}
		l.Close()
		used.Store(port, true)
		return port, nil
	}
	return 0, fmt.Errorf("every port in [%d, %d) is in use, handed out or held by another test process", lo, hi)
}

// handedOut are the ports freePort returned (never twice in one process).
var handedOut sync.Map

// portRange is where freePort looks: below the kernel's ephemeral range (or above it where there is
// no room below), so that no outbound connection can take a port before its server binds it.
func portRange() (lo, hi int) {
	const low, room = 20000, 2000
	lo, hi = low, 32768 // Linux's default ephemeral range starts at 32768
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return lo, hi
	}
	var elo, ehi int
	if _, err := fmt.Sscan(string(b), &elo, &ehi); err != nil {
		return lo, hi
	}
	switch {
	case elo-low >= room:
		return low, elo
	case 65535-ehi >= room:
		return ehi + 1, 65536
	}
	return 10000, 65536 // the ephemeral range leaves no room: the register still keeps test processes apart
}

// portRegister is the machine-wide register of ports handed out by test processes: one byte per
// port of a lock file, locked with an open-file-description lock (held until this process exits, or
// until the file description is closed; a second description, as another process has, conflicts).
var portRegister struct {
	once sync.Once
	f    *os.File
	err  error
}

// lockPort takes port's byte in the register file f (false: another file description holds it).
func lockPort(f *os.File, port int) (bool, error) {
	lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: io.SeekStart, Start: int64(port), Len: 1}
	switch err := unix.FcntlFlock(f.Fd(), unix.F_OFD_SETLK, &lk); {
	case err == nil:
		return true, nil
	case errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EACCES):
		return false, nil
	default:
		return false, fmt.Errorf("lock port %d in %s: %w", port, f.Name(), err)
	}
}

// waitFor polls cond every interval until it returns true or the deadline passes; it returns the
// last error cond gave (nil on success).
func waitFor(timeout, interval time.Duration, cond func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	var last error
	for {
		ok, err := cond()
		if ok {
			return nil
		}
		if err != nil {
			last = err
		}
		if time.Now().After(deadline) {
			if last == nil {
				last = fmt.Errorf("condition not met")
			}
			return fmt.Errorf("after %s: %w", timeout, last)
		}
		time.Sleep(interval)
	}
}

// WaitHealthy waits until the process answers 200 at url (its /healthz or /readyz, over http or
// https), failing the test with its log tail when it exits or the timeout passes.
func (p *Process) WaitHealthy(t testing.TB, url string, timeout time.Duration) {
	t.Helper()
	hc := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{
		// self-signed serving certificates on loopback; health endpoints need no authentication
		TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	err := waitFor(timeout, 50*time.Millisecond, func() (bool, error) {
		if !p.Running() {
			return false, fmt.Errorf("%s exited", p.Name)
		}
		resp, err := hc.Get(url)
		if err != nil {
			return false, err
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, fmt.Errorf("%s: %s", url, resp.Status)
	})
	if err != nil {
		t.Fatalf("%s not healthy: %v\n%s", p.Name, err, p.LogTail(40))
	}
}
