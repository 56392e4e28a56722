package gpu

import (
	"context"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestSimH100Node checks the built-in dgx-h100 description against the product: 8 x H100 SXM5
// 80GB, 132 SMs, compute capability 9.0, NVLink between every pair, and the MIG profiles with the
// memory and SM counts `nvidia-smi mig -lgip` prints on an H100 80GB HBM3.
func TestSimH100Node(t *testing.T) {
	b, err := OpenSim(Options{StateDir: t.TempDir(), NodeDescription: "dgx-h100"})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	n, err := b.Discover(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(n.GPUs) != 8 {
		t.Fatalf("want 8 GPUs, got %d", len(n.GPUs))
	}
	for _, g := range n.GPUs {
		if g.Model != "NVIDIA H100 80GB HBM3" || g.MemoryBytes != 80<<30 || g.SMCount != 132 || g.ComputeCapability != "9.0" {
			t.Errorf("GPU %d: %+v", g.Index, g)
		}
	}
	if len(n.Links) != 28 {
		t.Fatalf("links: %d", len(n.Links))
	}
	for _, l := range n.Links {
		if l.Kind != api.LinkNVLink || l.NVLinks != 18 {
			t.Errorf("GPUs %d-%d linked by %s x %d, want NVLink x 18 (NVLink4)", l.A, l.B, l.Kind, l.NVLinks)
		}
	}
	got := map[string]api.MIGInstance{}
	for _, g := range n.GPUs[6:] {
		for _, m := range g.MIG.Instances {
			got[m.Profile] = m
		}
	}
	// Memory in MiB as NVML reports it (nvidia-smi prints GiB: 9.75, 19.62, 39.50, 79.25).
	for profile, want := range map[string]struct{ sms, memMiB int }{
		"1g.10gb": {16, 9984}, "1g.10gb+me": {16, 9984}, "1g.20gb": {26, 20096}, "2g.20gb": {32, 20096},
		"3g.40gb": {60, 40448}, "4g.40gb": {64, 40448},
	} {
		m, ok := got[profile]
		if !ok {
			t.Errorf("no %s instance on the H100 node (have %v)", profile, keys(got))
			continue
		}
		if m.SMCount != want.sms || m.MemoryBytes != int64(want.memMiB)<<20 {
			t.Errorf("%s: %d SMs, %d MiB; want %d SMs, %d MiB", profile, m.SMCount, m.MemoryBytes>>20, want.sms, want.memMiB)
		}
	}
	// The whole-GPU profile exists as well, on a GPU of its own.
	one, err := OpenSim(Options{StateDir: t.TempDir(), NodeDescription: writeTemp(t,
		"apiVersion: tessera.dev/v1\nkind: SimulatedNode\ngpus:\n- model: H100-SXM5-80GB\n  count: 1\n  mig: [7g.80gb]\n")})
	if err != nil {
		t.Fatal(err)
	}
	defer one.Close()
	n1, err := one.Discover(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if m := n1.GPUs[0].MIG.Instances[0]; m.Profile != "7g.80gb" || m.SMCount != 132 || m.MemoryBytes != 81152<<20 {
		t.Errorf("7g.80gb: %+v", m)
	}
	// The resource names the device plugin will serve are valid, with "+" mapped to ".".
	if r := api.MIGResource(got["1g.10gb+me"].Profile); r != "nvidia.com/mig-1g.10gb.me" {
		t.Errorf("resource of 1g.10gb+me: %s", r)
	}
	if _, err := api.EncodeInventory(n.Inventory("h100-node", 10)); err != nil {
		t.Fatal(err)
	}
}

func keys[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// TestSMCount: the SM count of a full GPU comes from its PCI device ID, never from
// GetAttributes where NVML refuses it; an unknown model is an error naming the device.
func TestSMCount(t *testing.T) {
	dev := func(id uint32, attrs nvml.Return) *mock.Device {
		return &mock.Device{
			GetPciInfoFunc: func() (nvml.PciInfo, nvml.Return) { return nvml.PciInfo{PciDeviceId: id<<16 | 0x10de}, nvml.SUCCESS },
			GetAttributesFunc: func() (nvml.DeviceAttributes, nvml.Return) {
				return nvml.DeviceAttributes{MultiprocessorCount: 99}, attrs
			},
		}
	}
	for _, c := range []struct {
		id   uint32
		want int
	}{{0x2330, 132}, {0x2331, 114}, {0x20b0, 108}, {0x20b7, 56}, {0x26b9, 142}} {
		if got, err := smCount(dev(c.id, nvml.ERROR_NOT_SUPPORTED), "x"); err != nil || got != c.want {
			t.Errorf("device 0x%04x: %d, %v; want %d", c.id, got, err, c.want)
		}
	}
	// A driver that does answer GetAttributes on a full GPU of an unlisted model is believed.
	if got, err := smCount(dev(0x1234, nvml.SUCCESS), "x"); err != nil || got != 99 {
		t.Errorf("unlisted model with attributes: %d, %v", got, err)
	}
	if _, err := smCount(dev(0x1234, nvml.ERROR_NOT_SUPPORTED), "NVIDIA Future GPU"); err == nil ||
		!strings.Contains(err.Error(), "NVIDIA Future GPU (PCI device 0x1234) unknown") {
		t.Errorf("unknown model: %v", err)
	}
}

func TestSimDescriptionRejectsMIGWithoutMIG(t *testing.T) {
	_, err := ParseDescription([]byte("apiVersion: tessera.dev/v1\nkind: SimulatedNode\ngpus:\n- model: L40S-PCIE-48GB\n  count: 1\n  mig: [1g.10gb]\n"))
	if err == nil || !strings.Contains(err.Error(), "L40S-PCIE-48GB has no MIG mode") {
		t.Errorf("MIG on an L40S: %v", err)
	}
}
