package e2e

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Containerd is a private containerd 2.2 with NRI and CDI enabled, running from the tools dir with
// its own root, state, sockets and runc root, so it never meets a system containerd.
type Containerd struct {
	Base      string // everything lives below; short, since unix socket paths are limited to 108 bytes
	Socket    string
	NRISocket string
	CDIDir    string
	// MountNS, when set, is the mount namespace (/proc/PID/ns/mnt) containerd runs in: one node of
	// a multi-node cluster (multinode.go); its shims and containers inherit it.
	MountNS string
	// Stock: containerd runs as operators run containerd 2.x, with its default configuration and
	// paths (stockConfig; needs MountNS). On every node of a multi-node cluster (nodeRunMounts)
	// Socket, NRISocket and CDIDir are where this host sees the node's
	// /run/containerd/containerd.sock, /var/run/nri/nri.sock and /var/run/cdi.
	Stock bool
	cmd   *exec.Cmd
	log   *os.File
}

// StockCDIDir is the CDI directory tessera-node writes to on a Stock containerd's node: one of
// containerd 2.x's default cdi_spec_dirs (/etc/cdi, /var/run/cdi). Not the agent's default /etc/cdi
// only because /etc is this host's own in every node's mount namespace.
const StockCDIDir = "/var/run/cdi"

// StartContainerd starts containerd and imports the busybox test images (bbox, bbox-pause) into the
// default and k8s.io namespaces. The test's cleanup stops it and removes every trace.
func StartContainerd(t testing.TB) *Containerd { return startContainerd(t, "", false) }

// startContainerd is StartContainerd with containerd in mountNS ("" for the test's own), with
// containerd's stock configuration when stock (Containerd.Stock).
func startContainerd(t testing.TB, mountNS string, stock bool) *Containerd {
	t.Helper()
	base, err := os.MkdirTemp("/tmp", "tsr-")
	if err != nil {
		t.Fatal(err)
	}
	c := &Containerd{Base: base, Socket: filepath.Join(base, "run", "containerd.sock"), NRISocket: filepath.Join(base, "run", "nri.sock"), CDIDir: filepath.Join(base, "cdi"), MountNS: mountNS, Stock: stock}
	if mountNS != "" {
		c.NRISocket = filepath.Join(base, "nri-run", "nri.sock")
	}
	for _, d := range []string{"run", "cdi", "nri/plugins", "nri/conf.d", "nri-run", "root", "cni/bin", "cni/net.d", "runc-root"} {
		if err := os.MkdirAll(filepath.Join(base, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if mountNS != "" {
		c.nodeRunMounts(t)
	} else if stock {
		t.Fatal("a stock containerd needs a node's mount namespace: its default paths are the host's")
	}
	if err := os.WriteFile(filepath.Join(base, "config.toml"), []byte(c.config()), 0o644); err != nil {
		t.Fatal(err)
	}
	// crictl's own configuration, empty: without one it warns on stderr, which Crictl's output
	// (ids, inspect templates) would carry.
	if err := os.WriteFile(filepath.Join(base, "crictl.yaml"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.teardown(t) })
	c.Start(t)
	c.importImages(t)
	return c
}

// nodeRunMounts makes containerd 2.x's default paths the node's own in its mount namespace, so a
// stock containerd runs beside the host's and other nodes' without a path in its configuration,
// and the chart's one DaemonSet finds every node's containerd at the same paths: a tmpfs on /run
// (so /run/containerd, /var/run/nri and /var/run/cdi are private to the node), with
// /run/containerd (state dir, socket), /var/run/nri (NRI's socket) and /var/run/cdi bound to Base's
// run, nri-run and cdi, where this host's harness reaches them, and /var/lib/containerd (root; /var/lib
// is the node's tmpfs, startMountNS) to Base's root. The harness's configuration (not Stock) names
// Base's paths, the same directories.
func (c *Containerd) nodeRunMounts(t testing.TB) {
	t.Helper()
	script := `set -e
mount -t tmpfs -o size=16m,mode=0755 tsr-run /run
mkdir -p /run/containerd /run/nri /run/cdi /var/lib/containerd
mount --bind "$0/run" /run/containerd
mount --bind "$0/nri-run" /run/nri
mount --bind "$0/cdi" /run/cdi
mount --bind "$0/root" /var/lib/containerd`
	argv := inMountNS(t, c.MountNS, "/bin/sh", "-c", script, c.Base)
	mustRun(t, time.Minute, argv[0], argv[1:]...)
}

// stockConfig is containerd 2.x's default configuration but for what this host forces, none of it
// about NRI or CDI: restrict_oom_score_adj (root here lacks CAP_SYS_RESOURCE, and runc would fail to
// start the pause container with oom_score_adj=-998) and the CNI configuration directory (the host
// has no /etc/cni/net.d, and no test writes to the host's /etc; the kubelet's placeholder network is
// in Base). Paths are containerd's defaults, the node's own through nodeRunMounts; the sandbox image is
// containerd's default name (importImages tags the test's pause image so).
func (c *Containerd) stockConfig() string {
	return fmt.Sprintf(`version = 3

[plugins]
  [plugins.'io.containerd.cri.v1.runtime']
    restrict_oom_score_adj = true
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      conf_dir = '%s/cni/net.d'
`, c.Base)
}

func (c *Containerd) config() string {
	if c.Stock {
		return c.stockConfig()
	}
	// restrict_oom_score_adj: root here lacks CAP_SYS_RESOURCE and runc would fail to start the pause
	// container with oom_score_adj=-998 (../shared/recipes/containerd-nri-cdi).
	return fmt.Sprintf(`version = 3
root = '%[1]s/root'
state = '%[1]s/state'

[grpc]
  address = '%[2]s'

[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = 'docker.io/library/bbox-pause:latest'
  [plugins.'io.containerd.cri.v1.runtime']
    enable_cdi = true
    cdi_spec_dirs = ['%[3]s']
    restrict_oom_score_adj = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        # A runtime that passes CDI pod annotations through to the OCI spec (as set up for
        # nvidia-container-runtime's CDI mode or Kata): TestSecurityCluster checks they are refused.
        pod_annotations = ['cdi.k8s.io/*']
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = '%[4]s'
          Root = '%[1]s/runc-root'
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['%[1]s/cni/bin']
      conf_dir = '%[1]s/cni/net.d'
  [plugins.'io.containerd.nri.v1.nri']
    disable = false
    socket_path = '%[5]s'
    plugin_path = '%[1]s/nri/plugins'
    plugin_config_path = '%[1]s/nri/conf.d'
    plugin_registration_timeout = '5s'
    plugin_request_timeout = '2s'
`, c.Base, c.Socket, c.SpecDir(), filepath.Join(toolsDir(), "bin", "runc"), c.NRISocket)
}

// SpecDir is the CDI directory as containerd and the node's processes name it: CDIDir, or on a
// node of a multi-node cluster its /var/run/cdi (nodeRunMounts binds CDIDir there). The runtime
// check compares tessera-node's --cdi-dir with containerd's cdi_spec_dirs by name.
func (c *Containerd) SpecDir() string {
	if c.MountNS != "" {
		return StockCDIDir
	}
	return c.CDIDir
}

// Start launches containerd (again, after Stop) and waits for its socket to answer.
func (c *Containerd) Start(t testing.TB) {
	t.Helper()
	log, err := os.OpenFile(filepath.Join(c.Base, "containerd.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	c.log = log
	argv := inMountNS(t, c.MountNS, tool(t, "containerd"), "--config", filepath.Join(c.Base, "config.toml"))
	c.cmd = exec.Command(argv[0], argv[1:]...)
	c.cmd.Stdout, c.cmd.Stderr = log, log
	// The shim and runc come from the tools dir too.
	c.cmd.Env = append(os.Environ(), "PATH="+filepath.Join(toolsDir(), "bin")+":"+os.Getenv("PATH"))
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 200; i++ {
		if _, err := runCmd(t, 5*time.Second, tool(t, "ctr"), "-a", c.Socket, "version"); err == nil {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("containerd did not come up:\n%s", c.LogTail())
}

// Stop kills containerd (the shims and containers keep running, as on a real node).
func (c *Containerd) Stop(t testing.TB) {
	if c.cmd == nil || c.cmd.Process == nil {
		return
	}
	c.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { c.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		c.cmd.Process.Kill()
		<-done
	}
	c.cmd = nil
	c.log.Close()
}

// Reconfigure restarts containerd with its configuration passed through edit (containers keep
// running in their shims, as across Stop and Start).
func (c *Containerd) Reconfigure(t testing.TB, edit func(string) string) {
	t.Helper()
	cfg := edit(c.config())
	if cfg == c.config() {
		t.Fatal("Reconfigure: the edit changed nothing in containerd's config")
	}
	c.restartWith(t, cfg)
}

// RestoreConfig restarts containerd with its own configuration again, after Reconfigure.
func (c *Containerd) RestoreConfig(t testing.TB) {
	t.Helper()
	c.restartWith(t, c.config())
}

func (c *Containerd) restartWith(t testing.TB, cfg string) {
	t.Helper()
	c.Stop(t)
	if err := os.WriteFile(filepath.Join(c.Base, "config.toml"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	c.Start(t)
}

// LogTail is the end of containerd's log, for failure messages.
func (c *Containerd) LogTail() string {
	data, _ := os.ReadFile(filepath.Join(c.Base, "containerd.log"))
	lines := strings.Split(string(data), "\n")
	return strings.Join(lines[max(0, len(lines)-40):], "\n")
}

func (c *Containerd) importImages(t testing.TB) {
	t.Helper()
	bb := filepath.Join(toolsDir(), "busybox", "bin", "busybox")
	mk := filepath.Join(repoRoot(), "test", "tools", "make-image.sh")
	glibc := filepath.Join(toolsDir(), "glibc")
	if _, err := os.Stat(filepath.Join(glibc, "lib64", "ld-linux-x86-64.so.2")); err != nil {
		t.Fatalf("Debian's glibc for the test image is not unpacked: run `make tools`: %v", err)
	}
	// bbox is busybox plus glibc and cudaprobe, so a share container's dynamically linked CUDA
	// program really loads /etc/ld.so.preload -> libvcuda.so -> the driver's libcuda.so.1.
	probe := BuildSimDriver(t).ProbeOverlay
	for _, img := range []struct {
		file, name, cmd string
		overlays        []string
	}{
		{"bbox.tar", "docker.io/library/bbox:latest", `["/bin/sh"]`, []string{glibc, probe}},
		{"pause.tar", "docker.io/library/bbox-pause:latest", `["/bin/sleep","2147483647"]`, nil},
	} {
		tar := filepath.Join(c.Base, img.file)
		mustRun(t, time.Minute, "bash", append([]string{mk, bb, tar, img.name, img.cmd}, img.overlays...)...)
		for _, ns := range []string{"default", "k8s.io"} {
			mustRun(t, time.Minute, tool(t, "ctr"), "-a", c.Socket, "-n", ns, "images", "import", tar)
		}
	}
	if c.Stock {
		mustRun(t, time.Minute, tool(t, "ctr"), "-a", c.Socket, "-n", "k8s.io", "images", "tag", "docker.io/library/bbox-pause:latest", defaultSandboxImage(t))
	}
}

// defaultSandboxImage is the sandbox (pause) image containerd pins by default, as its default
// configuration names it.
func defaultSandboxImage(t testing.TB) string {
	t.Helper()
	m := regexp.MustCompile(`(?m)^\s*sandbox = '([^']+)'`).FindStringSubmatch(mustRun(t, time.Minute, tool(t, "containerd"), "config", "default"))
	if m == nil {
		t.Fatal("containerd config default names no sandbox image")
	}
	return m[1]
}

// Nerdctl runs nerdctl against this containerd with the given CDI spec dirs.
func (c *Containerd) Nerdctl(t testing.TB, args ...string) (string, error) {
	t.Helper()
	base := []string{"--address", c.Socket, "--data-root", filepath.Join(c.Base, "nerdctl"),
		"--cni-path", filepath.Join(c.Base, "cni/bin"), "--cni-netconfpath", filepath.Join(c.Base, "cni/net.d")}
	return runCmd(t, 2*time.Minute, tool(t, "nerdctl"), append(base, args...)...)
}

// Crictl runs crictl against this containerd's CRI.
func (c *Containerd) Crictl(t testing.TB, args ...string) (string, error) {
	t.Helper()
	base := []string{"--config", filepath.Join(c.Base, "crictl.yaml"), "--runtime-endpoint", "unix://" + c.Socket, "--image-endpoint", "unix://" + c.Socket, "--timeout", "30s"}
	return runCmd(t, 2*time.Minute, tool(t, "crictl"), append(base, args...)...)
}

// teardown removes containers and pods, stops containerd, unmounts everything below Base and
// removes it, then checks nothing is left mounted.
func (c *Containerd) teardown(t testing.TB) {
	if c.cmd != nil {
		c.Crictl(t, "rmp", "-af")
		if out, _ := c.Nerdctl(t, "ps", "-aq"); out != "" {
			c.Nerdctl(t, append([]string{"rm", "-f"}, strings.Fields(out)...)...)
		}
	}
	c.Stop(t)
	// Shims of containers that were still running exit when their runc state goes away; kill any
	// process still holding our base dir, and on a node of a multi-node cluster any left in its
	// mount namespace (a stock containerd's shims name only its default paths).
	killUnder(c.Base)
	if c.MountNS != "" {
		left, _ := pidsInMountNS(c.MountNS) // an error: the namespace is gone, and so is all in it
		for _, pid := range left {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	for _, m := range mountsUnder(c.Base) {
		syscall.Unmount(m, syscall.MNT_DETACH)
	}
	if left := mountsUnder(c.Base); len(left) > 0 {
		t.Errorf("mounts left after teardown: %v", left)
	}
	os.RemoveAll(c.Base)
	// containerd and the shim hard-code a few host paths; remove them if we left them empty.
	for _, d := range []string{"/run/containerd/runc/default", "/run/containerd/runc/k8s.io", "/run/containerd/runc", "/run/containerd/fifo", "/run/containerd/s", "/run/containerd"} {
		os.Remove(d)
	}
}

// mountsUnder lists mount points below dir, deepest first.
func mountsUnder(dir string) []string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && strings.HasPrefix(fields[4], dir+"/") {
			out = append(out, fields[4])
		}
	}
	sort.Sort(sort.Reverse(sort.StringSlice(out)))
	return out
}

// killUnder kills processes whose command line mentions dir (shims started for this containerd).
func killUnder(dir string) {
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		data, err := os.ReadFile(p)
		if err != nil || !strings.Contains(string(data), dir) {
			continue
		}
		var pid int
		fmt.Sscanf(filepath.Base(filepath.Dir(p)), "%d", &pid)
		if pid != os.Getpid() {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	time.Sleep(100 * time.Millisecond)
}
