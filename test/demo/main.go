// Command demo is `make demo`: on a machine where `make tools` has run, it brings up a one-node
// Kubernetes cluster with Tessera on the simulated 8-GPU node (the e2e harness, StartCluster),
// applies deploy/examples, prints which pod got which GPU and cap, what each container sees and why
// the last pod is Pending, and tears everything down.
//
//	go run ./test/demo           # the demo; Ctrl-C tears down cleanly
//	KEEP=1 go run ./test/demo    # leave the cluster up; prints KUBECONFIG and kubectl to use
//	go run ./test/demo down      # tear down a cluster left up by KEEP=1
//
// The harness takes a *testing.T, so the demo is a test of the e2e package (TestDemo, run only
// with TESSERA_DEMO=1): this program builds that test binary and runs it, in the foreground, or
// with KEEP=1 detached, returning once the cluster is up. Its state (the test binary, the log, the
// env file to source) lives in .cache/demo.
package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

func main() {
	root, err := repoRoot()
	if err != nil {
		fail(err)
	}
	state := filepath.Join(root, ".cache", "demo")
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case "down":
			if err := down(state); err != nil {
				fail(err)
			}
			return
		default:
			fail(fmt.Errorf("usage: go run ./test/demo [down]  (KEEP=1 leaves the cluster up)"))
		}
	}
	if pid := runningPid(state); pid > 0 {
		fail(fmt.Errorf("a demo cluster is already up (pid %d; source %s): run `make demo-down` first", pid, filepath.Join(state, "env")))
	}
	if err := os.MkdirAll(state, 0o755); err != nil {
		fail(err)
	}
	for _, f := range []string{"ready", "env", "pid"} {
		os.Remove(filepath.Join(state, f))
	}
	bin := filepath.Join(state, "e2e.test")
	fmt.Println("== building the e2e test binary (go test -c ./test/e2e)")
	build := exec.Command("go", "test", "-c", "-o", bin, "./test/e2e")
	build.Dir, build.Stdout, build.Stderr = root, os.Stdout, os.Stderr
	if err := build.Run(); err != nil {
		fail(fmt.Errorf("go test -c ./test/e2e: %w", err))
	}
	keep := os.Getenv("KEEP") == "1"
	timeout := "15m"
	if keep {
		timeout = "0" // the cluster stays up until `down`
	}
	cmd := exec.Command(bin, "-test.run", "^TestDemo$", "-test.count", "1", "-test.timeout", timeout)
	cmd.Dir = filepath.Join(root, "test", "e2e")
	cmd.Env = append(os.Environ(), "TESSERA_DEMO=1", "TESSERA_DEMO_STATE="+state)
	if os.Getenv("TESSERA_TOOLS") == "" {
		cmd.Env = append(cmd.Env, "TESSERA_TOOLS="+filepath.Join(root, ".cache", "tools"))
	}
	if !keep {
		os.Exit(foreground(cmd))
	}
	cmd.Env = append(cmd.Env, "TESSERA_DEMO_KEEP=1")
	if err := detached(cmd, state); err != nil {
		fail(err)
	}
}

// foreground runs the demo attached to the terminal. Ctrl-C reaches the test binary too (same
// process group), which tears down through its cleanups; this process only waits for it.
func foreground(cmd *exec.Cmd) int {
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	signal.Ignore(syscall.SIGINT, syscall.SIGTERM)
	if err := cmd.Run(); err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode()
		}
		fmt.Fprintln(os.Stderr, "demo:", err)
		return 1
	}
	return 0
}

// detached starts the demo in its own session with its output in state/demo.log, shows that output
// until the cluster is up (state/ready), and returns, leaving it running.
func detached(cmd *exec.Cmd, state string) error {
	logPath := filepath.Join(state, "demo.log")
	log, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer log.Close()
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	pid := cmd.Process.Pid
	if err := os.WriteFile(filepath.Join(state, "pid"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
		return err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	var shown int64
	show := func() {
		f, err := os.Open(logPath)
		if err != nil {
			return
		}
		defer f.Close()
		f.Seek(shown, io.SeekStart)
		n, _ := io.Copy(os.Stdout, f)
		shown += n
	}
	var ended error
	err = wait.PollUntilContextCancel(context.Background(), 300*time.Millisecond, false, func(context.Context) (bool, error) {
		select {
		case err := <-exited:
			show()
			os.Remove(filepath.Join(state, "pid"))
			ended = fmt.Errorf("the demo ended before the cluster was up (%v); log: %s", err, logPath)
			return true, nil
		default:
		}
		show()
		_, err := os.Stat(filepath.Join(state, "ready"))
		return err == nil, nil
	})
	if err != nil || ended != nil {
		return errors.Join(err, ended)
	}
	fmt.Printf("\n== the demo cluster runs in the background (pid %d, log %s)\n", pid, logPath)
	return nil
}

// down stops a demo left up by KEEP=1 and waits until it has torn everything down.
func down(state string) error {
	pid := runningPid(state)
	if pid == 0 {
		fmt.Println("no demo cluster is up")
		return nil
	}
	logPath := filepath.Join(state, "demo.log")
	before := fileSize(logPath)
	fmt.Printf("== stopping the demo cluster (pid %d)\n", pid)
	if err := syscall.Kill(pid, syscall.SIGTERM); err != nil {
		return err
	}
	gone := func(context.Context) (bool, error) { return !alive(pid), nil }
	if err := wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 3*time.Minute, true, gone); err != nil {
		return fmt.Errorf("pid %d still runs 3 minutes after SIGTERM; see %s", pid, logPath)
	}
	if f, err := os.Open(logPath); err == nil {
		f.Seek(before, io.SeekStart)
		io.Copy(os.Stdout, f)
		f.Close()
	}
	for _, f := range []string{"pid", "ready", "env"} {
		os.Remove(filepath.Join(state, f))
	}
	fmt.Println("== torn down")
	return nil
}

// runningPid is the pid of a demo left up, 0 when none runs.
func runningPid(state string) int {
	data, err := os.ReadFile(filepath.Join(state, "pid"))
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil || !alive(pid) {
		return 0
	}
	// the pid must still be our test binary, not a recycled number
	cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if !strings.Contains(string(cmdline), "e2e.test") {
		return 0
	}
	return pid
}

func alive(pid int) bool {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// a zombie has exited
	fields := strings.Fields(string(data[strings.LastIndexByte(string(data), ')')+1:]))
	return len(fields) > 0 && fields[0] != "Z"
}

func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// repoRoot is the directory of the module's go.mod, found from the working directory.
func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if f, err := os.Open(filepath.Join(dir, "go.mod")); err == nil {
			sc := bufio.NewScanner(f)
			sc.Scan()
			f.Close()
			if strings.TrimSpace(sc.Text()) == "module github.com/tessera-gpu/tessera" {
				return dir, nil
			}
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("run the demo inside the tessera repository")
		}
		dir = parent
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "demo:", err)
	os.Exit(1)
}
