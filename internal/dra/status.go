package dra

import (
	"context"
	"encoding/json"
	"fmt"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	resourceapply "k8s.io/client-go/applyconfigurations/resource/v1"
	"k8s.io/client-go/kubernetes"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// DeviceData is what a prepared claim's status.devices[].data says of each of its devices
// (DRAResourceClaimDeviceStatus): which GPU or MIG instance it is and the share's caps.
type DeviceData struct {
	UUID       string `json:"uuid"`
	ParentUUID string `json:"parentUUID,omitempty"`
	// Whole: the claim holds the GPU whole (no caps).
	Whole bool `json:"whole,omitempty"`
	// MemoryBytes and ComputePercent are a share's caps, as vcuda enforces them.
	MemoryBytes    int64 `json:"memoryBytes,omitempty"`
	ComputePercent int   `json:"computePercent,omitempty"`
	// AdminAccess: monitoring access, nothing held or capped.
	AdminAccess bool `json:"adminAccess,omitempty"`
}

// deviceStatus is the claim's status.devices for this driver, from its prepared ledger entry.
func deviceStatus(c *resourceapi.ResourceClaim, e ledger.Entry, inv *api.NodeInventory, dyn map[string]Partitionable) ([]*resourceapply.AllocatedDeviceStatusApplyConfiguration, error) {
	type ids struct{ uuid, parent string }
	byName := map[string]ids{}
	for i := range inv.GPUs {
		g := &inv.GPUs[i]
		if g.Shareable() {
			byName[GPUDeviceName(g.Index)] = ids{uuid: g.UUID}
		}
		if g.MIG != nil {
			for j := range g.MIG.Instances {
				byName[MIGDeviceName(g.Index, &g.MIG.Instances[j])] = ids{uuid: g.MIG.Instances[j].UUID, parent: g.UUID}
			}
		}
	}
	for parent, p := range dyn {
		for name, uuid := range p.Instances {
			byName[name] = ids{uuid: uuid, parent: parent}
		}
	}
	var out []*resourceapply.AllocatedDeviceStatusApplyConfiguration
	for _, r := range c.Status.Allocation.Devices.Results {
		if r.Driver != DriverName {
			continue
		}
		id, ok := byName[r.Device]
		if !ok {
			return nil, fmt.Errorf("device %s is not a device of this node", r.Device)
		}
		d := DeviceData{UUID: id.uuid, ParentUUID: id.parent, AdminAccess: r.AdminAccess != nil && *r.AdminAccess}
		for _, a := range e.Devices {
			if a.UUID == id.uuid && !d.AdminAccess {
				d.Whole, d.MemoryBytes, d.ComputePercent = a.Whole, a.MemoryBytes, a.CoresPercent
			}
		}
		raw, err := json.Marshal(d)
		if err != nil {
			return nil, err
		}
		s := resourceapply.AllocatedDeviceStatus().WithDriver(DriverName).WithPool(r.Pool).WithDevice(r.Device).WithData(runtime.RawExtension{Raw: raw})
		if r.ShareID != nil {
			s.WithShareID(string(*r.ShareID))
		}
		out = append(out, s)
	}
	return out, nil
}

// writeStatus applies the claim's status.devices (server-side apply, field manager = the driver's
// name, so other drivers' entries stay). It is information for people and tools: a failure is
// logged, the claim stays prepared. The API server lets the agent write it only for claims
// allocated on its own node (resourceclaims/driver, associated-node:patch).
func (d *Driver) writeStatus(ctx context.Context, client kubernetes.Interface, c *resourceapi.ResourceClaim) {
	e, ok := d.agent.Ledger().Get(ledger.ClaimID(string(c.UID)))
	if !ok || client == nil {
		return
	}
	devs, err := deviceStatus(c, e, d.agent.Inventory(), d.partitionable())
	if err == nil {
		cfg := resourceapply.ResourceClaim(c.Name, c.Namespace).WithStatus(resourceapply.ResourceClaimStatus().WithDevices(devs...))
		_, err = client.ResourceV1().ResourceClaims(c.Namespace).ApplyStatus(ctx, cfg, metav1.ApplyOptions{FieldManager: DriverName, Force: true})
	}
	if err != nil {
		d.log.Warn("cannot write the ResourceClaim's status.devices", "claim", c.Namespace+"/"+c.Name, "uid", c.UID, "err", err)
	}
}
