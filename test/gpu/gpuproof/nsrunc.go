package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	rspec "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// nsrunc is the fallback where runc cannot start a container (no cgroup2 delegation, a sandbox
// like gVisor refusing what runc needs): the same OCI bundle, the CDI edits and vcuda's mounts
// included, applied in a new mount and PID namespace (clone flags, as `unshare --mount --pid
// --fork` makes them), bind mounts, mknod and chroot. It answers the runc verbs the runner uses (spec, run, state, kill, delete), so
// the phases run unchanged; the preflight says which of the two ran. It does less than runc (no
// user, network or IPC namespace, no seccomp, no capabilities dropped): enough to prove what
// the CDI edits give a container, not an isolation boundary.
const nsruncState = "/run/gpuproof-nsrunc"

func runNSRunc(args []string) error {
	if len(args) == 0 {
		return fmt.Errorf("usage: gpuproof nsrunc spec|run|state|kill|delete ... (runc's verbs)")
	}
	verb, rest := args[0], args[1:]
	positional := func(fs *flag.FlagSet) (string, error) {
		if err := fs.Parse(rest); err != nil {
			return "", err
		}
		if fs.NArg() < 1 {
			return "", fmt.Errorf("nsrunc %s: a container id is required", verb)
		}
		return fs.Arg(0), nil
	}
	switch verb {
	case "spec":
		fs := flag.NewFlagSet("spec", flag.ContinueOnError)
		bundle := fs.String("bundle", ".", "bundle folder")
		if err := fs.Parse(rest); err != nil {
			return err
		}
		return writeDefaultSpec(*bundle)
	case "run":
		fs := flag.NewFlagSet("run", flag.ContinueOnError)
		bundle := fs.String("bundle", ".", "bundle folder")
		id, err := positional(fs)
		if err != nil {
			return err
		}
		return nsRun(*bundle, id)
	case "state":
		id, err := positional(flag.NewFlagSet("state", flag.ContinueOnError))
		if err != nil {
			return err
		}
		pid := nsPid(id)
		st := "stopped"
		if pid > 0 && syscall.Kill(pid, 0) == nil {
			st = "running"
		}
		return json.NewEncoder(os.Stdout).Encode(map[string]any{"id": id, "pid": pid, "status": st})
	case "kill":
		id, err := positional(flag.NewFlagSet("kill", flag.ContinueOnError))
		if err != nil {
			return err
		}
		if pid := nsPid(id); pid > 0 {
			// pid 1 of the container's PID namespace: the kernel ends every process in it
			return syscall.Kill(pid, syscall.SIGKILL)
		}
		return fmt.Errorf("nsrunc kill: container %s is not running", id)
	case "delete":
		fs := flag.NewFlagSet("delete", flag.ContinueOnError)
		fs.Bool("force", false, "kill it first")
		id, err := positional(fs)
		if err != nil {
			return err
		}
		if pid := nsPid(id); pid > 0 {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		if cg, err := os.ReadFile(filepath.Join(nsruncState, id, "cgroup")); err == nil {
			for _, d := range strings.Fields(string(cg)) {
				_ = os.Remove(d) // empty once the container ended
			}
		}
		return os.RemoveAll(filepath.Join(nsruncState, id))
	case "init":
		if len(rest) != 2 {
			return fmt.Errorf("nsrunc init <bundle> <id>")
		}
		return nsInit(rest[0], rest[1])
	}
	return fmt.Errorf("nsrunc: unknown verb %q", verb)
}

func nsPid(id string) int {
	data, err := os.ReadFile(filepath.Join(nsruncState, id, "pid"))
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(data)))
	return pid
}

// writeDefaultSpec writes what `runc spec` writes, as far as the phases rely on it.
func writeDefaultSpec(bundle string) error {
	spec := &rspec.Spec{
		Version: rspec.Version,
		Root:    &rspec.Root{Path: "rootfs", Readonly: true},
		Process: &rspec.Process{Args: []string{"sh"}, Cwd: "/", Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "TERM=xterm"}},
		Mounts: []rspec.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
			{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"}},
			{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}},
			{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
		},
		Linux: &rspec.Linux{Namespaces: []rspec.LinuxNamespace{{Type: rspec.PIDNamespace}, {Type: rspec.MountNamespace}}},
	}
	data, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o644)
}

// nsRun runs the bundle's process in new mount and PID namespaces and exits with its status
// (128+signal when killed, as runc does).
func nsRun(bundle, id string) error {
	dir := filepath.Join(nsruncState, id)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	abs, err := filepath.Abs(bundle)
	if err != nil {
		return err
	}
	// what `unshare --mount --pid --fork` does, with the container's own exit status to wait for
	cmd := exec.Command(self, "nsrunc", "init", abs, id)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = nil, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWPID, Pdeathsig: syscall.SIGKILL}
	err = cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			os.Exit(128 + int(ws.Signal()))
		}
		os.Exit(ee.ExitCode())
	}
	return err
}

// nsInit is pid 1 of the new PID namespace, in its own mount namespace: it lays out the root as
// runc would from the spec, runs the spec's hooks, moves into the cgroup, chroots and execs.
func nsInit(bundle, id string) error {
	dir := filepath.Join(nsruncState, id)
	// nothing mounted here reaches the host (unshare --propagation private)
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make the mounts private: %w", err)
	}
	// /proc here is still the host's mount, so it names this process by its host pid: what
	// `state` reports and the hooks get, as runc gives them.
	self, err := os.Readlink("/proc/self")
	if err != nil {
		return fmt.Errorf("host pid: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "pid"), []byte(self), 0o644); err != nil {
		return err
	}
	hostPid, _ := strconv.Atoi(self)
	data, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		return err
	}
	spec := &rspec.Spec{}
	if err := json.Unmarshal(data, spec); err != nil {
		return fmt.Errorf("%s/config.json: %w", bundle, err)
	}
	rootSrc := spec.Root.Path
	if !filepath.IsAbs(rootSrc) {
		rootSrc = filepath.Join(bundle, rootSrc)
	}
	root := filepath.Join(dir, "root")
	if err := os.MkdirAll(root, 0o755); err != nil {
		return err
	}
	if err := unix.Mount(rootSrc, root, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind the root %s: %w", rootSrc, err)
	}
	for _, m := range spec.Mounts {
		if err := nsMount(root, m); err != nil {
			return err
		}
	}
	if err := nsDevices(root, spec); err != nil {
		return err
	}
	if spec.Linux != nil && spec.Linux.CgroupsPath != "" {
		joined, err := joinCgroups(spec.Linux.CgroupsPath)
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, "cgroup"), []byte(strings.Join(joined, "\n")), 0o644); err != nil {
			return err
		}
	}
	// The hooks see the root as laid out here (the CDI hooks make symlinks and the ld cache in it).
	spec.Root.Path = root
	hookBundle := filepath.Join(dir, "bundle")
	if err := os.MkdirAll(hookBundle, 0o755); err != nil {
		return err
	}
	if data, err = json.Marshal(spec); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(hookBundle, "config.json"), data, 0o644); err != nil {
		return err
	}
	state, err := json.Marshal(rspec.State{Version: rspec.Version, ID: id, Status: rspec.StateCreating, Pid: hostPid, Bundle: hookBundle})
	if err != nil {
		return err
	}
	if spec.Hooks != nil {
		//nolint:staticcheck // Prestart is deprecated but still what older CDI specs use
		for _, set := range [][]rspec.Hook{spec.Hooks.Prestart, spec.Hooks.CreateRuntime, spec.Hooks.CreateContainer, spec.Hooks.StartContainer} {
			for _, h := range set {
				if err := runHook(h, state); err != nil {
					return err
				}
			}
		}
	}
	if err := unix.Chroot(root); err != nil {
		return fmt.Errorf("chroot %s: %w", root, err)
	}
	if err := os.Chdir(orDefault(spec.Process.Cwd, "/")); err != nil {
		return err
	}
	if spec.Process.User.GID != 0 || spec.Process.User.UID != 0 {
		if err := unix.Setgid(int(spec.Process.User.GID)); err != nil {
			return err
		}
		if err := unix.Setuid(int(spec.Process.User.UID)); err != nil {
			return err
		}
	}
	return unix.Exec(spec.Process.Args[0], spec.Process.Args, spec.Process.Env)
}

// joinCgroups moves pid into cgroupsPath as runc's cgroupfs driver would: the one hierarchy on
// cgroup2, every controller's on cgroup v1 (where the memory guard reads the container ID from
// /proc/<pid>/cgroup). It returns the folders it joined. "0" names the writer: its host pid means
// nothing inside its own PID namespace.
func joinCgroups(path string) ([]string, error) {
	const root = "/sys/fs/cgroup"
	var st unix.Statfs_t
	var hierarchies []string
	if unix.Statfs(root, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
		hierarchies = []string{root}
	} else {
		entries, err := os.ReadDir(root)
		if err != nil {
			return nil, fmt.Errorf("cgroups: %w", err)
		}
		for _, e := range entries {
			h := filepath.Join(root, e.Name())
			if e.IsDir() && unix.Statfs(h, &st) == nil && (st.Type == unix.CGROUP_SUPER_MAGIC || st.Type == unix.CGROUP2_SUPER_MAGIC) {
				hierarchies = append(hierarchies, h)
			}
		}
	}
	var joined, refused []string
	for _, h := range hierarchies {
		cg := filepath.Join(h, path)
		if err := os.MkdirAll(cg, 0o755); err != nil {
			return joined, fmt.Errorf("cgroup %s: %w", cg, err)
		}
		joined = append(joined, cg)
		// a new v1 cpuset has no CPUs or memory nodes: give each level its parent's, as runc does
		for dir := filepath.Join(h, strings.Split(strings.Trim(path, "/"), "/")[0]); ; {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				if cur, err := os.ReadFile(filepath.Join(dir, f)); err == nil && strings.TrimSpace(string(cur)) == "" {
					if parent, err := os.ReadFile(filepath.Join(filepath.Dir(dir), f)); err == nil {
						_ = os.WriteFile(filepath.Join(dir, f), parent, 0o644)
					}
				}
			}
			if dir == cg {
				break
			}
			dir = filepath.Join(dir, strings.Split(strings.TrimPrefix(cg, dir+"/"), "/")[0])
		}
		if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte("0"), 0o644); err != nil {
			refused = append(refused, fmt.Sprintf("%s: %v", cg, err))
		}
	}
	if len(refused) == len(hierarchies) {
		return joined, fmt.Errorf("no cgroup hierarchy under %s took the container (cgroupsPath %s): %s", root, path, strings.Join(refused, "; "))
	}
	// on v1 one hierarchy is enough for /proc/<pid>/cgroup to name the container
	return joined, nil
}

func orDefault(s, d string) string {
	if s == "" {
		return d
	}
	return s
}

func runHook(h rspec.Hook, state []byte) error {
	timeout := 30 * time.Second
	if h.Timeout != nil {
		timeout = time.Duration(*h.Timeout) * time.Second
	}
	cmd := exec.Command(h.Path)
	cmd.Args = h.Args
	if len(cmd.Args) == 0 {
		cmd.Args = []string{h.Path}
	}
	cmd.Env, cmd.Stdin = h.Env, bytes.NewReader(state)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("hook %s: %w", h.Path, err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("hook %s %v: %w: %s", h.Path, h.Args, err, out.String())
		}
		return nil
	case <-time.After(timeout):
		_ = cmd.Process.Kill()
		return fmt.Errorf("hook %s %v: timed out after %v", h.Path, h.Args, timeout)
	}
}

// mountFlags splits OCI mount options into mount(2) flags and data.
func mountFlags(opts []string) (uintptr, string, bool) {
	names := map[string]uintptr{"ro": unix.MS_RDONLY, "nosuid": unix.MS_NOSUID, "nodev": unix.MS_NODEV, "noexec": unix.MS_NOEXEC,
		"bind": unix.MS_BIND, "rbind": unix.MS_BIND | unix.MS_REC, "strictatime": unix.MS_STRICTATIME, "relatime": unix.MS_RELATIME}
	var flags uintptr
	var data []string
	bind := false
	for _, o := range opts {
		if f, ok := names[o]; ok {
			flags |= f
			bind = bind || o == "bind" || o == "rbind"
			continue
		}
		switch o {
		case "rw", "private", "rprivate", "slave", "rslave", "nosymfollow", "rro":
		default:
			data = append(data, o)
		}
	}
	return flags, strings.Join(data, ","), bind
}

func nsMount(root string, m rspec.Mount) error {
	dst := filepath.Join(root, m.Destination)
	flags, data, bind := mountFlags(m.Options)
	if m.Type == "bind" || bind {
		st, err := os.Stat(m.Source)
		if err != nil {
			return fmt.Errorf("mount %s: %w", m.Destination, err)
		}
		if err := mountPoint(dst, st.IsDir()); err != nil {
			return err
		}
		if err := unix.Mount(m.Source, dst, "", unix.MS_BIND|(flags&unix.MS_REC), ""); err != nil {
			return fmt.Errorf("bind %s on %s: %w", m.Source, m.Destination, err)
		}
		if flags&(unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC) != 0 {
			if err := unix.Mount("", dst, "", unix.MS_BIND|unix.MS_REMOUNT|(flags&^(unix.MS_BIND|unix.MS_REC)), ""); err != nil {
				return fmt.Errorf("remount %s %v: %w", m.Destination, m.Options, err)
			}
		}
		return nil
	}
	if err := mountPoint(dst, true); err != nil {
		return err
	}
	switch m.Type {
	case "cgroup", "cgroup2", "mqueue":
		return nil // nothing the phases use; a sandbox may refuse them
	}
	if err := unix.Mount(m.Source, dst, m.Type, flags, data); err != nil {
		return fmt.Errorf("mount %s (%s %v): %w", m.Destination, m.Type, m.Options, err)
	}
	return nil
}

// mountPoint makes the folder or empty file a bind mount goes onto.
func mountPoint(dst string, dir bool) error {
	if dir {
		return os.MkdirAll(dst, 0o755)
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(dst, os.O_CREATE|os.O_RDONLY, 0o644)
	if err != nil {
		return err
	}
	return f.Close()
}

// nsDevices makes runc's default device nodes and the spec's (the CDI device nodes) under /dev.
func nsDevices(root string, spec *rspec.Spec) error {
	devs := []rspec.LinuxDevice{
		{Path: "/dev/null", Type: "c", Major: 1, Minor: 3}, {Path: "/dev/zero", Type: "c", Major: 1, Minor: 5},
		{Path: "/dev/full", Type: "c", Major: 1, Minor: 7}, {Path: "/dev/random", Type: "c", Major: 1, Minor: 8},
		{Path: "/dev/urandom", Type: "c", Major: 1, Minor: 9}, {Path: "/dev/tty", Type: "c", Major: 5, Minor: 0},
	}
	if spec.Linux != nil {
		devs = append(devs, spec.Linux.Devices...)
	}
	for _, d := range devs {
		dst := filepath.Join(root, d.Path)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return err
		}
		_ = os.Remove(dst)
		mode := uint32(0o666)
		if d.FileMode != nil {
			mode = uint32(*d.FileMode)
		}
		kind := uint32(unix.S_IFCHR)
		if d.Type == "b" {
			kind = unix.S_IFBLK
		}
		err := unix.Mknod(dst, kind|mode, int(unix.Mkdev(uint32(d.Major), uint32(d.Minor))))
		if err != nil {
			// a sandbox that refuses mknod may still let the host's node be bound in
			if _, serr := os.Stat(d.Path); serr != nil {
				return fmt.Errorf("device %s: mknod: %w; no host node to bind", d.Path, err)
			}
			if err := mountPoint(dst, false); err != nil {
				return err
			}
			if err := unix.Mount(d.Path, dst, "", unix.MS_BIND, ""); err != nil {
				return fmt.Errorf("device %s: mknod refused, bind: %w", d.Path, err)
			}
		}
		if err := os.Chmod(dst, os.FileMode(mode)); err != nil {
			return err
		}
	}
	for name, target := range map[string]string{"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx"} {
		_ = os.Symlink(target, filepath.Join(root, "dev", name))
	}
	return nil
}
