//go:build realnvml

package gpu

import (
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// TestRealNVMLRefusals runs the sim's refusal table against the driver of this machine, which is
// what keeps the sim honest; rows whose kind of handle this machine lacks (no MIG GPU, say) are
// listed as not applicable. On a GPU node:
//
//	go test -tags realnvml ./internal/gpu -run RealNVML -count=1 -v
func TestRealNVMLRefusals(t *testing.T) {
	lib := nvml.New()
	if ret := lib.Init(); ret != nvml.SUCCESS {
		t.Fatalf("initialise NVML: %v (this test needs an NVIDIA GPU and its driver)", nvml.ErrorString(ret))
	}
	defer lib.Shutdown()
	var h refusalHandles
	count, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		t.Fatalf("count GPUs: %v", nvml.ErrorString(ret))
	}
	for i := 0; i < count; i++ {
		d, ret := lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			t.Fatalf("GPU %d: %v", i, nvml.ErrorString(ret))
		}
		mode, _, ret := d.GetMigMode()
		switch {
		case ret == nvml.ERROR_NOT_SUPPORTED && h.noMIG == nil:
			h.noMIG = d
		case ret == nvml.SUCCESS && mode == nvml.DEVICE_MIG_DISABLE && h.migOff == nil:
			h.migOff = d
		case ret == nvml.SUCCESS && mode == nvml.DEVICE_MIG_ENABLE && h.migOn == nil:
			h.migOn = d
			for j := 0; j < 7 && h.mig == nil; j++ {
				if m, ret := d.GetMigDeviceHandleByIndex(j); ret == nvml.SUCCESS {
					h.mig = m
					h.migUUID, _ = m.GetUUID()
				}
			}
		}
		if supported, ret := d.GetSupportedEventTypes(); ret == nvml.SUCCESS && supported&nvml.EventTypeDoubleBitEccError == 0 && h.eccOff == nil {
			h.eccOff = d
		}
	}
	set, ret := lib.EventSetCreate()
	if ret != nvml.SUCCESS {
		t.Fatalf("create an event set: %v", nvml.ErrorString(ret))
	}
	defer set.Free()
	h.set = set
	applied := 0
	for _, c := range refusalTable(lib, h) {
		if !h.has(c.needs) {
			t.Logf("n/a here (no %s handle): %s on %s", c.needs, c.call, c.handle)
			continue
		}
		applied++
		if got := c.got(); got != c.want {
			t.Errorf("%s on %s: this driver returns %v, the table (and the sim) %v (nvml.h:%s)", c.call, c.handle, nvml.ErrorString(got), nvml.ErrorString(c.want), c.doc)
		} else {
			t.Logf("ok: %s on %s: %v", c.call, c.handle, nvml.ErrorString(got))
		}
	}
	if applied == 0 {
		t.Fatal("no row of the table applied to this machine's GPUs")
	}
	// Discovery runs on what the driver answers, SM counts included.
	n, err := discover(lib, discoverOptions{migMinorsPath: "/proc/driver/nvidia-caps/mig-minors"})
	if err != nil {
		t.Fatalf("discovery on the real driver: %v", err)
	}
	for _, g := range n.GPUs {
		t.Logf("GPU %d: %s, %d MiB, %d SMs, compute %s, MIG %v", g.Index, g.Model, g.MemoryBytes>>20, g.SMCount, g.ComputeCapability, g.MIG != nil)
	}
}
