package dra

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/utils/ptr"

	"github.com/tessera-gpu/tessera/internal/ledger"
)

// taints lists each tainted device of the pool as "device:key:effect".
func taints(res func() []resourceapi.Device) []string {
	var out []string
	for _, d := range res() {
		for _, tn := range d.Taints {
			out = append(out, d.Name+":"+tn.Key+":"+string(tn.Effect))
		}
	}
	return out
}

// TestResourcesTaintUnhealthy: an unhealthy GPU stays in the slice with the unhealthy taint (the
// operator's effect), a MIG instance is tainted when it or its GPU is unhealthy, and a recovered
// device carries no taint.
func TestResourcesTaintUnhealthy(t *testing.T) {
	for _, tc := range []struct {
		name      string
		unhealthy map[string]string
		effect    resourceapi.DeviceTaintEffect
		want      []string
	}{
		{"GPU", map[string]string{"GPU-d": "XID 79"}, resourceapi.DeviceTaintEffectNoSchedule, []string{"gpu-3:gpu.tessera.dev/unhealthy:NoSchedule"}},
		{"NoExecute", map[string]string{"GPU-d": "XID 79"}, resourceapi.DeviceTaintEffectNoExecute, []string{"gpu-3:gpu.tessera.dev/unhealthy:NoExecute"}},
		{"MIGInstance", map[string]string{"MIG-y": "XID 94"}, resourceapi.DeviceTaintEffectNoSchedule, []string{"gpu-2-mig-7-0:gpu.tessera.dev/unhealthy:NoSchedule"}},
		{"MIGParent", map[string]string{"GPU-c": "GPU lost"}, resourceapi.DeviceTaintEffectNoSchedule,
			[]string{"gpu-2-mig-1-0:gpu.tessera.dev/unhealthy:NoSchedule", "gpu-2-mig-7-0:gpu.tessera.dev/unhealthy:NoSchedule"}},
		{"Recovered", nil, resourceapi.DeviceTaintEffectNoSchedule, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := &fakeAgent{inv: testInventory(), unhealthy: tc.unhealthy}
			inv := a.Inventory()
			got := taints(func() []resourceapi.Device {
				return Resources(inv, tc.unhealthy, tc.effect, nil).Pools["node-a"].Slices[0].Devices
			})
			if !slices.Equal(got, tc.want) {
				t.Errorf("taints %v, want %v", got, tc.want)
			}
			if n := len(Resources(inv, tc.unhealthy, tc.effect, nil).Pools["node-a"].Slices[0].Devices); n != 5 {
				t.Errorf("%d devices, want all 5 whatever their health", n)
			}
		})
	}
}

// TestHealthReport: every published device, unhealthy ones with the reason, for the kubelet.
func TestHealthReport(t *testing.T) {
	unhealthy := map[string]string{"GPU-d": "XID 79", "MIG-x": "XID 94"}
	a := &fakeAgent{inv: testInventory(), unhealthy: unhealthy}
	now := time.Unix(1700000000, 0)
	got := map[string]kubeletplugin.DeviceHealth{}
	for _, d := range HealthReport(a.Inventory(), unhealthy, now, nil).Devices {
		got[d.DeviceName] = d
		if d.PoolName != "node-a" || !d.LastUpdated.Equal(now) || d.HealthCheckTimeout != healthTimeout {
			t.Errorf("%+v: want pool node-a, stamped now, the 30 s timeout", d)
		}
	}
	want := map[string]string{"gpu-0": "Healthy/", "gpu-1": "Healthy/", "gpu-2-mig-1-0": "Unhealthy/XID 94", "gpu-2-mig-7-0": "Healthy/", "gpu-3": "Unhealthy/XID 79"}
	if len(got) != len(want) {
		t.Errorf("report covers %d devices, want %d", len(got), len(want))
	}
	for name, w := range want {
		if g := got[name]; string(g.Health)+"/"+g.Message != w {
			t.Errorf("%s: %s/%s, want %s", name, g.Health, g.Message, w)
		}
	}
}

// adminClaim is claim() with every result allocated with admin access, as the API server allows
// only in namespaces labelled resource.kubernetes.io/admin-access=true.
func adminClaim(name string, devices ...string) *resourceapi.ResourceClaim {
	c := claim(name, nil, devices...)
	c.Spec.Devices.Requests[0].Exactly.AdminAccess = ptr.To(true)
	for i := range c.Status.Allocation.Devices.Results {
		c.Status.Allocation.Devices.Results[i].AdminAccess = ptr.To(true)
	}
	return c
}

// TestPrepareAdminAccess: a monitoring claim with admin access is prepared on a GPU another claim
// holds whole, on an unhealthy GPU and on a MIG instance in use: it gets the device nodes, is
// recorded (so the NRI plugin lets exactly those in), and charges nothing, caps nothing.
func TestPrepareAdminAccess(t *testing.T) {
	d, a, _ := newDriver(t)
	if r := prepare(t, d, claim("w", nil, "gpu-0")); r.Err != nil {
		t.Fatal(r.Err)
	}
	if r := prepare(t, d, claim("m", nil, "gpu-2-mig-7-0")); r.Err != nil {
		t.Fatal(r.Err)
	}
	before := a.l.Usage()
	r := prepare(t, d, adminClaim("mon", "gpu-0", "gpu-3", "gpu-2-mig-7-0"))
	if r.Err != nil {
		t.Fatalf("admin-access claim: %v", r.Err)
	}
	if got, want := cdiNames(r), []string{"tessera.dev/gpu=common", "tessera.dev/gpu=GPU-a", "tessera.dev/gpu=common", "tessera.dev/gpu=GPU-d", "tessera.dev/mig=MIG-y"}; !slices.Equal(got, want) {
		t.Errorf("CDI devices %v, want %v (device nodes, no vcuda)", got, want)
	}
	e, ok := a.l.Get(ledger.ClaimID("uid-mon"))
	if !ok || len(e.Devices) != 0 || len(e.MIG) != 0 || e.Claim == nil || !slices.Equal(e.Claim.AdminAccess, []string{"GPU-a", "GPU-d", "MIG-y"}) {
		t.Fatalf("ledger entry %+v: want the claim recorded with admin access to GPU-a, GPU-d and MIG-y and holding nothing", e)
	}
	after := a.l.Usage()
	for uuid, u := range after {
		if b := before[uuid]; u.Whole != b.Whole || u.MemoryBytes != b.MemoryBytes || u.Shares != b.Shares {
			t.Errorf("%s usage %+v after the admin claim, was %+v: admin access must charge nothing", uuid, u, b)
		}
	}
	// Without admin access the same claim is refused (the GPU is held whole).
	if r := prepare(t, d, claim("plain", nil, "gpu-0")); r.Err == nil || !strings.Contains(r.Err.Error(), "GPU-a") {
		t.Errorf("a plain claim on a GPU held whole: %v, want a refusal", r.Err)
	}
}

// TestDeviceStatusData: status.devices data per kind of device: a whole GPU, a MIG instance (with
// its parent), and admin access (nothing held, whatever else the entry lists).
func TestDeviceStatusData(t *testing.T) {
	d, a, _ := newDriver(t)
	for _, c := range []*resourceapi.ResourceClaim{claim("w", nil, "gpu-1"), claim("m", nil, "gpu-2-mig-7-0"), adminClaim("mon", "gpu-1")} {
		if r := prepare(t, d, c); r.Err != nil {
			t.Fatal(r.Err)
		}
		e, _ := a.l.Get(ledger.ClaimID(string(c.UID)))
		devs, err := deviceStatus(c, e, a.Inventory(), nil)
		if err != nil || len(devs) != 1 || devs[0].Data == nil {
			t.Fatalf("%s: %v %v", c.Name, devs, err)
		}
		var got DeviceData
		if err := json.Unmarshal(devs[0].Data.Raw, &got); err != nil {
			t.Fatal(err)
		}
		want := map[string]DeviceData{"w": {UUID: "GPU-b", Whole: true}, "m": {UUID: "MIG-y", ParentUUID: "GPU-c"}, "mon": {UUID: "GPU-b", AdminAccess: true}}[c.Name]
		if got != want {
			t.Errorf("%s: data %+v, want %+v", c.Name, got, want)
		}
	}
}
