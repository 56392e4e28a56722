package dra

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// Agent is what the driver needs of the node agent: the inventory with health, the ledger both
// front doors reserve in, and the CDI names of its specs.
type Agent interface {
	Inventory() *api.NodeInventory
	Ledger() *ledger.Ledger
	Generator() *cdi.Generator
}

// Driver implements kubeletplugin.DRAPlugin over the agent.
type Driver struct {
	agent Agent
	log   *slog.Logger
	// unprepared is told each claim the kubelet unprepared (OnUnprepared).
	unprepared func(uid string)
}

var _ kubeletplugin.DRAPlugin = (*Driver)(nil)

// New returns the driver; Run registers it with the kubelet. log receives its lines (nil:
// discarded).
func New(a Agent, log *slog.Logger) *Driver {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Driver{agent: a, log: log}
}

// OnUnprepared sets what is told, by UID, of every claim the kubelet unprepares once the ledger has
// released it: the NRI plugin removes the claim's shared vcuda region and limits (every pod using
// the claim is gone by then). It returns d.
func (d *Driver) OnUnprepared(f func(uid string)) *Driver {
	d.unprepared = f
	return d
}

// Options are where the kubelet looks for the plugin.
type Options struct {
	NodeName string
	Client   kubernetes.Interface
	// RegistrarDir is the kubelet's plugin registry (<kubelet root>/plugins_registry).
	RegistrarDir string
	// PluginDir holds the driver's DRA socket (<kubelet root>/plugins/gpu.tessera.dev).
	PluginDir string
	// RepublishInterval is how often the slices are compared with the inventory and republished
	// when they differ (health changes, rediscovery).
	RepublishInterval time.Duration
}

// Run registers with the kubelet, publishes the node's ResourceSlices and keeps them current
// until ctx ends.
func (d *Driver) Run(ctx context.Context, o Options) error {
	if o.RepublishInterval == 0 {
		o.RepublishInterval = 5 * time.Second
	}
	// The kubelet creates its registry; the plugin's own socket directory is ours to make.
	if err := os.MkdirAll(o.PluginDir, 0o750); err != nil {
		return fmt.Errorf("create the DRA plugin's socket directory: %w", err)
	}
	helper, err := kubeletplugin.Start(ctx, d,
		kubeletplugin.DriverName(DriverName),
		kubeletplugin.NodeName(o.NodeName),
		kubeletplugin.KubeClient(o.Client),
		kubeletplugin.RegistrarDirectoryPath(o.RegistrarDir),
		kubeletplugin.PluginDataDirectoryPath(o.PluginDir),
		// Device health goes into the slices (unhealthy devices are left out), not the health API.
		kubeletplugin.HealthService(false))
	if err != nil {
		return fmt.Errorf("start the DRA kubelet plugin %s (registry %s, socket dir %s): %w", DriverName, o.RegistrarDir, o.PluginDir, err)
	}
	defer helper.Stop()
	d.log.Info("DRA kubelet plugin started", "driver", DriverName, "registry", o.RegistrarDir, "pluginDir", o.PluginDir)
	var last *resourceslice.DriverResources
	t := time.NewTicker(o.RepublishInterval)
	defer t.Stop()
	for {
		res := Resources(d.agent.Inventory())
		if last == nil || !equality.Semantic.DeepEqual(*last, res) {
			if err := helper.PublishResources(ctx, res); err != nil {
				d.log.Error("publish ResourceSlices", "driver", DriverName, "err", err)
			} else {
				last = &res
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// HandleError logs background errors (slice publishing); they are retried by the helper.
func (d *Driver) HandleError(ctx context.Context, err error, msg string) {
	d.log.Error("DRA plugin: "+msg, "driver", DriverName, "err", err, "recoverable", errors.Is(err, kubeletplugin.ErrRecoverable))
}

// WatchHealthStatus is off (HealthService(false)); health shows in the slices.
func (d *Driver) WatchHealthStatus(ctx context.Context, reports chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}

// PrepareResourceClaims records each claim's devices in the ledger, which refuses what would
// over-commit a GPU together with everything else it holds (device-plugin shares included), and
// returns the CDI devices of the same specs the device-plugin path uses. The ledger entry is the
// checkpoint: it is on disk before the answer, and a repeated call (kubelet restart) finds it.
func (d *Driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, c := range claims {
		devs, err := d.prepare(c)
		if err != nil {
			d.log.Error("cannot prepare ResourceClaim", "claim", c.Namespace+"/"+c.Name, "uid", c.UID, "err", err)
			err = fmt.Errorf("tessera: ResourceClaim %s/%s: %w", c.Namespace, c.Name, err)
		} else {
			d.log.Info("ResourceClaim prepared", "claim", c.Namespace+"/"+c.Name, "uid", c.UID, "devices", len(devs))
		}
		out[c.UID] = kubeletplugin.PrepareResult{Devices: devs, Err: err}
	}
	return out, nil
}

func (d *Driver) prepare(c *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	if c.Status.Allocation == nil {
		return nil, errors.New("it is not allocated")
	}
	inv := d.agent.Inventory()
	gen := d.agent.Generator()
	e := ledger.Entry{ContainerID: ledger.ClaimID(string(c.UID)), Namespace: c.Namespace, Container: "resourceclaim/" + c.Name,
		Claim: &ledger.Claim{UID: string(c.UID), Namespace: c.Namespace, Name: c.Name}}
	for _, r := range c.Status.ReservedFor {
		if r.Resource == "pods" && r.APIGroup == "" {
			e.Claim.PodUIDs = append(e.Claim.PodUIDs, string(r.UID))
			if e.PodUID == "" {
				e.PodUID, e.Pod = string(r.UID), r.Name
			}
		}
	}
	if len(e.Claim.PodUIDs) == 0 {
		return nil, errors.New("it is reserved for no pod (status.reservedFor); the kubelet prepares claims of pods only")
	}
	var out []kubeletplugin.Device
	requestOf := map[string]string{} // device -> the request it was first allocated to
	for _, r := range c.Status.Allocation.Devices.Results {
		if r.Driver != DriverName {
			continue
		}
		if first, ok := requestOf[r.Device]; ok {
			return nil, sameDeviceTwice(r.Device, first, r.Request)
		}
		requestOf[r.Device] = r.Request
		if r.Pool != inv.Node {
			return nil, fmt.Errorf("device %s is in pool %q, this node's pool is %q", r.Device, r.Pool, inv.Node)
		}
		if r.AdminAccess != nil && *r.AdminAccess {
			return nil, fmt.Errorf("device %s: admin access is not supported by %s; list the namespace in the agent's adminNamespaces instead", r.Device, DriverName)
		}
		names, err := d.result(c, &r, inv, gen, &e)
		if err != nil {
			return nil, err
		}
		out = append(out, kubeletplugin.Device{Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device, CDIDeviceIDs: names, ShareID: r.ShareID})
	}
	if err := d.agent.Ledger().Reserve(e, inv); err != nil {
		return nil, err
	}
	return out, nil
}

// sameDeviceTwice is the refusal of a claim allocated one device for two of its requests (a GPU
// allows multiple allocations, so without a distinctAttribute constraint the allocator may put two
// shares on one GPU). The ledger and the holdings the extender reads give a GPU to a holder once.
func sameDeviceTwice(device, first, second string) error {
	what, requests := fmt.Sprintf("both request %q and request %q", first, second), first+", "+second
	if first == second {
		what, requests = fmt.Sprintf("request %q twice", first), first
	}
	return fmt.Errorf("device %s is allocated to %s of this claim, and one claim may hold a device only once: "+
		"add a constraint {requests: [%s], distinctAttribute: %s/%s} to put them on different GPUs, or ask for one larger share in a single request",
		device, what, requests, DriverName, AttrUUID)
}

// result adds one allocated device to the claim's entry and returns its CDI names.
func (d *Driver) result(c *resourceapi.ResourceClaim, r *resourceapi.DeviceRequestAllocationResult, inv *api.NodeInventory, gen *cdi.Generator, e *ledger.Entry) ([]string, error) {
	for i := range inv.GPUs {
		g := &inv.GPUs[i]
		if g.Shareable() && r.Device == GPUDeviceName(g.Index) {
			share, err := shareOf(c, r, g)
			if err != nil {
				return nil, err
			}
			e.Devices = append(e.Devices, share)
			if share.Whole {
				return []string{gen.Name(cdi.ClassGPU, cdi.CommonName), gen.Name(cdi.ClassGPU, g.UUID)}, nil
			}
			return []string{gen.Name(cdi.ClassShare, cdi.ShareName), gen.Name(cdi.ClassGPU, g.UUID)}, nil
		}
		if g.MIG == nil {
			continue
		}
		for j := range g.MIG.Instances {
			m := &g.MIG.Instances[j]
			if r.Device == MIGDeviceName(g.Index, m) {
				if !g.Healthy {
					return nil, fmt.Errorf("MIG instance %s: its GPU %s is unhealthy", m.UUID, g.UUID)
				}
				e.MIG = append(e.MIG, m.UUID)
				return []string{gen.Name(cdi.ClassMIG, m.UUID)}, nil
			}
		}
	}
	return nil, fmt.Errorf("device %s is not a device of this node (its slices may be out of date)", r.Device)
}

// shareOf turns an allocation of a GPU device into the ledger's terms: a request that asked for no
// capacity got all of it (the policy's default) and holds the GPU whole; otherwise it is a share
// capped at the memory and compute it consumed.
func shareOf(c *resourceapi.ResourceClaim, r *resourceapi.DeviceRequestAllocationResult, g *api.GPU) (api.DeviceAssignment, error) {
	if !asksCapacity(c, r.Request) {
		return api.DeviceAssignment{UUID: g.UUID, Whole: true}, nil
	}
	mem, ok := r.ConsumedCapacity[CapacityMemory]
	if !ok {
		return api.DeviceAssignment{}, fmt.Errorf("device %s: the allocation records no consumed %s", r.Device, CapacityMemory)
	}
	cores := int64(0)
	if q, ok := r.ConsumedCapacity[CapacityCompute]; ok {
		cores = q.Value()
	}
	if mem.Value() <= 0 || mem.Value() > g.MemoryBytes || cores < 0 || cores > api.MaxCoresPercent {
		return api.DeviceAssignment{}, fmt.Errorf("device %s: consumed memory %s and compute %d%% are outside the GPU's %d bytes and 100%%", r.Device, mem.String(), cores, g.MemoryBytes)
	}
	if need := minShareMemory(g); mem.Value() < need {
		return api.DeviceAssignment{}, fmt.Errorf("device %s: share memory %s is below the %d MiB a CUDA context takes on this GPU (compute capability %q): vcuda could not create one; ask for at least %dMi of %s",
			r.Device, mem.String(), need>>20, g.ComputeCapability, need>>20, CapacityMemory)
	}
	return api.DeviceAssignment{UUID: g.UUID, MemoryBytes: mem.Value(), CoresPercent: int(cores)}, nil
}

// asksCapacity reports whether the claim's request (or subrequest, "req/sub") names any capacity.
func asksCapacity(c *resourceapi.ResourceClaim, request string) bool {
	name, sub, _ := strings.Cut(request, "/")
	for _, rq := range c.Spec.Devices.Requests {
		if rq.Name != name {
			continue
		}
		if sub == "" && rq.Exactly != nil {
			return rq.Exactly.Capacity != nil && len(rq.Exactly.Capacity.Requests) > 0
		}
		i := slices.IndexFunc(rq.FirstAvailable, func(s resourceapi.DeviceSubRequest) bool { return s.Name == sub })
		if i >= 0 {
			s := rq.FirstAvailable[i]
			return s.Capacity != nil && len(s.Capacity.Requests) > 0
		}
	}
	return false
}

// UnprepareResourceClaims releases the claims' ledger entries (idempotent: a claim the ledger does
// not hold is already released) and tells OnUnprepared's function of each.
func (d *Driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := make(map[types.UID]error, len(claims))
	for _, c := range claims {
		e, ok, err := d.agent.Ledger().Release(ledger.ClaimID(string(c.UID)))
		if err != nil {
			err = fmt.Errorf("tessera: release ResourceClaim %s: %w", c.String(), err)
		} else if ok {
			d.log.Info("ResourceClaim unprepared", "claim", c.String(), "uid", c.UID, "devices", e.Devices, "mig", e.MIG)
		}
		if err == nil && d.unprepared != nil {
			d.unprepared(string(c.UID))
		}
		out[c.UID] = err
	}
	return out, nil
}
