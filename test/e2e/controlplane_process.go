package e2e

import (
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
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
	if err := cmd.Start(); err != nil {
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

// freePort returns a TCP port on 127.0.0.1 that nothing listens on right now and that it has not
// returned before in this process. Several stacks may run on one machine at once (other packages'
// tests, other checkouts), so no port is hard-coded; and a port handed out is often bound only
// later (the extender's, after the control plane has started), so the kernel may offer it again
// meanwhile: once etcd took the extender's port that way and TestDRA failed in CI.
func freePort(t testing.TB) int {
	t.Helper()
	for range 100 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		if _, taken := handedOut.LoadOrStore(port, true); !taken {
			return port
		}
	}
	t.Fatal("freePort: the kernel kept offering ports handed out before")
	return 0
}

// handedOut are the ports freePort returned (never twice in one process).
var handedOut sync.Map

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
