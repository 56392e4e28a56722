package gpu

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	api "github.com/tessera-gpu/tessera/api/v1"
)

func openTestSim(t *testing.T, description string) (*simBackend, *Node) {
	t.Helper()
	opts := Options{Backend: "sim", StateDir: t.TempDir()}
	if description != "" {
		opts.NodeDescription = filepath.Join(t.TempDir(), "node.yaml")
		if err := os.WriteFile(opts.NodeDescription, []byte(description), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	b, err := Open(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	n, err := b.Discover(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return b.(*simBackend), n
}

func TestSimDefaultNode(t *testing.T) {
	_, n := openTestSim(t, "")
	if len(n.GPUs) != 8 {
		t.Fatalf("want 8 GPUs, got %d", len(n.GPUs))
	}
	// The driver's versions as NVML reports them: 580.95.05 supports CUDA 13.0 (NVML's 13000).
	if inv := n.Inventory("n", 4); inv.DriverVersion != "580.95.05" || inv.CUDAVersion != "13.0" {
		t.Errorf("driver %q, CUDA %q; want 580.95.05 and 13.0", inv.DriverVersion, inv.CUDAVersion)
	}
	for v, want := range map[int]string{13000: "13.0", 12040: "12.4", 11080: "11.8"} {
		if got := cudaVersion(v); got != want {
			t.Errorf("cudaVersion(%d) = %q, want %q", v, got, want)
		}
	}
	g0 := n.GPUs[0]
	if g0.Model != "NVIDIA A100-SXM4-40GB" || g0.MemoryBytes != 40960<<20 || g0.SMCount != 108 || g0.ComputeCapability != "8.0" ||
		g0.PCIBusID != "0000:07:00.0" || g0.NUMANode != 0 || n.GPUs[5].NUMANode != 1 || !api.IsGPUUUID(g0.UUID) {
		t.Errorf("GPU 0 described as %+v", g0)
	}
	// MIG: GPU 7 carries the default's four instances, with cap minors from the mig-minors table.
	mig := n.GPUs[7].MIG
	if mig == nil || len(mig.Instances) != 4 {
		t.Fatalf("GPU 7 MIG: %+v", mig)
	}
	var profiles []string
	for _, m := range mig.Instances {
		profiles = append(profiles, m.Profile)
		if m.GICapMinor < 3 || m.CICapMinor != m.GICapMinor+1+m.ComputeInstanceID {
			t.Errorf("MIG %s cap minors %d/%d", m.UUID, m.GICapMinor, m.CICapMinor)
		}
	}
	if got := strings.Join(profiles, ","); got != "3g.20gb,2g.10gb,1g.5gb,1g.5gb" {
		t.Errorf("MIG profiles %s", got)
	}
	if mig.Instances[0].SMCount != 42 || mig.Instances[0].MemoryBytes <= 19<<30 {
		t.Errorf("3g.20gb instance %+v", mig.Instances[0])
	}
	// mdev: GPU 6 is the parent, with go-nvlib's A100 types.
	if len(n.GPUs[6].Mdev) == 0 || n.GPUs[6].Mdev[0].Name != "A100-4C" || n.GPUs[6].Mdev[0].ID != "nvidia-500" || len(n.GPUs[0].Mdev) != 0 {
		t.Errorf("mdev types: GPU6 %+v GPU0 %+v", n.GPUs[6].Mdev, n.GPUs[0].Mdev)
	}
	// Topology: NVSwitch makes every pair NVLink.
	if len(n.Links) != 28 || n.Links[0].Kind != api.LinkNVLink || n.Links[0].NVLinks != 12 {
		t.Errorf("links: %d, first %+v", len(n.Links), n.Links[0])
	}
	// The inventory the agent would publish is valid.
	if _, err := api.EncodeInventory(n.Inventory("node-a", 10)); err != nil {
		t.Fatal(err)
	}
}

func TestSimDeviceNodes(t *testing.T) {
	_, n := openTestSim(t, "")
	check := func(d DeviceNode, major, minor uint32) {
		t.Helper()
		var st unix.Stat_t
		if err := unix.Stat(d.HostPath, &st); err != nil {
			t.Fatalf("%s: %v", d.HostPath, err)
		}
		if st.Mode&unix.S_IFMT != unix.S_IFCHR || unix.Major(st.Rdev) != major || unix.Minor(st.Rdev) != minor {
			t.Errorf("%s is %o %d:%d, want char %d:%d", d.HostPath, st.Mode, unix.Major(st.Rdev), unix.Minor(st.Rdev), major, minor)
		}
		if !strings.HasPrefix(d.HostPath, n.DevRoot) || !strings.HasPrefix(d.Path, "/dev/") {
			t.Errorf("device node %+v not under dev root %s", d, n.DevRoot)
		}
	}
	check(n.GPUNode(&n.GPUs[3]), 195, 3)
	check(n.ControlNodes()[0], 195, 255)
	m := n.GPUs[7].MIG.Instances[2]
	nodes := n.MIGNodes(&n.GPUs[7], &m)
	check(nodes[1], 510, uint32(m.GICapMinor))
	check(nodes[2], 510, uint32(m.CICapMinor))
	// A file of the wrong kind is replaced on the next discovery.
	os.Remove(n.GPUNode(&n.GPUs[3]).HostPath)
	os.WriteFile(n.GPUNode(&n.GPUs[3]).HostPath, nil, 0o644)
	if err := EnsureDeviceNodes(n); err != nil {
		t.Fatal(err)
	}
	check(n.GPUNode(&n.GPUs[3]), 195, 3)
	// Missing uvm and caps nodes are created as nvidia-modprobe would, on the majors /proc/devices lists.
	uvm := filepath.Join(n.DevRoot, "dev/nvidia-uvm")
	for _, p := range []string{uvm, filepath.Join(n.DevRoot, "dev/nvidia-uvm-tools"), nodes[1].HostPath, nodes[2].HostPath} {
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
	}
	if err := EnsureDeviceNodes(n); err != nil {
		t.Fatal(err)
	}
	check(DeviceNode{Path: "/dev/nvidia-uvm", HostPath: uvm}, 511, 0)
	check(DeviceNode{Path: "/dev/nvidia-uvm-tools", HostPath: filepath.Join(n.DevRoot, "dev/nvidia-uvm-tools")}, 511, 1)
	check(nodes[1], 510, uint32(m.GICapMinor))
	// Without the uvm module the node cannot be made: the error names the module and the fix.
	if err := os.WriteFile(n.ProcDevices, []byte("Character devices:\n195 nvidia\n510 nvidia-caps\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	os.Remove(uvm)
	if err := EnsureDeviceNodes(n); err == nil || !strings.Contains(err.Error(), "nvidia-uvm kernel module is not loaded") || !strings.Contains(err.Error(), "nvidia-modprobe") {
		t.Errorf("no uvm module: %v", err)
	}
	if _, err := os.Stat(uvm); err == nil {
		t.Error("created /dev/nvidia-uvm without a major")
	}
}

func TestSimDescription(t *testing.T) {
	_, n := openTestSim(t, "apiVersion: tessera.dev/v1\nkind: SimulatedNode\nseed: other\ntopology: pcie\ngpusPerNUMA: 2\ngpus:\n- model: H100-SXM5-80GB\n  count: 3\n- model: A30-PCIE-24GB\n  count: 1\n  mig: [1g.6gb, 2g.12gb]\n")
	if len(n.GPUs) != 4 || n.GPUs[0].Model != "NVIDIA H100 80GB HBM3" || n.GPUs[0].SMCount != 132 || n.GPUs[3].SMCount != 56 {
		t.Fatalf("GPUs: %+v", n.GPUs)
	}
	inv := n.Inventory("n", 1)
	if inv.Distance(0, 1) != api.LinkPCIeSwitch.Distance() || inv.Distance(0, 2) != api.LinkSystem.Distance() || inv.Distance(2, 3) != api.LinkPCIeSwitch.Distance() {
		t.Errorf("pcie topology distances: %+v", n.Links)
	}
	if got := n.GPUs[3].MIG.Instances[1].Profile; got != "2g.12gb" {
		t.Errorf("A30 MIG profile %s", got)
	}
	_, def := openTestSim(t, "")
	if def.GPUs[0].UUID == n.GPUs[0].UUID {
		t.Error("different seeds gave the same UUID")
	}
	_, again := openTestSim(t, "")
	if def.GPUs[0].UUID != again.GPUs[0].UUID {
		t.Error("the same seed gave different UUIDs")
	}
}

func TestSimDescriptionRejects(t *testing.T) {
	head := "apiVersion: tessera.dev/v1\nkind: SimulatedNode\n"
	for doc, want := range map[string]string{
		head + "gpus:\n- model: GTX-1080\n  count: 1\n":                                      `gpus[0].model: Unsupported value: "GTX-1080": supported values: "A100-PCIE-40GB"`,
		head + "gpus:\n- model: A100-SXM4-40GB\n  count: 0\n":                                "gpus[0].count: Invalid value: 0: must be between 1 and 64",
		head + "gpus:\n- model: A100-SXM4-40GB\n  count: 1\n  mig: [huge]\n":                 `gpus[0].mig[0]: Invalid value: "huge": not a MIG profile`,
		head + "gpus:\n- model: A100-SXM4-40GB\n  count: 1\n  mig: [1g.5gb]\n  mdev: true\n": "either an mdev parent or in MIG mode",
		head + "topology: ring\ngpus:\n- model: A100-SXM4-40GB\n  count: 1\n":                `topology: Unsupported value: "ring": supported values: "nvswitch", "pcie"`,
		head + "gpus:\n- model: A100-SXM4-40GB\n  count: 65\n":                               "a node has 1 to 64 GPUs",
		head + "gpus: []\ncolor: red\n":                                                      "color: Forbidden: unknown field",
		"apiVersion: v1\nkind: Node\ngpus:\n- model: A100-SXM4-40GB\n  count: 1\n":           "apiVersion/kind must be",
	} {
		if _, err := ParseDescription([]byte(doc)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("description %q: error %v, want %q", doc, err, want)
		}
	}
	// A profile the model does not offer is refused when the node is built, naming what it offers.
	_, err := OpenSim(Options{StateDir: t.TempDir(), NodeDescription: writeTemp(t, head+"gpus:\n- model: A100-SXM4-40GB\n  count: 1\n  mig: [1g.6gb]\n")})
	if err == nil || !strings.Contains(err.Error(), `MIG profile "1g.6gb" is not offered`) || !strings.Contains(err.Error(), "1g.5gb") {
		t.Errorf("unknown profile: %v", err)
	}
	if _, err := OpenSim(Options{DevRoot: "/"}); err == nil || !strings.Contains(err.Error(), "real /dev") {
		t.Errorf("sim in /dev: %v", err)
	}
}

func writeTemp(t *testing.T, s string) string {
	p := filepath.Join(t.TempDir(), "f.yaml")
	if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestSimMdevCreateRemove(t *testing.T) {
	b, n := openTestSim(t, "")
	parent := n.GPUs[6]
	before := parent.Mdev[0]
	const id = "3a1f5a4e-0000-4000-8000-000000000001"
	if err := b.CreateMdev(parent.PCIBusID, before.Name, id); err != nil {
		t.Fatal(err)
	}
	n2, err := b.Discover(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(n2.Mdevs) != 1 || n2.Mdevs[0].UUID != id || n2.Mdevs[0].Type != before.Name || n2.Mdevs[0].ParentBus != parent.PCIBusID {
		t.Fatalf("mdev devices after create: %+v", n2.Mdevs)
	}
	after := n2.GPUs[6].Mdev[0]
	if after.Available != before.Available-1 || len(after.Instances) != 1 || after.Instances[0] != id {
		t.Errorf("type after create: %+v (before %+v)", after, before)
	}
	// The VFIO nodes for it exist now.
	for _, d := range n2.VFIONodes(&n2.Mdevs[0]) {
		if _, err := os.Stat(d.HostPath); err != nil {
			t.Errorf("VFIO node: %v", err)
		}
	}
	if err := b.CreateMdev(parent.PCIBusID, before.Name, "3a1f5a4e-0000-4000-8000-000000000002"); err == nil || !strings.Contains(err.Error(), "no A100-4C instances left") {
		t.Errorf("second create of a one-instance type: %v", err)
	}
	if err := b.RemoveMdev(id); err != nil {
		t.Fatal(err)
	}
	n3, _ := b.Discover(context.Background())
	if len(n3.Mdevs) != 0 || n3.GPUs[6].Mdev[0].Available != before.Available {
		t.Errorf("after remove: %+v %+v", n3.Mdevs, n3.GPUs[6].Mdev[0])
	}
	if err := b.RemoveMdev(id); err != nil {
		t.Errorf("removing a missing mdev: %v", err)
	}
	if err := b.CreateMdev("0000:99:00.0", before.Name, id); err == nil || !strings.Contains(err.Error(), "no mdev parent at 0000:99:00.0") {
		t.Errorf("unknown parent: %v", err)
	}
}

func FuzzParseDescription(f *testing.F) {
	f.Add([]byte(DefaultDescription))
	f.Add([]byte("apiVersion: tessera.dev/v1\nkind: SimulatedNode\ngpus:\n- {model: A30-PCIE-24GB, count: 2, mig: [1g.6gb]}\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		d, err := ParseDescription(data)
		if err != nil {
			return
		}
		// Whatever parses names known models and a sane GPU count.
		total := 0
		for _, g := range d.GPUs {
			if _, ok := SimModels[g.Model]; !ok || g.Count < 1 {
				t.Fatalf("accepted %+v", g)
			}
			total += g.Count
		}
		if total < 1 || total > 64 {
			t.Fatalf("accepted %d GPUs", total)
		}
	})
}

// A state dir too deep for the persistenced socket fails with a message that says so and what to do.
func TestSimSocketPathTooLong(t *testing.T) {
	deep := filepath.Join(t.TempDir(), strings.Repeat("d", 100))
	_, err := OpenSim(Options{StateDir: deep})
	if err == nil || !strings.Contains(err.Error(), "more than a unix socket path can hold") || !strings.Contains(err.Error(), "shorter --state-dir") {
		t.Fatalf("OpenSim with a %d-byte state dir: %v", len(deep), err)
	}
}
