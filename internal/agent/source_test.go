package agent_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"testing/synctest"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/agent"
	"github.com/tessera-gpu/tessera/internal/gpu"
	"github.com/tessera-gpu/tessera/internal/ledger"
	"github.com/tessera-gpu/tessera/internal/podresources"
	"github.com/tessera-gpu/tessera/internal/testing/simagent"
)

func newAgent(t *testing.T) (*agent.Agent, gpu.Backend) {
	t.Helper()
	return simagent.New(t, t.TempDir(), agent.Config{NodeName: "n"})
}

func healthy(devs []*pluginapi.Device) []string {
	var out []string
	for _, d := range devs {
		if d.Health == pluginapi.Healthy {
			out = append(out, d.ID)
		}
	}
	return out
}

func TestResources(t *testing.T) {
	a, _ := newAgent(t)
	res := a.Resources()
	for _, want := range []string{api.ResourceGPU, api.ResourceShare, "nvidia.com/mig-1g.5gb", "nvidia.com/mig-3g.20gb", "tessera.dev/mdev-A100-4C"} {
		if !slices.Contains(res, want) {
			t.Errorf("resources %v lack %s", res, want)
		}
	}
}

func TestModeLocksAndHealth(t *testing.T) { synctest.Test(t, modeLocksAndHealth) }

// modeLocksAndHealth runs in a synctest bubble: the wait for the XID to be watched passes on the
// bubble's clock, at once.
func modeLocksAndHealth(t *testing.T) {
	a, b := newAgent(t)
	inv := a.Inventory()
	if got := healthy(a.Devices(api.ResourceGPU)); len(got) != 6 {
		t.Fatalf("whole tokens healthy %v, want 6", got)
	}
	if got := a.Devices(api.ResourceShare); len(got) != 60 || len(healthy(got)) != 60 {
		t.Fatalf("share tokens %d healthy %d, want 60/60", len(got), len(healthy(got)))
	}
	// A share on GPU 0: five GPUs left for whole use; shares unchanged.
	a.Ledger().Reserve(ledger.Entry{ContainerID: "s", Devices: []api.DeviceAssignment{{UUID: inv.GPUs[0].UUID, MemoryBytes: 1 << 30}}}, inv)
	// GPU 1 held whole: its ten shares go.
	a.Ledger().Reserve(ledger.Entry{ContainerID: "w", Devices: []api.DeviceAssignment{{UUID: inv.GPUs[1].UUID, Whole: true}}}, inv)
	if got := healthy(a.Devices(api.ResourceGPU)); len(got) != 5 {
		t.Errorf("whole tokens healthy %v, want 5", got)
	}
	if got := healthy(a.Devices(api.ResourceShare)); len(got) != 50 {
		t.Errorf("share tokens healthy %d, want 50", len(got))
	}
	// Tokens the kubelet handed out stay healthy, even if they are not the lowest-numbered.
	a.WithAllocated(func(context.Context) (map[podresources.Key]podresources.Grant, error) {
		return map[podresources.Key]podresources.Grant{{Namespace: "ns", Pod: "p", Container: "c"}: {api.ResourceGPU: {"gpu-5"}}}, nil
	})
	if got := healthy(a.Devices(api.ResourceGPU)); len(got) != 5 || !slices.Contains(got, "gpu-5") {
		t.Errorf("in-use token not kept healthy: %v", got)
	}
	// An XID error on GPU 2 takes it out of both pools.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.WatchHealth(ctx) }()
	defer func() { cancel(); <-done }() // nothing may outlive the bubble
	changed := a.Changed()
	for len(changed) > 0 {
		<-changed
	}
	injectXID(t, b, inv.GPUs[2].UUID, 79)
	<-changed
	if got := healthy(a.Devices(api.ResourceGPU)); len(got) != 4 {
		t.Errorf("whole tokens after XID %v, want 4", got)
	}
	if got := healthy(a.Devices(api.ResourceShare)); len(got) != 40 {
		t.Errorf("share tokens after XID %d, want 40", len(got))
	}
	if a.Inventory().GPUs[2].Healthy {
		t.Error("inventory still says GPU 2 is healthy")
	}
}

func TestAllocate(t *testing.T) {
	a, _ := newAgent(t)
	names := func(r *pluginapi.ContainerAllocateResponse) []string {
		var out []string
		for _, d := range r.CdiDevices {
			out = append(out, d.Name)
		}
		return out
	}
	r, err := a.Allocate(api.ResourceGPU, []string{"gpu-0", "gpu-1"})
	if err != nil || !slices.Equal(names(r), []string{"tessera.dev/gpu=common"}) || len(r.Envs) != 0 {
		t.Errorf("whole tokens: %v %v", names(r), err)
	}
	r, _ = a.Allocate(api.ResourceShare, []string{"vgpu-3"})
	if !slices.Equal(names(r), []string{"tessera.dev/vgpu=share"}) {
		t.Errorf("share token: %v", names(r))
	}
	mig := a.Inventory().GPUs[7].MIG.Instances
	r, err = a.Allocate("nvidia.com/mig-1g.5gb", []string{mig[2].UUID})
	if err != nil || !slices.Equal(names(r), []string{"tessera.dev/mig=" + mig[2].UUID}) {
		t.Errorf("MIG: %v %v", names(r), err)
	}
	if _, err := a.Allocate("nvidia.com/mig-1g.5gb", []string{mig[0].UUID}); err == nil || !strings.Contains(err.Error(), "no MIG instance") {
		t.Errorf("a 3g.20gb instance given for 1g.5gb: %v", err)
	}
	// mdev: the device is created on Allocate under the UUID it was offered with, and its CDI spec exists.
	res := api.MdevResource("A100-4C")
	devs := a.Devices(res)
	if len(devs) != 1 {
		t.Fatalf("A100-4C devices %d, want 1", len(devs))
	}
	r, err = a.Allocate(res, []string{devs[0].ID})
	if err != nil || !slices.Equal(names(r), []string{"tessera.dev/mdev=" + devs[0].ID}) {
		t.Fatalf("mdev: %v %v", names(r), err)
	}
	if n := a.Node(); len(n.Mdevs) != 1 || n.Mdevs[0].UUID != devs[0].ID {
		t.Errorf("mdev not created: %+v", n.Mdevs)
	}
	if again := a.Devices(res); len(again) != 1 || again[0].ID != devs[0].ID {
		t.Errorf("the created mdev is not offered under the same ID: %+v", again)
	}
	if _, err := a.Allocate(res, []string{"00000000-0000-4000-8000-000000000000"}); err == nil {
		t.Error("unknown mdev slot allocated")
	}
	if _, err := a.Allocate("example.com/foo", nil); err == nil {
		t.Error("unknown resource allocated")
	}
}

func TestPreferredKeepsMIGOnOneParent(t *testing.T) {
	a, _ := newAgent(t)
	got, err := a.Preferred("nvidia.com/mig-1g.5gb", []string{"x", "y"}, []string{"y"}, 1)
	if err != nil || !slices.Equal(got, []string{"y"}) {
		t.Errorf("must-include only: %v %v", got, err)
	}
	mig := a.Inventory().GPUs[7].MIG.Instances
	got, _ = a.Preferred("nvidia.com/mig-1g.5gb", []string{"other", mig[3].UUID}, []string{mig[2].UUID}, 2)
	if !slices.Equal(got, []string{mig[2].UUID, mig[3].UUID}) {
		t.Errorf("preferred %v, want the same parent's instance first", got)
	}
}

// The device plugins see what dynamic MIG does to a GPU: while a DRA claim holds a MIG instance
// the DRA driver created on it, the GPU is offered neither whole nor in shares and the instance is
// listed but not allocatable; once it is destroyed the GPU is offered whole again.
func TestDevicePluginsFollowDynamicMIG(t *testing.T) {
	a, b := newAgent(t)
	ctx := context.Background()
	wholeBefore := len(a.Devices(api.ResourceGPU))
	inv := a.Inventory()
	g := inv.GPUs[0]
	p := gpu.NewPartitioner(b.NVML())
	places, _, err := p.Placements(g.UUID)
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(places, func(pl gpu.MIGPlacement) bool { return pl.Profile == "1g.5gb" })
	made, err := p.Create(g.UUID, places[i])
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Ledger().Reserve(ledger.Entry{ContainerID: ledger.ClaimID("c"), Claim: &ledger.Claim{UID: "c"}, MIG: []string{made.UUID}, Partitions: []string{g.UUID}}, inv); err != nil {
		t.Fatal(err)
	}
	if err := a.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	if n := len(a.Devices(api.ResourceGPU)); n != wholeBefore-1 {
		t.Errorf("whole GPUs offered while GPU 0 holds a dynamic MIG instance: %d, want %d", n, wholeBefore-1)
	}
	var listed *pluginapi.Device
	for _, d := range a.Devices(api.MIGResource("1g.5gb")) {
		if d.ID == made.UUID {
			listed = d
		}
	}
	if listed == nil || listed.Health != pluginapi.Unhealthy {
		t.Errorf("the claim's new MIG instance in the device plugin: %+v, want listed and not allocatable", listed)
	}
	if err := p.Destroy(g.UUID, made.GPUInstance, made.ComputeInstance); err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.Ledger().Release(ledger.ClaimID("c")); err != nil {
		t.Fatal(err)
	}
	if err := a.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	if n := len(a.Devices(api.ResourceGPU)); n != wholeBefore {
		t.Errorf("whole GPUs once the instance is gone: %d, want %d", n, wholeBefore)
	}
}
