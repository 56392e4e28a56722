package gpu

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// CUDA in a container of a simulated MIG instance sees what a real driver shows there: one device,
// the instance's memory and SMs under its UUID, not its parent GPU; the fake driver finds it from the
// node file's mig lines by the capability nodes the container got (as the CDI spec gives them).
func TestSimGPUFileMIGInstanceInContainer(t *testing.T) {
	_, n := openTestSim(t, "")
	libDir, probe := buildFakeDriver(t)
	g := &n.GPUs[7]
	if g.MIG == nil || len(g.MIG.Instances) < 3 {
		t.Fatalf("GPU 7 MIG: %+v", g.MIG)
	}
	file, err := os.ReadFile(n.SimGPUFile)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range g.MIG.Instances {
		line := fmt.Sprintf("mig %d %s %d %d %d %d %s\n", g.Minor, m.UUID, m.GICapMinor, m.CICapMinor, m.MemoryBytes, m.SMCount, m.Profile)
		if !strings.Contains(string(file), line) {
			t.Errorf("node file lacks %q:\n%s", line, file)
		}
	}
	// The 1g.5gb instance's container: the device nodes its CDI device lists, and nvidiactl.
	m := g.MIG.Instances[2]
	dev := filepath.Join(t.TempDir(), "dev")
	nodes := []string{"nvidiactl"}
	for _, d := range n.MIGNodes(g, &m) {
		nodes = append(nodes, strings.TrimPrefix(d.Path, "/dev/"))
	}
	for _, name := range nodes {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dev, name)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink("/dev/null", filepath.Join(dev, name)); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(probe, "info")
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "FAKE_") { // node-file mode: no FAKE_CUDA_DEVICES
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "LD_LIBRARY_PATH="+libDir, "FAKE_GPU_NODE_FILE="+n.SimGPUFile, "FAKE_DEV_ROOT="+dev,
		"FAKE_SIM_DRIVER_DIR="+n.SimDriverState)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("cudaprobe info (nodes %v): %v\n%s", nodes, err, out)
	}
	// cudaprobe prints the device's 16 UUID bytes in GPU-... form, whatever the device.
	want := fmt.Sprintf(`(?m)^device=0 name=%s_MIG_%s total_mem=%d meminfo_total=%d .* uuid=GPU-%s sms=%d cc=%s `,
		regexp.QuoteMeta(strings.ReplaceAll(g.Model, " ", "_")), regexp.QuoteMeta(m.Profile), m.MemoryBytes, m.MemoryBytes,
		strings.TrimPrefix(m.UUID, "MIG-"), m.SMCount, regexp.QuoteMeta(g.ComputeCapability))
	if !strings.Contains(string(out), "devices=1\n") || !regexp.MustCompile(want).MatchString(string(out)) {
		t.Errorf("CUDA in the %s container (GPU memory %d, SMs %d):\n%s\nwant one device matching %s", m.Profile, g.MemoryBytes, g.SMCount, out, want)
	}
}

// The node file carries no instance the fake driver could not honour: the simulated node refuses
// to write one, naming it.
func TestSimGPUFileRefusesImpossibleInstance(t *testing.T) {
	good := api.MIGInstance{UUID: "MIG-4f1e0a2b-1111-4000-8000-0000000000aa", Profile: "1g.5gb", MemoryBytes: 5 << 30, SMCount: 14, GICapMinor: 21, CICapMinor: 22}
	for name, c := range map[string]struct {
		mutate func(*api.MIGInstance)
		want   string
	}{
		"no memory":            {func(m *api.MIGInstance) { m.MemoryBytes = 0 }, "bytes of memory"},
		"more memory than GPU": {func(m *api.MIGInstance) { m.MemoryBytes = 41 << 30 }, "bytes of memory"},
		"no SMs":               {func(m *api.MIGInstance) { m.SMCount = 0 }, "SMs"},
		"more SMs than GPU":    {func(m *api.MIGInstance) { m.SMCount = 109 }, "SMs"},
		"GPU UUID":             {func(m *api.MIGInstance) { m.UUID = "GPU-4f1e0a2b-1111-4000-8000-0000000000aa" }, "not a MIG-"},
		"profile with a space": {func(m *api.MIGInstance) { m.Profile = "1g 5gb" }, "profile"},
		"no profile":           {func(m *api.MIGInstance) { m.Profile = "" }, "profile"},
	} {
		m := good
		c.mutate(&m)
		n := &Node{SimGPUFile: filepath.Join(t.TempDir(), "gpus"), GPUs: []api.GPU{{UUID: "GPU-7063a1b2-0000-4000-8000-000000000002", Minor: 2,
			MemoryBytes: 40 << 30, SMCount: 108, ComputeCapability: "8.0", Model: "NVIDIA A100-SXM4-40GB", MIG: &api.MIG{Instances: []api.MIGInstance{m}}}}}
		err := writeSimGPUFile(n)
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "GPU-7063a1b2") {
			t.Errorf("%s: %v, want an error naming the GPU and %q", name, err, c.want)
		}
		if _, serr := os.Stat(n.SimGPUFile); serr == nil {
			t.Errorf("%s: the node file was written", name)
		}
		n.GPUs[0].MIG.Instances[0] = good
		if err := writeSimGPUFile(n); err != nil {
			t.Errorf("%s: the good instance refused: %v", name, err)
		}
	}
}
