package dra

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// Agent is what the driver needs of the node agent: the inventory with health, the ledger both
// front doors reserve in, and the CDI names of its specs.
type Agent interface {
	Inventory() *api.NodeInventory
	// Unhealthy is why each unhealthy GPU or MIG instance (by UUID) is unhealthy.
	Unhealthy() map[string]string
	// WatchInventory fires after every rediscovery and health change.
	WatchInventory() <-chan struct{}
	Ledger() *ledger.Ledger
	Generator() *cdi.Generator
}

// Driver implements kubeletplugin.DRAPlugin over the agent.
type Driver struct {
	agent Agent
	log   *slog.Logger
	// unprepared is told each claim the kubelet unprepared (OnUnprepared).
	unprepared func(uid string)
	// observe is told how long each claim's prepare or unprepare took (Observe).
	observe func(call string, took time.Duration, err error)
	// now stamps health reports (tests set it).
	now func() time.Time

	mu sync.Mutex
	// client writes the claims' status.devices (set by Run).
	client kubernetes.Interface
	// sockets are the registration and DRA sockets once the helper serves them (Ready).
	sockets []string
	// changed is closed and replaced at every inventory change: the health streams wait on it.
	changed chan struct{}
	// mig is dynamic MIG (WithDynamicMIG; nil: off).
	mig *dynamicMIG
}

var _ kubeletplugin.DRAPlugin = (*Driver)(nil)

// New returns the driver; Run registers it with the kubelet. log receives its lines (nil:
// discarded).
func New(a Agent, log *slog.Logger) *Driver {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Driver{agent: a, log: log, now: time.Now, changed: make(chan struct{})}
}

// OnUnprepared sets what is told, by UID, of every claim the kubelet unprepares once the ledger has
// released it: the NRI plugin removes the claim's shared vcuda region and limits (every pod using
// the claim is gone by then). It returns d.
func (d *Driver) OnUnprepared(f func(uid string)) *Driver {
	d.unprepared = f
	return d
}

// Calls Observe reports.
const (
	CallPrepare   = "prepare"
	CallUnprepare = "unprepare"
)

// Observe sets what is told how long each claim's prepare or unprepare took (call is CallPrepare or
// CallUnprepare) and its error: the agent's latency histograms. It returns d.
func (d *Driver) Observe(f func(call string, took time.Duration, err error)) *Driver {
	d.observe = f
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
	// UnhealthyEffect is the taint effect on unhealthy devices: NoSchedule (the default: new
	// claims avoid them, running pods stay and learn of it through the health API) or NoExecute
	// (the kubelet's eviction controller also evicts pods that use them and do not tolerate it).
	UnhealthyEffect resourceapi.DeviceTaintEffect
	// RollingUpdateUID is the agent pod's UID (downward API). Set, the plugin registers under
	// sockets named for it, so the kubelet keeps the old and the new agent of a DaemonSet rolling
	// update with maxSurge registered side by side and prepared claims stay prepared throughout;
	// the helper serialises both agents' calls through a file lock in PluginDir. Needs kubelet 1.33+.
	RollingUpdateUID types.UID
}

// healthResend is how often the health stream repeats itself when nothing changed: the kubelet
// reports a device's health as unknown once healthTimeout passes without a report.
const (
	healthResend  = 10 * time.Second
	healthTimeout = 30 * time.Second
)

// Run registers with the kubelet, publishes the node's ResourceSlices and republishes them at
// every inventory change (rediscovery, health) until ctx ends; the helper's ResourceSlice
// controller writes only what differs from the API server's copy.
func (d *Driver) Run(ctx context.Context, o Options) error {
	switch o.UnhealthyEffect {
	case "":
		o.UnhealthyEffect = resourceapi.DeviceTaintEffectNoSchedule
	case resourceapi.DeviceTaintEffectNoSchedule, resourceapi.DeviceTaintEffectNoExecute:
	default:
		return fmt.Errorf("DRA unhealthy device taint effect %q: want %s or %s", o.UnhealthyEffect, resourceapi.DeviceTaintEffectNoSchedule, resourceapi.DeviceTaintEffectNoExecute)
	}
	// The kubelet creates its registry; the plugin's own socket directory is ours to make.
	if err := os.MkdirAll(o.PluginDir, 0o750); err != nil {
		return fmt.Errorf("create the DRA plugin's socket directory: %w", err)
	}
	if d.mig != nil {
		d.cleanupMIG(ctx, d.agent.Ledger())
	}
	changes := d.agent.WatchInventory()
	opts := []kubeletplugin.Option{kubeletplugin.DriverName(DriverName),
		kubeletplugin.NodeName(o.NodeName),
		kubeletplugin.KubeClient(o.Client),
		kubeletplugin.RegistrarDirectoryPath(o.RegistrarDir),
		kubeletplugin.PluginDataDirectoryPath(o.PluginDir)}
	// The helper's socket names (kubeletplugin.Start): <driver>-reg.sock and dra.sock, or named
	// for the pod during rolling updates.
	sockets := []string{filepath.Join(o.RegistrarDir, DriverName+"-reg.sock"), filepath.Join(o.PluginDir, "dra.sock")}
	if o.RollingUpdateUID != "" {
		opts = append(opts, kubeletplugin.RollingUpdate(o.RollingUpdateUID))
		sockets = []string{filepath.Join(o.RegistrarDir, kubeletplugin.RollingUpdateRegistrarSocketFile(o.RegistrarDir, DriverName, o.RollingUpdateUID)),
			filepath.Join(o.PluginDir, "dra-"+string(o.RollingUpdateUID)+".sock")}
	}
	helper, err := kubeletplugin.Start(ctx, d, opts...)
	if err != nil {
		return fmt.Errorf("start the DRA kubelet plugin %s (registry %s, socket dir %s): %w", DriverName, o.RegistrarDir, o.PluginDir, err)
	}
	defer helper.Stop()
	d.mu.Lock()
	d.client = o.Client
	d.sockets = sockets
	d.mu.Unlock()
	d.log.Info("DRA kubelet plugin started", "driver", DriverName, "registry", o.RegistrarDir, "pluginDir", o.PluginDir, "unhealthyEffect", o.UnhealthyEffect,
		"rollingUpdate", o.RollingUpdateUID != "", "dynamicMIG", d.mig != nil)
	for {
		res := Resources(d.agent.Inventory(), d.agent.Unhealthy(), o.UnhealthyEffect, d.partitionable())
		if err := helper.PublishResources(ctx, res); err != nil {
			d.log.Error("publish ResourceSlices", "driver", DriverName, "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-changes:
			d.mu.Lock()
			close(d.changed)
			d.changed = make(chan struct{})
			d.mu.Unlock()
		}
	}
}

// Ready says whether the kubelet can reach the plugin: both its sockets (registration and DRA)
// accept connections. The agent's /healthz includes it.
func (d *Driver) Ready() error {
	d.mu.Lock()
	sockets := d.sockets
	d.mu.Unlock()
	if len(sockets) == 0 {
		return errors.New("DRA plugin not started")
	}
	for _, s := range sockets {
		c, err := net.DialTimeout("unix", s, time.Second)
		if err != nil {
			return fmt.Errorf("DRA plugin socket %s: %w", s, err)
		}
		c.Close()
	}
	return nil
}

// HandleError logs background errors (slice publishing); they are retried by the helper.
func (d *Driver) HandleError(ctx context.Context, err error, msg string) {
	d.log.Error("DRA plugin: "+msg, "driver", DriverName, "err", err, "recoverable", errors.Is(err, kubeletplugin.ErrRecoverable))
}

// WatchHealthStatus streams the health of every published device to the kubelet (KEP-4680), which
// shows it in the status of the pods using it (allocatedResourcesStatus): a report at once, at
// every inventory change, and every healthResend in between so the kubelet does not decay it to
// unknown.
func (d *Driver) WatchHealthStatus(ctx context.Context, reports chan<- kubeletplugin.DeviceHealthReport) error {
	// A ticker in a select, not wait.Until: an inventory change must wake the loop before the
	// period ends, and the wait package has no wake-up channel.
	t := time.NewTicker(healthResend)
	defer t.Stop()
	for {
		d.mu.Lock()
		changed := d.changed
		d.mu.Unlock()
		select {
		case <-ctx.Done():
			return nil
		case reports <- HealthReport(d.agent.Inventory(), d.agent.Unhealthy(), d.now(), d.partitionable()):
		}
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		case <-t.C:
		}
	}
}

// PrepareResourceClaims records each claim's devices in the ledger, which refuses what would
// over-commit a GPU together with everything else it holds (device-plugin shares included), and
// returns the CDI devices of the same specs the device-plugin path uses. The ledger entry is the
// checkpoint: it is on disk before the answer, and a repeated call (kubelet restart) finds it.
func (d *Driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, c := range claims {
		start := time.Now()
		devs, err := d.prepare(ctx, c)
		if d.observe != nil {
			d.observe(CallPrepare, time.Since(start), err)
		}
		if err != nil {
			d.log.Error("cannot prepare ResourceClaim", "claim", c.Namespace+"/"+c.Name, "uid", c.UID, "err", err)
			err = fmt.Errorf("tessera: ResourceClaim %s/%s: %w", c.Namespace, c.Name, err)
		} else {
			d.log.Info("ResourceClaim prepared", "claim", c.Namespace+"/"+c.Name, "uid", c.UID, "devices", len(devs))
			d.mu.Lock()
			client := d.client
			d.mu.Unlock()
			d.writeStatus(ctx, client, c)
		}
		out[c.UID] = kubeletplugin.PrepareResult{Devices: devs, Err: err}
	}
	return out, nil
}

func (d *Driver) prepare(ctx context.Context, c *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
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
	var dyn map[string]Partitionable
	indexOf := map[string]int{}
	if d.mig != nil {
		dyn = d.partitionable()
		for _, g := range inv.GPUs {
			indexOf[g.UUID] = g.Index
		}
		// One prepare or unprepare at a time creates or destroys instances: the ledger's hold on
		// the GPU, the journal and NVML's placements stay in step.
		d.mig.mu.Lock()
		defer d.mig.mu.Unlock()
		if err := d.mig.loadLocked(); err != nil {
			return nil, err
		}
	}
	var pending []pendingMIG
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
		if parent, pl, ok := placementOf(dyn, indexOf, r.Device); ok {
			if r.AdminAccess != nil && *r.AdminAccess {
				return nil, fmt.Errorf("device %s is a dynamic MIG placement: its instance exists only for the claim that creates it, so admin access cannot reach it; select the GPU device %s instead", r.Device, GPUDeviceName(indexOf[parent]))
			}
			pending = append(pending, pendingMIG{result: len(out), parent: parent, placement: pl, device: r.Device})
			if !slices.Contains(e.Partitions, parent) {
				e.Partitions = append(e.Partitions, parent)
			}
			out = append(out, kubeletplugin.Device{Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device, ShareID: r.ShareID})
			continue
		}
		if g := inv.GPUByUUID(gpuOfDevice(inv, r.Device)); g != nil && g.MIG != nil && dyn[g.UUID].Placements != nil {
			return nil, fmt.Errorf("device %s: GPU %s is partitioned into MIG instances that claims hold; it can be given whole or shared only once they are released", r.Device, g.UUID)
		}
		var names []string
		var err error
		if r.AdminAccess != nil && *r.AdminAccess {
			names, err = adminAccess(&r, inv, gen, e.Claim)
		} else {
			names, err = d.result(c, &r, inv, gen, &e)
		}
		if err != nil {
			return nil, err
		}
		out = append(out, kubeletplugin.Device{Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device, CDIDeviceIDs: names, ShareID: r.ShareID})
	}
	if len(pending) == 0 {
		if err := d.agent.Ledger().Reserve(e, inv); err != nil {
			return nil, err
		}
		return out, nil
	}
	return d.preparePartitions(ctx, c, e, inv, pending, out)
}

// preparePartitions holds the GPUs of the claim's dynamic MIG devices in the ledger (refused while
// anything holds them whole or shared), creates the instances, and records them in the claim's
// entry; a failure at any step leaves neither instances nor a hold behind.
func (d *Driver) preparePartitions(ctx context.Context, c *resourceapi.ResourceClaim, e ledger.Entry, inv *api.NodeInventory, pending []pendingMIG, out []kubeletplugin.Device) ([]kubeletplugin.Device, error) {
	l := d.agent.Ledger()
	prev, had := l.Get(e.ContainerID)
	undo := func() {
		if had {
			if err := l.Reserve(prev, d.agent.Inventory()); err != nil {
				d.log.Error("restore the ledger entry of a claim whose retried prepare failed", "claim", c.Namespace+"/"+c.Name, "err", err)
			}
		} else if _, _, err := l.Release(e.ContainerID); err != nil {
			d.log.Error("release the hold of a claim whose prepare failed", "claim", c.Namespace+"/"+c.Name, "err", err)
		}
	}
	if err := l.Reserve(e, inv); err != nil {
		return nil, err
	}
	uuids, err := d.createPartitions(ctx, string(c.UID), pending)
	if err != nil {
		undo()
		return nil, err
	}
	gen := d.agent.Generator()
	for i, p := range pending {
		e.MIG = append(e.MIG, uuids[i])
		out[p.result].CDIDeviceIDs = []string{gen.Name(cdi.ClassMIG, uuids[i])}
	}
	if err := l.Reserve(e, d.agent.Inventory()); err != nil {
		if derr := d.destroyPartitions(ctx, string(c.UID)); derr != nil {
			err = fmt.Errorf("%w (and destroying its new MIG instances failed: %v)", err, derr)
		}
		undo()
		return nil, err
	}
	return out, nil
}

// gpuOfDevice is the UUID of the GPU a GPU device name (gpu-N) names ("" for any other device).
func gpuOfDevice(inv *api.NodeInventory, device string) string {
	for _, g := range inv.GPUs {
		if GPUDeviceName(g.Index) == device {
			return g.UUID
		}
	}
	return ""
}

// adminAccess grants a device allocated with admin access (a monitoring pod; the API server admits
// such claims only in namespaces labelled resource.kubernetes.io/admin-access=true): the device
// nodes of the GPU or MIG instance, recorded in the claim's AdminAccess so the NRI plugin lets them
// in, but no share, no cap and no charge in the ledger, as the allocator too ignores other
// allocations for it. An unhealthy device is granted: looking at it is what monitoring is for.
func adminAccess(r *resourceapi.DeviceRequestAllocationResult, inv *api.NodeInventory, gen *cdi.Generator, claim *ledger.Claim) ([]string, error) {
	for i := range inv.GPUs {
		g := &inv.GPUs[i]
		if g.Shareable() && r.Device == GPUDeviceName(g.Index) {
			claim.AdminAccess = append(claim.AdminAccess, g.UUID)
			return []string{gen.Name(cdi.ClassGPU, cdi.CommonName), gen.Name(cdi.ClassGPU, g.UUID)}, nil
		}
		if g.MIG == nil {
			continue
		}
		for j := range g.MIG.Instances {
			if m := &g.MIG.Instances[j]; r.Device == MIGDeviceName(g.Index, m) {
				claim.AdminAccess = append(claim.AdminAccess, m.UUID)
				return []string{gen.Name(cdi.ClassMIG, m.UUID)}, nil
			}
		}
	}
	return nil, fmt.Errorf("device %s (admin access) is not a device of this node (its slices may be out of date)", r.Device)
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
				if why, bad := d.agent.Unhealthy()[m.UUID]; bad {
					return nil, fmt.Errorf("MIG instance %s is unhealthy (%s)", m.UUID, why)
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
		start := time.Now()
		var e ledger.Entry
		var ok bool
		err := d.unpreparePartitions(ctx, string(c.UID))
		if err == nil {
			e, ok, err = d.agent.Ledger().Release(ledger.ClaimID(string(c.UID)))
		}
		if err != nil {
			err = fmt.Errorf("tessera: release ResourceClaim %s: %w", c.String(), err)
		} else if ok {
			d.log.Info("ResourceClaim unprepared", "claim", c.String(), "uid", c.UID, "devices", e.Devices, "mig", e.MIG)
		}
		if err == nil && d.unprepared != nil {
			d.unprepared(string(c.UID))
		}
		if d.observe != nil {
			d.observe(CallUnprepare, time.Since(start), err)
		}
		out[c.UID] = err
	}
	return out, nil
}

// unpreparePartitions destroys the dynamic MIG instances of a claim before its ledger entry goes,
// so the GPU is held until they are gone.
func (d *Driver) unpreparePartitions(ctx context.Context, uid string) error {
	if d.mig == nil {
		return nil
	}
	d.mig.mu.Lock()
	defer d.mig.mu.Unlock()
	if err := d.mig.loadLocked(); err != nil {
		return err
	}
	return d.destroyPartitions(ctx, uid)
}
