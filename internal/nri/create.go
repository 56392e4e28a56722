package nri

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

var (
	timeAfter  = time.After
	retryDelay = time.Second
)

// AnnotationLedgerEntry is set on every container Tessera adjusted, so a restarted agent can rebuild
// its ledger from the running containers alone (Synchronize).
const AnnotationLedgerEntry = "tessera.dev/ledger-entry"

// CreateContainer realises the container's GPU assignment or refuses the container with the reason.
func (p *Plugin) CreateContainer(ctx context.Context, pod *nriapi.PodSandbox, c *nriapi.Container) (*nriapi.ContainerAdjustment, []*nriapi.ContainerUpdate, error) {
	start := time.Now()
	adj, err := p.create(ctx, pod, c)
	took := time.Since(start)
	p.creates.Add(1)
	p.createNanos.Add(int64(took))
	if err != nil {
		p.refusals.Add(1)
		slog.Error("refusing container", "pod", pod.GetNamespace()+"/"+pod.GetName(), "container", c.GetName(), "err", err)
		err = fmt.Errorf("tessera: %s/%s container %q: %w", pod.GetNamespace(), pod.GetName(), c.GetName(), err)
	}
	if p.cfg.OnCreate != nil {
		p.cfg.OnCreate(pod, c, took, err)
	}
	if err != nil {
		return nil, nil, err
	}
	return adj, nil, nil
}

func (p *Plugin) create(ctx context.Context, pod *nriapi.PodSandbox, c *nriapi.Container) (*nriapi.ContainerAdjustment, error) {
	adj := &nriapi.ContainerAdjustment{}
	if !p.mayHoldGPU(c) {
		return adj, nil
	}
	grant, err := p.grants.Container(ctx, pod.GetNamespace(), pod.GetName(), c.GetName())
	if err != nil {
		return nil, err
	}
	entry := ledger.Entry{ContainerID: c.GetId(), PodUID: pod.GetUid(), Namespace: pod.GetNamespace(), Pod: pod.GetName(), Container: c.GetName()}
	whole, shares := grant.Count(api.ResourceGPU), grant.Count(api.ResourceShare)
	for res, ids := range grant {
		switch {
		case strings.HasPrefix(res, api.MIGResourcePrefix):
			entry.MIG = append(entry.MIG, ids...)
		case strings.HasPrefix(res, api.MdevResourcePrefix):
			entry.Mdev = append(entry.Mdev, ids...)
		}
	}
	if whole > 0 || shares > 0 {
		devs, local, err := p.assignment(ctx, pod, c, whole, shares)
		if err != nil {
			return nil, err
		}
		entry.Devices, entry.Local = devs, local
	}
	if err := p.checkUngranted(c, p.grantedNodes(&entry)); err != nil {
		return nil, err
	}
	if len(entry.Devices) == 0 && len(entry.MIG) == 0 && len(entry.Mdev) == 0 {
		return adj, nil
	}
	if err := p.agent.Ledger().Reserve(entry, p.agent.Inventory()); err != nil {
		return nil, err
	}
	if err := p.realise(pod, c, &entry, adj); err != nil {
		p.agent.Ledger().Release(entry.ContainerID)
		os.RemoveAll(p.containerDir(entry.ContainerID))
		return nil, err
	}
	slog.Info("GPU assignment realised", "pod", pod.GetNamespace()+"/"+pod.GetName(), "container", c.GetName(), "id", c.GetId(),
		"devices", entry.Devices, "mig", entry.MIG, "mdev", entry.Mdev, "local", entry.Local)
	return adj, nil
}

// assignment returns the verified devices for a container granted whole GPUs or shares: the
// extender's assignment if the pod carries one, else a local placement.
func (p *Plugin) assignment(ctx context.Context, pod *nriapi.PodSandbox, c *nriapi.Container, whole, shares int) ([]api.DeviceAssignment, bool, error) {
	spec, err := p.pods.Pod(ctx, pod.GetNamespace(), pod.GetName(), pod.GetUid())
	if err != nil {
		return nil, false, fmt.Errorf("read the pod's spec to check its requests: %w", err)
	}
	req, err := api.ParsePodRequest(spec)
	if err != nil {
		return nil, false, err
	}
	var cr *api.ContainerRequest
	for i := range req.Containers {
		if req.Containers[i].Name == c.GetName() {
			cr = &req.Containers[i]
		}
	}
	if cr == nil || cr.WholeGPUs != whole || cr.Shares != shares {
		return nil, false, fmt.Errorf("the kubelet granted %d whole GPUs and %d shares, which is not what the pod requests", whole, shares)
	}
	inv := p.agent.Inventory()
	raw, ok := pod.GetAnnotations()[api.AnnotationAssignment]
	if !ok {
		devs, err := p.agent.Ledger().PlaceLocally(cr, inv)
		return devs, true, err
	}
	a, err := api.DecodeAssignment([]byte(raw))
	if err != nil {
		return nil, false, err
	}
	if a.Node != inv.Node {
		return nil, false, fmt.Errorf("its assignment is for node %q, this is %q", a.Node, inv.Node)
	}
	ca := a.Container(c.GetName())
	if ca == nil {
		return nil, false, fmt.Errorf("its assignment has no entry for this container")
	}
	if err := verify(ca.Devices, cr, inv); err != nil {
		return nil, false, fmt.Errorf("its assignment does not match its request: %w", err)
	}
	return ca.Devices, false, nil
}

// verify checks an assignment against the container's request, device by device.
func verify(devs []api.DeviceAssignment, cr *api.ContainerRequest, inv *api.NodeInventory) error {
	if want := cr.WholeGPUs + cr.Shares; len(devs) != want {
		return fmt.Errorf("it names %d GPUs, the container was granted %d", len(devs), want)
	}
	for _, d := range devs {
		g := inv.GPUByUUID(d.UUID)
		if g == nil {
			return fmt.Errorf("GPU %s is not on node %s", d.UUID, inv.Node)
		}
		if d.Whole != (cr.WholeGPUs > 0) {
			return fmt.Errorf("GPU %s: whole=%v but the container asks for %s", d.UUID, d.Whole, map[bool]string{true: "whole GPUs", false: "shares"}[cr.WholeGPUs > 0])
		}
		if d.Whole {
			continue
		}
		if want := cr.ShareMemoryOn(g.MemoryBytes); d.MemoryBytes != want {
			return fmt.Errorf("GPU %s: memory cap %d bytes, the container requests %d", d.UUID, d.MemoryBytes, want)
		}
		if d.CoresPercent != cr.ShareCores {
			return fmt.Errorf("GPU %s: compute cap %d%%, the container requests %d%%", d.UUID, d.CoresPercent, cr.ShareCores)
		}
	}
	return nil
}

// mayHoldGPU is the fast path for the many containers without GPUs. Every device our plugins
// allocate reaches the container through its CDI name, which containerd resolves before NRI sees the
// container: the share token mounts libvcuda.so, the whole-GPU token sets TESSERA_GPU_TOKEN, MIG and
// mdev devices bring their device nodes (the runtime may also list the CDI names themselves). A
// container with none of these was granted nothing by us and has nothing to check.
func (p *Plugin) mayHoldGPU(c *nriapi.Container) bool {
	prefix := p.agent.Generator().Vendor + "/"
	for _, d := range c.GetCDIDevices() {
		if strings.HasPrefix(d.GetName(), prefix) {
			return true
		}
	}
	for _, d := range c.GetLinux().GetDevices() {
		if gpuNodePattern.MatchString(d.GetPath()) {
			return true
		}
	}
	for _, m := range c.GetMounts() {
		if m.GetDestination() == api.VCUDALibraryInContainer {
			return true
		}
	}
	for _, e := range c.GetEnv() {
		if strings.HasPrefix(e, cdi.WholeTokenEnv+"=") {
			return true
		}
	}
	return false
}

// gpuNodePattern matches the GPU-granting device nodes a container may only have when granted.
var gpuNodePattern = regexp.MustCompile(`^/dev/(nvidia[0-9]+|nvidia-caps/nvidia-cap[0-9]+|vfio/[0-9]+)$`)

// grantedNodes are the container paths of the device nodes the entry grants.
func (p *Plugin) grantedNodes(e *ledger.Entry) map[string]bool {
	n := p.agent.Node()
	ok := map[string]bool{}
	if n == nil {
		return ok
	}
	for _, d := range e.Devices {
		if g := n.GPUByUUID(d.UUID); g != nil {
			ok[n.GPUNode(g).Path] = true
		}
	}
	for _, id := range e.MIG {
		if parent, m := n.MIGByUUID(id); m != nil {
			for _, d := range n.MIGNodes(parent, m) {
				ok[d.Path] = true
			}
		}
	}
	for i := range n.Mdevs {
		if slices.Contains(e.Mdev, n.Mdevs[i].UUID) {
			for _, d := range n.VFIONodes(&n.Mdevs[i]) {
				ok[d.Path] = true
			}
		}
	}
	return ok
}

// checkUngranted refuses a container that carries GPU device nodes nobody granted it: a pod can
// ask containerd for CDI devices through cdi.k8s.io annotations, but only the kubelet's grant counts.
// (Refusing rather than removing the nodes: NRI's runtime side does not pass device removals of
// nodes already in the container on to the runtime.)
func (p *Plugin) checkUngranted(c *nriapi.Container, granted map[string]bool) error {
	var extra []string
	for _, d := range c.GetLinux().GetDevices() {
		if gpuNodePattern.MatchString(d.GetPath()) && !granted[d.GetPath()] {
			extra = append(extra, d.GetPath())
		}
	}
	if len(extra) > 0 {
		return fmt.Errorf("it has GPU device nodes %v that the kubelet did not grant it (a cdi.k8s.io annotation on the pod?); request GPUs through resources instead", extra)
	}
	return nil
}

// realise adds devices, the preload and the limits to the container.
func (p *Plugin) realise(pod *nriapi.PodSandbox, c *nriapi.Container, e *ledger.Entry, adj *nriapi.ContainerAdjustment) error {
	gen := p.agent.Generator()
	raw, err := json.Marshal(e)
	if err != nil {
		return err
	}
	adj.AddAnnotation(AnnotationLedgerEntry, string(raw))
	if p.isKata(pod) {
		return p.realiseKata(e, adj)
	}
	for _, d := range e.Devices {
		adj.AddCDIDevice(&nriapi.CDIDevice{Name: gen.Name(cdi.ClassGPU, d.UUID)})
	}
	if len(e.Devices) == 0 || e.Devices[0].Whole {
		return nil // whole GPUs, MIG and mdev: nothing to cap, no preload
	}
	return p.addVCUDA(c, e, adj)
}

// addVCUDA writes the container's limits file and mounts it, its accounting directory, the library
// and a read-only /etc/ld.so.preload naming the library.
func (p *Plugin) addVCUDA(c *nriapi.Container, e *ledger.Entry, adj *nriapi.ContainerAdjustment) error {
	dir := p.containerDir(e.ContainerID)
	if err := os.MkdirAll(filepath.Join(dir, "vcuda"), 0o755); err != nil {
		return fmt.Errorf("create the container's vcuda directory: %w", err)
	}
	l := &api.Limits{ContainerID: e.ContainerID, RegionPath: api.RegionDirInContainer + "/region"}
	for _, d := range e.Devices {
		cores := d.CoresPercent
		if cores == 0 {
			cores = api.MaxCoresPercent
		}
		l.GPUs = append(l.GPUs, api.GPULimit{UUID: d.UUID, MemoryBytes: d.MemoryBytes, CoresPercent: cores})
	}
	data, err := api.EncodeLimits(l)
	if err != nil {
		return err
	}
	// Plain writes: the container does not exist yet, so nobody can read a half-written file.
	// The accounting region is created empty and writable by any user: the container's processes
	// may run as any UID, and vcuda initialises an empty region on first use.
	for _, f := range []struct {
		name string
		data []byte
		mode os.FileMode
	}{{"limits", data, 0o644}, {"ld.so.preload", []byte(api.VCUDALibraryInContainer + "\n"), 0o644}, {"vcuda/region", nil, 0o666}} {
		path := filepath.Join(dir, f.name)
		if err := os.WriteFile(path, f.data, f.mode); err != nil {
			return fmt.Errorf("write the container's %s: %w", f.name, err)
		}
		if err := os.Chmod(path, f.mode); err != nil { // past the umask
			return fmt.Errorf("write the container's %s: %w", f.name, err)
		}
	}
	ro := []string{"bind", "ro", "nosuid", "nodev"}
	adj.AddMount(&nriapi.Mount{Source: filepath.Join(dir, "limits"), Destination: api.LimitsPathInContainer, Type: "bind", Options: ro})
	adj.AddMount(&nriapi.Mount{Source: filepath.Join(dir, "ld.so.preload"), Destination: "/etc/ld.so.preload", Type: "bind", Options: ro})
	adj.AddMount(&nriapi.Mount{Source: filepath.Join(dir, "vcuda"), Destination: api.RegionDirInContainer, Type: "bind", Options: []string{"bind", "rw", "nosuid", "nodev", "noexec"}})
	if !slices.ContainsFunc(c.GetMounts(), func(m *nriapi.Mount) bool { return m.GetDestination() == api.VCUDALibraryInContainer }) {
		adj.AddMount(&nriapi.Mount{Source: p.cfg.VCUDALibrary, Destination: api.VCUDALibraryInContainer, Type: "bind", Options: ro})
	}
	return nil
}

func (p *Plugin) isKata(pod *nriapi.PodSandbox) bool {
	h := pod.GetRuntimeHandler()
	return slices.ContainsFunc(p.cfg.KataHandlers, func(k string) bool { return h != "" && strings.HasPrefix(h, k) })
}

// realiseKata: a VM-runtime container gets its mdev devices as VFIO nodes (from their CDI specs,
// which carry no /dev/nvidia* nodes) plus the container-level CDI annotation Kata's agent resolves
// inside the guest. Whole GPUs and shares need the host driver in the container: refused.
func (p *Plugin) realiseKata(e *ledger.Entry, adj *nriapi.ContainerAdjustment) error {
	if len(e.Devices) > 0 {
		return fmt.Errorf("whole GPUs and shares need a runc container; under a Kata runtime ask for an mdev vGPU (%s<type>)", api.MdevResourcePrefix)
	}
	var names []string
	for _, id := range e.Mdev {
		names = append(names, p.agent.Generator().Name(cdi.ClassMdev, id))
	}
	if len(names) == 0 {
		return nil
	}
	key, err := cdiapi.AnnotationKey("tessera", e.ContainerID[:min(32, len(e.ContainerID))])
	if err != nil {
		return err
	}
	value, err := cdiapi.AnnotationValue(names)
	if err != nil {
		return err
	}
	adj.AddAnnotation(key, value)
	return nil
}
