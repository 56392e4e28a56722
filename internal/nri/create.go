package nri

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"
	corev1 "k8s.io/api/core/v1"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/ledger"
	"github.com/tessera-gpu/tessera/internal/podresources"
)

var (
	timeAfter  = time.After
	retryDelay = time.Second
)

// CreateContainer realises the container's GPU assignment or refuses the container with the reason.
func (p *Plugin) CreateContainer(ctx context.Context, pod *nriapi.PodSandbox, c *nriapi.Container) (*nriapi.ContainerAdjustment, []*nriapi.ContainerUpdate, error) {
	start := time.Now()
	adj, err := p.create(ctx, pod, c)
	took := time.Since(start)
	p.creates.Add(1)
	p.createNanos.Add(int64(took))
	if err != nil {
		p.refusals.Add(1)
		p.log.Error("refusing container", "pod", pod.GetNamespace()+"/"+pod.GetName(), "container", c.GetName(), "err", err)
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
	admin := p.isAdmin(pod)
	if !p.mayHoldGPU(c) {
		if !admin {
			voidVisibleDevices(adj)
		}
		return adj, nil
	}
	grant, err := p.grants.Container(ctx, pod.GetNamespace(), pod.GetName(), c.GetName())
	if err != nil {
		return nil, err
	}
	entry := ledger.Entry{ContainerID: c.GetId(), PodUID: pod.GetUid(), Namespace: pod.GetNamespace(), Pod: pod.GetName(), Container: c.GetName(),
		SandboxID: pod.GetId()}
	whole, shares := grant.Count(api.ResourceGPU), grant.Count(api.ResourceShare)
	claims, err := p.claims(ctx, pod, grant)
	if err != nil {
		return nil, err
	}
	for _, cl := range claims {
		entry.Claims = append(entry.Claims, cl.Claim.UID)
	}
	for res, ids := range grant {
		switch {
		case podresources.IsClaimKey(res):
		case strings.HasPrefix(res, api.MIGResourcePrefix):
			entry.MIG = append(entry.MIG, ids...)
		case strings.HasPrefix(res, api.MdevResourcePrefix):
			entry.Mdev = append(entry.Mdev, ids...)
		}
	}
	// A restarted container gets back what it held (release.go): its hold is moved, not re-placed.
	hold, held := p.agent.Ledger().Get(holdID(entry.PodUID, entry.Container))
	if whole > 0 || shares > 0 {
		devs, local, err := p.assignment(ctx, pod, c, whole, shares, hold.Devices)
		if err != nil {
			return nil, err
		}
		entry.Devices, entry.Local = devs, local
	}
	privileged, err := p.checkDevices(ctx, pod, c, &entry, admin)
	if err != nil {
		return nil, err
	}
	if !admin && !privileged {
		voidVisibleDevices(adj)
	}
	if len(entry.Devices) == 0 && len(entry.MIG) == 0 && len(entry.Mdev) == 0 && len(entry.Claims) == 0 {
		if names := p.ourCDINames(c); len(names) > 0 && !admin {
			return nil, fmt.Errorf("it holds Tessera CDI devices %v but the kubelet granted it none (a cdi.k8s.io annotation?); request GPUs through resources instead", names)
		}
		if admin {
			return adj, p.markRealised(c.GetId(), adj)
		}
		return adj, nil
	}
	if err := p.takeFromPodHolds(&entry); err != nil {
		return nil, err
	}
	if held {
		err = p.agent.Ledger().Move(hold.ContainerID, entry, p.agent.Inventory())
	} else {
		err = p.agent.Ledger().Reserve(entry, p.agent.Inventory())
	}
	if err != nil {
		return nil, err
	}
	if err := p.realise(pod, c, &entry, claims, adj); err != nil {
		p.release(entry.ContainerID)
		return nil, err
	}
	if err := p.markRealised(c.GetId(), adj); err != nil {
		p.release(entry.ContainerID)
		return nil, err
	}
	p.log.Info("GPU assignment realised", "pod", pod.GetNamespace()+"/"+pod.GetName(), "container", c.GetName(), "id", c.GetId(),
		"devices", entry.Devices, "mig", entry.MIG, "mdev", entry.Mdev, "claims", entry.Claims, "local", entry.Local, "restarted", held)
	return adj, nil
}

// VisibleDevicesEnv is read by nvidia-container-runtime (legacy mode or the
// accept-nvidia-visible-devices-envvar settings): from a pod's env or an image's ENV it would inject
// GPUs after NRI. Every container gets "void" unless its namespace is an admin namespace; Tessera's
// own GPUs come as CDI devices, which need no env.
const VisibleDevicesEnv = "NVIDIA_VISIBLE_DEVICES"

func voidVisibleDevices(adj *nriapi.ContainerAdjustment) {
	adj.AddEnv(VisibleDevicesEnv, "void")
}

// ourCDINames are the container's CDI devices of our vendor.
func (p *Plugin) ourCDINames(c *nriapi.Container) []string {
	prefix := p.agent.Generator().Vendor + "/"
	var names []string
	for _, d := range c.GetCDIDevices() {
		if strings.HasPrefix(d.GetName(), prefix) {
			names = append(names, d.GetName())
		}
	}
	return names
}

// assignment returns the verified devices for a container granted whole GPUs or shares: the
// extender's assignment if the pod carries one, else a local placement.
func (p *Plugin) assignment(ctx context.Context, pod *nriapi.PodSandbox, c *nriapi.Container, whole, shares int, held []api.DeviceAssignment) ([]api.DeviceAssignment, bool, error) {
	spec, err := p.pods.Pod(ctx, pod.GetNamespace(), pod.GetName(), pod.GetUid())
	if err != nil {
		return nil, false, specUnread("check the kubelet's grant against the pod's requests", err)
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
		if len(held) > 0 {
			return held, true, verify(held, cr, inv)
		}
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

// checkDevices refuses a container that carries GPU device nodes nobody granted it, recognised by
// major:minor whatever their path (a CDI device containerd resolved from an annotation, a device in
// the CRI request). Privileged containers get every host device: they are root on the node and
// outside isolation (PodSecurity admission is the place to forbid them), so they run and are
// counted. Admin namespaces see every GPU by design.
// (Refusing rather than removing the nodes: NRI's runtime side does not pass device removals of
// nodes already in the container on to the runtime.)
func (p *Plugin) checkDevices(ctx context.Context, pod *nriapi.PodSandbox, c *nriapi.Container, e *ledger.Entry, admin bool) (privileged bool, err error) {
	x := p.devices()
	bad := ungranted(c.GetLinux().GetDevices(), "the container's devices", x, p.grantedNumbers(e, x))
	return p.allowUngranted(ctx, pod, c, bad, admin, true)
}

// allowUngranted decides on a container holding GPU devices nobody granted: admin namespaces and
// privileged containers (as the API server's pod spec says) run and are counted; others are refused
// with the devices named. count is false on the validator's second look at the same container. It
// reports whether the container is privileged (known only when it holds ungranted devices).
func (p *Plugin) allowUngranted(ctx context.Context, pod *nriapi.PodSandbox, c *nriapi.Container, bad []string, admin, count bool) (bool, error) {
	if len(bad) == 0 {
		return false, nil
	}
	if admin {
		if count {
			p.admin.Add(1)
		}
		return false, nil
	}
	priv, err := p.privilegedContainer(ctx, pod, c.GetName())
	if err != nil {
		return false, fmt.Errorf("it has GPU devices the kubelet did not grant it (%s), which only a privileged container may have: %w", strings.Join(bad, "; "),
			specUnread("tell whether it is privileged", err))
	}
	if priv {
		if count {
			p.privileged.Add(1)
			p.log.Warn("privileged container holds every GPU: outside isolation", "pod", pod.GetNamespace()+"/"+pod.GetName(), "container", c.GetName())
		}
		return true, nil
	}
	return false, fmt.Errorf("it has GPU devices the kubelet did not grant it: %s; request GPUs through resources (%s, %s, %s<profile>) instead",
		strings.Join(bad, "; "), api.ResourceGPU, api.ResourceShare, api.MIGResourcePrefix)
}

// specUnread says why the pod's spec, needed to do what, could not be read, and what follows: a pod
// the API server no longer has is refused for good (and every such pod on a node agent without API
// server access, whose error says what to configure); when the API server cannot answer (unreachable,
// a cold cache) the refusal is not a verdict, since the kubelet retries CreateContainer and the
// container starts once the spec can be read.
func specUnread(to string, err error) error {
	if errors.Is(err, ErrPodGone) || errors.Is(err, ErrNoAPIServer) {
		return fmt.Errorf("cannot %s: %w", to, err)
	}
	return fmt.Errorf("cannot read the pod's spec from the API server to %s (%w); not a final refusal: the kubelet retries creating the container, "+
		"which starts once tessera-node can read the pod (check the API server and tessera-node's access to it)", to, err)
}

// privilegedContainer reads from the API server whether the container runs privileged.
func (p *Plugin) privilegedContainer(ctx context.Context, pod *nriapi.PodSandbox, name string) (bool, error) {
	spec, err := p.pods.Pod(ctx, pod.GetNamespace(), pod.GetName(), pod.GetUid())
	if err != nil {
		return false, err
	}
	var all []corev1.Container
	all = append(append(all, spec.Spec.InitContainers...), spec.Spec.Containers...)
	for _, ec := range spec.Spec.EphemeralContainers {
		all = append(all, corev1.Container(ec.EphemeralContainerCommon))
	}
	for _, c := range all {
		if c.Name == name {
			return c.SecurityContext != nil && c.SecurityContext.Privileged != nil && *c.SecurityContext.Privileged, nil
		}
	}
	return false, nil
}

// realise adds devices, the preload and the limits to the container. A DRA claim's devices are
// already in the container (the kubelet passed their CDI names from NodePrepareResources); its
// shares get the vcuda limits here, exactly as device-plugin shares.
func (p *Plugin) realise(pod *nriapi.PodSandbox, c *nriapi.Container, e *ledger.Entry, claims []ledger.Entry, adj *nriapi.ContainerAdjustment) error {
	gen := p.agent.Generator()
	raw, err := json.Marshal(e)
	if err != nil {
		return err
	}
	adj.AddAnnotation(api.AnnotationLedgerEntry, string(raw))
	if p.isKata(pod) {
		return p.realiseKata(e, claims, adj)
	}
	for _, d := range e.Devices {
		adj.AddCDIDevice(&nriapi.CDIDevice{Name: gen.Name(cdi.ClassGPU, d.UUID)})
	}
	all := slices.Clone(e.Devices)
	for _, cl := range claims {
		all = append(all, cl.Devices...)
	}
	var shares []api.DeviceAssignment
	for _, d := range all {
		if !d.Whole {
			shares = append(shares, d)
		}
	}
	if len(shares) == 0 {
		return nil // whole GPUs, MIG and mdev: nothing to cap, no preload
	}
	if len(shares) != len(all) {
		return fmt.Errorf("it holds whole GPUs and shares at once (through its ResourceClaims); vcuda caps every GPU of a container, so use separate containers")
	}
	owner, err := capOwner(e, claims)
	if err != nil {
		return err
	}
	return p.addVCUDA(c, owner, shares, adj)
}

// capOwner names what a share container's region and limits belong to: the container itself for
// device-plugin shares, the claim (its ledger ID) for shares of a DRA claim. A claim may be used by
// several containers of several pods (a claim shared by pods, or named by two containers of one
// pod) and is charged once in the ledger, so they all get its one region and one limits file: one
// cap for all, as the ledger counts it. A container taking shares from a claim and from anything
// else (another claim, device-plugin shares) would need two regions, which vcuda does not have:
// refused.
func capOwner(e *ledger.Entry, claims []ledger.Entry) (string, error) {
	var from []string
	owner := e.ContainerID
	for _, cl := range claims {
		if slices.ContainsFunc(cl.Devices, func(d api.DeviceAssignment) bool { return !d.Whole }) {
			from = append(from, "ResourceClaim "+cl.Claim.Namespace+"/"+cl.Claim.Name)
			owner = ledger.ClaimID(cl.Claim.UID)
		}
	}
	if len(from) == 0 || len(from) == 1 && len(e.Devices) == 0 {
		return owner, nil
	}
	if len(e.Devices) > 0 {
		from = append(from, api.ResourceShare+" shares")
	}
	return "", fmt.Errorf("it takes shares from %s; a claim's shares are capped by one accounting region shared by every container using the claim, "+
		"so a container may take shares from one ResourceClaim and nothing else: ask for all its GPUs in one claim, or use separate containers", strings.Join(from, " and "))
}

// claims returns the prepared ResourceClaims the kubelet granted the container (PodResources):
// each must have been prepared on this node (NodePrepareResources, which the kubelet calls only
// for claims the pod references) and be reserved for this very pod (status.reservedFor, by UID,
// when it was prepared), or be named in the pod's spec as the API server has it (a shared claim
// prepared for an earlier pod).
func (p *Plugin) claims(ctx context.Context, pod *nriapi.PodSandbox, grant podresources.Grant) ([]ledger.Entry, error) {
	var out []ledger.Entry
	for _, ref := range grant.Claims() {
		ids := grant[podresources.ClaimKey(ref.Namespace, ref.Name)]
		if !slices.ContainsFunc(ids, func(id string) bool { return strings.HasPrefix(id, api.DRADriverName+"/") }) {
			continue // a claim of another driver's devices only
		}
		e, ok := p.agent.Ledger().ClaimByName(ref.Namespace, ref.Name)
		if !ok {
			return nil, fmt.Errorf("the kubelet granted ResourceClaim %s/%s but this node has not prepared it (NodePrepareResources)", ref.Namespace, ref.Name)
		}
		if !slices.Contains(e.Claim.PodUIDs, pod.GetUid()) && !p.podReferencesClaim(ctx, pod, ref.Name) {
			return nil, fmt.Errorf("ResourceClaim %s/%s is reserved for pods %v, not for this pod (UID %s)", ref.Namespace, ref.Name, e.Claim.PodUIDs, pod.GetUid())
		}
		out = append(out, e)
	}
	return out, nil
}

// podReferencesClaim reports whether the pod, as the API server has it (by UID), uses the claim: a
// claim shared by pods is prepared once, for the first of them (the kubelet does not prepare it
// again for the next), so a later pod is found in its own spec rather than in the prepared record.
func (p *Plugin) podReferencesClaim(ctx context.Context, pod *nriapi.PodSandbox, claim string) bool {
	spec, err := p.pods.Pod(ctx, pod.GetNamespace(), pod.GetName(), pod.GetUid())
	if err != nil {
		return false
	}
	for _, rc := range spec.Spec.ResourceClaims {
		if rc.ResourceClaimName != nil && *rc.ResourceClaimName == claim {
			return true
		}
	}
	for _, st := range spec.Status.ResourceClaimStatuses {
		if st.ResourceClaimName != nil && *st.ResourceClaimName == claim {
			return true
		}
	}
	return false
}

// claimEntries returns the prepared claims an entry uses (those still prepared).
func (p *Plugin) claimEntries(e *ledger.Entry) []ledger.Entry {
	var out []ledger.Entry
	for _, uid := range e.Claims {
		if cl, ok := p.agent.Ledger().Get(ledger.ClaimID(uid)); ok {
			out = append(out, cl)
		}
	}
	return out
}

// addVCUDA writes the limits file of owner (a container, or the claim whose shares it takes:
// capOwner) and mounts it, its accounting region (the file alone, on its own size-limited tmpfs:
// region.go), the library and a read-only /etc/ld.so.preload naming the library. A claim's files are
// made by the first container that uses it and mounted as they are into every later one: they are
// never rewritten while a container may read them (claims.go removes them with the claim).
func (p *Plugin) addVCUDA(c *nriapi.Container, owner string, shares []api.DeviceAssignment, adj *nriapi.ContainerAdjustment) error {
	dir, err := p.ownerDir(owner)
	if err != nil {
		return err
	}
	hasLib := slices.ContainsFunc(c.GetMounts(), func(m *nriapi.Mount) bool { return m.GetDestination() == api.VCUDALibraryInContainer })
	var mounts []*nriapi.Mount
	if ledger.IsClaim(owner) {
		mounts, err = p.claimMounts(dir, owner, shares, !hasLib)
	} else {
		mounts, err = p.newVCUDAFiles(dir, owner, shares, !hasLib)
	}
	if err != nil {
		return err
	}
	node, err := p.nodeFilesMount()
	if err != nil {
		return err
	}
	for _, m := range append(mounts, node) {
		adj.AddMount(m)
	}
	return nil
}

// NodeFilesDir holds the agent's node-wide files for share containers under its state directory:
// the memory guard's measured context overhead (api.ContextOverheadFile).
func NodeFilesDir(stateDir string) string { return filepath.Join(stateDir, api.ContextOverheadDir) }

// nodeFilesMount mounts NodeFilesDir read-only (the figures in it set what vcuda charges every
// container of the node: no container may write them) at api.NodeFilesDirInContainer. The
// directory, not the file: the guard replaces the file by rename, which a file mount would not see.
func (p *Plugin) nodeFilesMount() (*nriapi.Mount, error) {
	dir := NodeFilesDir(p.cfg.StateDir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("create the agent's node files directory: %w", err)
	}
	return &nriapi.Mount{Source: dir, Destination: api.NodeFilesDirInContainer, Type: "bind",
		Options: []string{"bind", "ro", "nosuid", "nodev", "noexec"}}, nil
}

// newVCUDAFiles creates owner's region and limits in dir and returns their mounts.
func (p *Plugin) newVCUDAFiles(dir, owner string, shares []api.DeviceAssignment, withLibrary bool) ([]*nriapi.Mount, error) {
	region, err := p.createRegion(dir)
	if err != nil {
		return nil, err
	}
	return VCUDAMounts(dir, region, owner, shares, p.cfg.VCUDALibrary, withLibrary)
}

// VCUDAMounts writes a share container's vcuda files into dir (limits, ld.so.preload), creates the
// directory the memory guard publishes the driver's measured compute into (MeasuredComputeFile) and
// returns the mounts that put them in the container with its accounting region (the file alone,
// created by the caller: region.go), plus the library itself when withLibrary
// (the share token's CDI spec normally mounts it already). Exported so that test/gpu's runc
// harness builds a share container exactly as this plugin does.
func VCUDAMounts(dir, region, containerID string, devs []api.DeviceAssignment, library string, withLibrary bool) ([]*nriapi.Mount, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("create the container's vcuda directory: %w", err)
	}
	if err := makeMeasuredDir(dir); err != nil {
		return nil, err
	}
	l := &api.Limits{ContainerID: containerID, RegionPath: api.RegionDirInContainer + "/region"}
	for _, d := range devs {
		cores := d.CoresPercent
		if cores == 0 {
			cores = api.MaxCoresPercent
		}
		l.GPUs = append(l.GPUs, api.GPULimit{UUID: d.UUID, MemoryBytes: d.MemoryBytes, CoresPercent: cores})
	}
	data, err := api.EncodeLimits(l)
	if err != nil {
		return nil, err
	}
	// Plain writes: the container does not exist yet, so nobody can read a half-written file.
	for _, f := range []struct {
		name string
		data []byte
	}{{"limits", data}, {"ld.so.preload", []byte(api.VCUDALibraryInContainer + "\n")}} {
		path := filepath.Join(dir, f.name)
		if err := os.WriteFile(path, f.data, 0o644); err != nil {
			return nil, fmt.Errorf("write the container's %s: %w", f.name, err)
		}
		if err := os.Chmod(path, 0o644); err != nil { // past the umask
			return nil, fmt.Errorf("write the container's %s: %w", f.name, err)
		}
	}
	return vcudaMountList(dir, region, library, withLibrary), nil
}

// makeMeasuredDir creates owner dir's measured directory (api.ComputeMeasuredDir), which the memory
// guard writes into and the container reads; the agent's own, never writable by a container.
func makeMeasuredDir(dir string) error {
	if err := os.MkdirAll(filepath.Join(dir, api.ComputeMeasuredDir), 0o755); err != nil {
		return fmt.Errorf("create the container's measured compute directory: %w", err)
	}
	return nil
}

// MeasuredComputeFile is where the memory guard writes the measured compute file of owner (a
// container, or a shared claim by its ledger ID): in the directory the plugin created and mounts
// read-only into owner's containers. Its directory missing means the plugin made no vcuda files for
// owner (not a share container, or gone): the guard writes nothing there.
func (p *Plugin) MeasuredComputeFile(owner string) (string, error) {
	dir, err := p.ownerDir(owner)
	if err != nil {
		return "", err
	}
	return filepath.Join(dir, api.ComputeMeasuredDir, api.ComputeMeasuredFile), nil
}

// vcudaMountList is the mounts of the vcuda files in dir and of region. The measured compute is a
// directory mount, read-only like the limits: the agent writes what the host's driver measured and
// replaces the file by rename (a file mount would keep the old inode); the container must not be
// able to change the reference vcuda's limiter corrects itself by.
func vcudaMountList(dir, region, library string, withLibrary bool) []*nriapi.Mount {
	ro := []string{"bind", "ro", "nosuid", "nodev"}
	mounts := []*nriapi.Mount{
		{Source: filepath.Join(dir, "limits"), Destination: api.LimitsPathInContainer, Type: "bind", Options: ro},
		{Source: filepath.Join(dir, api.ComputeMeasuredDir), Destination: api.ComputeMeasuredDirInContainer, Type: "bind", Options: []string{"bind", "ro", "nosuid", "nodev", "noexec"}},
		{Source: filepath.Join(dir, "ld.so.preload"), Destination: "/etc/ld.so.preload", Type: "bind", Options: ro},
		{Source: region, Destination: api.RegionDirInContainer + "/region", Type: "bind", Options: []string{"bind", "rw", "nosuid", "nodev", "noexec"}},
	}
	if withLibrary {
		mounts = append(mounts, &nriapi.Mount{Source: library, Destination: api.VCUDALibraryInContainer, Type: "bind", Options: ro})
	}
	return mounts
}

func (p *Plugin) isKata(pod *nriapi.PodSandbox) bool {
	h := pod.GetRuntimeHandler()
	return slices.ContainsFunc(p.cfg.KataHandlers, func(k string) bool { return h != "" && strings.HasPrefix(h, k) })
}

// realiseKata: a VM-runtime container gets its mdev devices as VFIO nodes (from their CDI specs,
// which carry no /dev/nvidia* nodes) plus the container-level CDI annotation Kata's agent resolves
// inside the guest. Whole GPUs and shares need the host driver in the container: refused.
func (p *Plugin) realiseKata(e *ledger.Entry, claims []ledger.Entry, adj *nriapi.ContainerAdjustment) error {
	if len(e.Devices) > 0 || len(claims) > 0 {
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
