package cdi

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/gpu"
)

// testGen is set by simNode: the generator over that simulated node's NVML and driver root.
var testGen *Generator

const testHook = "/usr/local/bin/nvidia-cdi-hook"

func simNode(t *testing.T) *gpu.Node {
	t.Helper()
	b, err := gpu.OpenSim(gpu.Options{StateDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	n, err := b.Discover(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	testGen = &Generator{Vendor: "tessera.dev", VCUDALibrary: "/opt/tessera/libvcuda.so", Driver: &Driver{HookPath: testHook, NVML: b.NVML()}}
	return n
}

func writeSpecs(t *testing.T, n *gpu.Node, dir string) []string {
	t.Helper()
	all, err := testGen.Specs(n)
	if err != nil {
		t.Fatal(err)
	}
	if err := (&Writer{Dir: dir}).Sync(all); err != nil {
		t.Fatal(err)
	}
	return DeviceNames(all)
}

// inject resolves devices through a fresh CDI cache over dir, as containerd does, into an empty OCI spec.
func inject(t *testing.T, dir string, devices ...string) *oci.Spec {
	t.Helper()
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	if errs := cache.GetErrors(); len(errs) > 0 {
		t.Fatalf("CDI cache errors: %v", errs)
	}
	s := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	if unresolved, err := cache.InjectDevices(s, devices...); err != nil {
		t.Fatalf("inject %v: unresolved %v: %v", devices, unresolved, err)
	}
	return s
}

func devicePaths(s *oci.Spec) []string {
	var p []string
	for _, d := range s.Linux.Devices {
		p = append(p, d.Path)
	}
	slices.Sort(p)
	return p
}

func TestSpecsLoadAndInject(t *testing.T) {
	n := simNode(t)
	dir := t.TempDir()
	names := writeSpecs(t, n, dir)
	g3 := n.GPUs[3]
	for _, want := range []string{"tessera.dev/gpu=" + g3.UUID, "tessera.dev/gpu=3", "tessera.dev/gpu=all", "tessera.dev/vgpu=share",
		"tessera.dev/mig=" + n.GPUs[7].MIG.Instances[0].UUID} {
		if !slices.Contains(names, want) {
			t.Errorf("device %s not generated (have %v)", want, names)
		}
	}
	for _, bad := range []string{"tessera.dev/gpu=" + n.GPUs[7].UUID, "tessera.dev/gpu=6"} {
		if slices.Contains(names, bad) {
			t.Errorf("%s is a MIG GPU or an mdev parent and must not be offered whole", bad)
		}
	}

	// A whole GPU by UUID: its node, the control nodes, the env; the device's major/minor come from the host node.
	s := inject(t, dir, "tessera.dev/gpu="+g3.UUID)
	if got, want := devicePaths(s), []string{"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia3", "/dev/nvidiactl"}; !slices.Equal(got, want) {
		t.Errorf("devices %v, want %v", got, want)
	}
	for _, d := range s.Linux.Devices {
		if d.Path == "/dev/nvidia3" && (d.Major != 195 || d.Minor != 3 || d.Type != "c") {
			t.Errorf("/dev/nvidia3 injected as %+v", d)
		}
		// nvidia-uvm's major is dynamic: it must be the one the (simulated) kernel lists, read from the node.
		if d.Path == "/dev/nvidia-uvm" && (d.Major != 511 || d.Minor != 0 || d.Type != "c") {
			t.Errorf("/dev/nvidia-uvm injected as %+v", d)
		}
	}
	if !slices.Contains(s.Process.Env, "NVIDIA_VISIBLE_DEVICES=void") || !slices.Contains(s.Process.Env, "TESSERA_GPU_3="+g3.UUID) {
		t.Errorf("env %v", s.Process.Env)
	}
	checkDriverEdits(t, n, s)
	// By index: the same device.
	if got := devicePaths(inject(t, dir, "tessera.dev/gpu=3")); !slices.Contains(got, "/dev/nvidia3") {
		t.Errorf("gpu=3 gave %v", got)
	}
	// MIG: the parent node and the instance's two capability nodes.
	m := n.GPUs[7].MIG.Instances[2]
	got := devicePaths(inject(t, dir, "tessera.dev/mig="+m.UUID))
	for _, want := range []string{"/dev/nvidia7", "/dev/nvidia-caps/nvidia-cap" + itoa(m.GICapMinor), "/dev/nvidia-caps/nvidia-cap" + itoa(m.CICapMinor), "/dev/nvidiactl"} {
		if !slices.Contains(got, want) {
			t.Errorf("MIG device lacks %s: %v", want, got)
		}
	}
	// The share token: the driver's common edits, the vcuda library read-only, and no GPU of its own.
	s = inject(t, dir, "tessera.dev/vgpu=share")
	vcuda := mountAt(s, api.VCUDALibraryInContainer)
	if vcuda == nil || vcuda.Source != "/opt/tessera/libvcuda.so" || !slices.Contains(vcuda.Options, "ro") {
		t.Errorf("share mounts %+v", s.Mounts)
	}
	checkDriverEdits(t, n, s)
	if got := devicePaths(s); slices.ContainsFunc(got, func(p string) bool {
		return strings.HasPrefix(p, "/dev/nvidia") && p != "/dev/nvidiactl" && !strings.HasPrefix(p, "/dev/nvidia-uvm")
	}) {
		t.Errorf("share token carries a GPU node: %v", got)
	}
}

func itoa(i int) string { return strconv.Itoa(i) }

func mountAt(s *oci.Spec, dst string) *oci.Mount {
	for i := range s.Mounts {
		if s.Mounts[i].Destination == dst {
			return &s.Mounts[i]
		}
	}
	return nil
}

// checkDriverEdits asserts what nvcdi puts in every GPU container, from the simulated driver root:
// the versioned driver libraries, nvidia-smi, GSP firmware and the persistenced socket, read-only
// where they are files, and the hooks that make libcuda.so.1 resolvable (symlinks, ldcache).
func checkDriverEdits(t *testing.T, n *gpu.Node, s *oci.Spec) {
	t.Helper()
	v := "580.95.05"
	for dst, src := range map[string]string{
		"/usr/lib/x86_64-linux-gnu/libcuda.so." + v:      "usr/lib/x86_64-linux-gnu/libcuda.so." + v,
		"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so." + v: "usr/lib/x86_64-linux-gnu/libnvidia-ml.so." + v,
		"/usr/bin/nvidia-smi":                            "usr/bin/nvidia-smi",
		"/lib/firmware/nvidia/" + v + "/gsp_ga10x.bin":   "lib/firmware/nvidia/" + v + "/gsp_ga10x.bin",
		"/run/nvidia-persistenced/socket":                "run/nvidia-persistenced/socket",
		gpu.SimGPUFileInContainer:                        strings.TrimPrefix(gpu.SimGPUFileInContainer, "/"),
	} {
		m := mountAt(s, dst)
		if m == nil {
			t.Errorf("no mount at %s: %+v", dst, s.Mounts)
			continue
		}
		if m.Source != filepath.Join(n.DriverRoot, src) {
			t.Errorf("%s mounted from %s, want the driver root's %s", dst, m.Source, src)
		}
		if !strings.HasSuffix(dst, "socket") && !slices.Contains(m.Options, "ro") {
			t.Errorf("%s is not read-only: %v", dst, m.Options)
		}
	}
	// The simulated driver's state directory: read-write, so the driver inside can record what each
	// process holds for the host's NVML.
	if m := mountAt(s, gpu.SimDriverStateInContainer); m == nil || m.Source != filepath.Join(n.DriverRoot, strings.TrimPrefix(gpu.SimDriverStateInContainer, "/")) ||
		!slices.Contains(m.Options, "rw") || slices.Contains(m.Options, "ro") {
		t.Errorf("simulated driver state mount %+v, want %s read-write from the driver root", m, gpu.SimDriverStateInContainer)
	}
	var hooks []string
	for _, h := range s.Hooks.CreateContainer {
		if h.Path != testHook {
			t.Errorf("hook %v does not run the configured nvidia-cdi-hook", h)
		}
		hooks = append(hooks, strings.Join(h.Args, " "))
	}
	joined := strings.Join(hooks, "\n")
	for _, want := range []string{"create-symlinks --link libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so", "update-ldcache --folder /usr/lib/x86_64-linux-gnu"} {
		if !strings.Contains(joined, want) {
			t.Errorf("hooks lack %q:\n%s", want, joined)
		}
	}
}

func TestSyncOwnsOnlyItsFilesAndRemovesStale(t *testing.T) {
	n := simNode(t)
	dir := t.TempDir()
	foreign := filepath.Join(dir, "nvidia.yaml")
	if err := os.WriteFile(foreign, []byte("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: x\n  containerEdits:\n    env: [A=1]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	writeSpecs(t, n, dir)
	migFile := filepath.Join(dir, "tessera-tessera.dev-mig.json")
	if _, err := os.Stat(migFile); err != nil {
		t.Fatal(err)
	}
	// The MIG GPU goes back to normal mode: the mig spec must disappear, the GPU become a whole device.
	n.GPUs[7].MIG = nil
	names := writeSpecs(t, n, dir)
	if _, err := os.Stat(migFile); !os.IsNotExist(err) {
		t.Errorf("stale MIG spec still there: %v", err)
	}
	if !slices.Contains(names, "tessera.dev/gpu=7") {
		t.Errorf("GPU 7 not offered whole after leaving MIG mode")
	}
	if _, err := os.Stat(foreign); err != nil {
		t.Errorf("foreign spec touched: %v", err)
	}
	// An unchanged spec is not rewritten (containerd's watcher would churn on every resync).
	gpuFile := filepath.Join(dir, "tessera-tessera.dev-gpu.json")
	before, _ := os.Stat(gpuFile)
	writeSpecs(t, n, dir)
	after, _ := os.Stat(gpuFile)
	if !os.SameFile(before, after) {
		t.Errorf("unchanged spec was rewritten")
	}
}

// In the DaemonSet the agent sees the host's driver root through a mount: the specs must name host
// paths, and the device numbers still come from the nodes the agent sees.
func TestSpecsNameHostPaths(t *testing.T) {
	n := simNode(t)
	gen := *testGen
	driver := *gen.Driver
	driver.HostRoot = "/run/nvidia/driver"
	gen.Driver = &driver
	all, err := gen.Specs(n)
	if err != nil {
		t.Fatal(err)
	}
	var sawLib bool
	for _, s := range all {
		for _, m := range s.ContainerEdits.Mounts {
			if strings.HasPrefix(m.HostPath, n.DriverRoot) {
				t.Errorf("%s: mount %s names the agent's view of the driver root", s.Kind, m.HostPath)
			}
			sawLib = sawLib || m.HostPath == "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05"
		}
		for _, d := range s.ContainerEdits.DeviceNodes {
			if d.Major == 0 || d.Type != "c" {
				t.Errorf("%s: device node %+v without its host numbers", s.Kind, d)
			}
		}
	}
	if !sawLib {
		t.Error("libcuda is not mounted from the host driver root")
	}
	// A device node that does not exist is never promised: a missing control node is left out
	// (nvcdi emits only what exists; discovery recreates it first), a missing GPU node fails.
	os.Remove(filepath.Join(n.DevRoot, "dev/nvidia-uvm-tools"))
	all, err = gen.Specs(n)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range all {
		for _, d := range s.ContainerEdits.DeviceNodes {
			if d.Path == "/dev/nvidia-uvm-tools" {
				t.Errorf("%s promises the missing /dev/nvidia-uvm-tools", s.Kind)
			}
		}
	}
	os.Remove(filepath.Join(n.DevRoot, "dev/nvidia3"))
	if _, err := gen.Specs(n); err == nil || !strings.Contains(err.Error(), "nvidia3") {
		t.Errorf("missing GPU node: %v", err)
	}
}

func TestSyncErrors(t *testing.T) {
	n := simNode(t)
	all, _ := testGen.Specs(n)
	file := filepath.Join(t.TempDir(), "file")
	os.WriteFile(file, nil, 0o644)
	err := (&Writer{Dir: filepath.Join(file, "cdi")}).Sync(all)
	if err == nil || !strings.Contains(err.Error(), "create CDI spec dir") || !strings.Contains(err.Error(), "--cdi-dir") {
		t.Errorf("unwritable dir: %v", err)
	}
	if _, err := (&Generator{Vendor: "bad vendor!"}).Specs(n); err == nil || !strings.Contains(err.Error(), `CDI vendor "bad vendor!"`) {
		t.Errorf("bad vendor: %v", err)
	}
	if _, err := (&Generator{Vendor: "tessera.dev", VCUDALibrary: "libvcuda.so"}).Specs(n); err == nil || !strings.Contains(err.Error(), "must be absolute") {
		t.Errorf("relative vcuda library: %v", err)
	}
}

// A driver installed as a flat folder, like /usr/local/nvidia (lib64/, bin/) mounted read-only:
// nvcdi finds its libraries and nvidia-smi there, and the specs mount them from it.
func TestDriverFolderLayout(t *testing.T) {
	n := simNode(t)
	folder := t.TempDir()
	v := "580.95.05"
	for rel, data := range map[string]string{
		"lib64/libcuda.so." + v:                  "lib",
		"lib64/libnvidia-ml.so." + v:             "lib",
		"lib64/libnvidia-ptxjitcompiler.so." + v: "lib",
		"bin/nvidia-smi":                         "bin",
	} {
		p := filepath.Join(folder, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(folder, 0o555); err != nil {
		t.Fatal(err)
	}
	gen := *testGen
	driver := *gen.Driver
	driver.Root = folder
	gen.Driver = &driver
	all, err := gen.Specs(n)
	if err != nil {
		t.Fatal(err)
	}
	mounts := map[string]string{}
	for _, m := range all[0].ContainerEdits.Mounts {
		mounts[m.ContainerPath] = m.HostPath
	}
	for dst, src := range map[string]string{
		"/lib64/libcuda.so." + v:      filepath.Join(folder, "lib64/libcuda.so."+v),
		"/lib64/libnvidia-ml.so." + v: filepath.Join(folder, "lib64/libnvidia-ml.so."+v),
		"/bin/nvidia-smi":             filepath.Join(folder, "bin/nvidia-smi"),
	} {
		if mounts[dst] != src {
			t.Errorf("mount %s from %q, want %s (mounts: %v)", dst, mounts[dst], src, mounts)
		}
	}
}

// nvcdi's lines reach the Driver's slog logger (one log setup per binary, passed down), tagged
// with their source.
func TestNvcdiLogsReachSlog(t *testing.T) {
	var buf strings.Builder
	n := simNode(t)
	gen, driver := *testGen, *testGen.Driver
	driver.Log = slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	gen.Driver = &driver
	if _, err := gen.Specs(n); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(buf.String(), "component=nvcdi") || !strings.Contains(buf.String(), "Using driver version") {
		t.Errorf("nvcdi's lines did not reach slog:\n%s", buf.String())
	}
}
