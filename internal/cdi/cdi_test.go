package cdi

import (
	"context"
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
	return n
}

var testGen = &Generator{Vendor: "tessera.dev", VCUDALibrary: "/opt/tessera/libvcuda.so"}

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
	}
	if !slices.Contains(s.Process.Env, "NVIDIA_VISIBLE_DEVICES=void") || !slices.Contains(s.Process.Env, "TESSERA_GPU_3="+g3.UUID) {
		t.Errorf("env %v", s.Process.Env)
	}
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
	// The share token: control nodes and the vcuda library, read-only, and no GPU of its own.
	s = inject(t, dir, "tessera.dev/vgpu=share")
	if len(s.Mounts) != 1 || s.Mounts[0].Destination != api.VCUDALibraryInContainer || s.Mounts[0].Source != "/opt/tessera/libvcuda.so" || !slices.Contains(s.Mounts[0].Options, "ro") {
		t.Errorf("share mounts %+v", s.Mounts)
	}
	if got := devicePaths(s); slices.ContainsFunc(got, func(p string) bool {
		return strings.HasPrefix(p, "/dev/nvidia") && p != "/dev/nvidiactl" && !strings.HasPrefix(p, "/dev/nvidia-uvm")
	}) {
		t.Errorf("share token carries a GPU node: %v", got)
	}
}

func itoa(i int) string { return strconv.Itoa(i) }

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
