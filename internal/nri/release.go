package nri

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	nriapi "github.com/containerd/nri/pkg/api"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/ledger"
	"github.com/tessera-gpu/tessera/internal/podresources"
)

// holdPrefix marks ledger entries that keep a stopped container's devices for its pod: the kubelet
// restarts a container with the same grant (no new Allocate), so the devices stay reserved to the
// pod and container name until the pod goes, and a crash-looping container gets the same GPU back
// with no window for another pod. ("pod:" is the older per-pod form of mdev holds, still released.)
const holdPrefix = "hold:"

func holdID(podUID, container string) string { return holdPrefix + podUID + "/" + container }

func isHold(id string) bool {
	return strings.HasPrefix(id, holdPrefix) || strings.HasPrefix(id, "pod:")
}

// StopContainer turns what the container held into its pod's hold as soon as its processes are gone.
func (p *Plugin) StopContainer(ctx context.Context, pod *nriapi.PodSandbox, c *nriapi.Container) ([]*nriapi.ContainerUpdate, error) {
	p.release(c.GetId())
	return nil, nil
}

// RemoveContainer releases idempotently (a container removed without a stop event, or whose
// creation failed after the plugin approved it).
func (p *Plugin) RemoveContainer(ctx context.Context, pod *nriapi.PodSandbox, c *nriapi.Container) error {
	p.release(c.GetId())
	return nil
}

// StopPodSandbox frees the pod's holds: once its sandbox is stopped no container of it restarts
// (a pod that completed or is being deleted), and the extender counts it as holding nothing.
func (p *Plugin) StopPodSandbox(ctx context.Context, pod *nriapi.PodSandbox) error {
	p.releaseSandbox(ctx, pod)
	return nil
}

// RemovePodSandbox frees the pod's holds and removes its mdev devices.
func (p *Plugin) RemovePodSandbox(ctx context.Context, pod *nriapi.PodSandbox) error {
	p.releaseSandbox(ctx, pod)
	return nil
}

// releaseSandbox frees the holds of a pod sandbox, known by its pod UID or, for a sandbox containerd
// recovered after a restart (it may report no pod metadata), by its ID.
func (p *Plugin) releaseSandbox(ctx context.Context, pod *nriapi.PodSandbox) {
	p.log.Info("pod sandbox going", "id", pod.GetId(), "uid", pod.GetUid(), "pod", pod.GetNamespace()+"/"+pod.GetName())
	uids := map[string]bool{}
	if pod.GetUid() != "" {
		uids[pod.GetUid()] = true
	}
	for _, e := range p.agent.Ledger().Entries() {
		if pod.GetId() != "" && e.SandboxID == pod.GetId() {
			uids[e.PodUID] = true
		}
	}
	for uid := range uids {
		p.releasePod(ctx, uid)
	}
}

// releasePod frees every hold of a pod.
func (p *Plugin) releasePod(ctx context.Context, podUID string) {
	l := p.agent.Ledger()
	for _, e := range l.Entries() {
		if e.PodUID != podUID || !isHold(e.ContainerID) {
			continue
		}
		if _, ok, err := l.Release(e.ContainerID); err != nil || !ok {
			if err != nil {
				p.log.Error("release pod devices", "pod", e.Namespace+"/"+e.Pod, "err", err)
			}
			continue
		}
		p.removeMdevs(ctx, e.Mdev)
		p.log.Info("pod devices released", "pod", e.Namespace+"/"+e.Pod, "container", e.Container, "devices", e.Devices, "mig", e.MIG, "mdev", e.Mdev)
	}
}

func (p *Plugin) removeMdevs(ctx context.Context, ids []string) {
	for _, id := range ids {
		if err := p.agent.RemoveMdev(ctx, id); err != nil {
			p.log.Error("remove mdev device", "uuid", id, "err", err)
		}
	}
}

// release moves a container's entry to its pod's hold and removes its files.
func (p *Plugin) release(containerID string) {
	l := p.agent.Ledger()
	p.removeContainerDir(containerID)
	e, ok := l.Get(containerID)
	if !ok {
		return
	}
	hold := e
	hold.ContainerID = holdID(e.PodUID, e.Container)
	if err := l.Move(containerID, hold, p.agent.Inventory()); err != nil {
		// Moving cannot over-commit (same devices); if it fails the container's entry stays, which
		// over-reserves rather than gives the GPU away; Synchronize retries.
		p.log.Error("keep stopped container's devices for its pod", "id", containerID, "err", err)
		return
	}
	p.log.Info("container stopped; its devices stay with its pod", "pod", e.Namespace+"/"+e.Pod, "container", e.Container, "id", containerID)
}

// Synchronize rebuilds the ledger from the containers the runtime has: entries of containers that
// are gone become holds of their pod, holds of pods that are gone are released, live containers the
// ledger does not know (it was lost) are re-adopted from the entry Tessera annotated them with, and
// running containers that hold GPU devices with no entry are reported (metric and Event).
func (p *Plugin) Synchronize(ctx context.Context, pods []*nriapi.PodSandbox, containers []*nriapi.Container) ([]*nriapi.ContainerUpdate, error) {
	l := p.agent.Ledger()
	livePods := map[string]*nriapi.PodSandbox{}
	for _, pod := range pods {
		livePods[pod.GetUid()] = pod
	}
	live := map[string]bool{}
	var unrealised int64
	for _, c := range containers {
		if c.GetState() == nriapi.ContainerState_CONTAINER_STOPPED {
			continue
		}
		live[c.GetId()] = true
		p.readopt(c)
		if pod := livePods[sandboxUID(pods, c)]; pod != nil && p.reportUnrealised(ctx, pod, c) {
			unrealised++
		}
	}
	p.unrealised.Store(unrealised)
	for _, e := range l.Entries() {
		switch {
		case live[e.ContainerID]:
		case ledger.IsClaim(e.ContainerID): // a prepared DRA claim: NodeUnprepareResources releases it
		case isHold(e.ContainerID) && livePods[e.PodUID] != nil:
		case isHold(e.ContainerID):
			p.releasePod(ctx, e.PodUID)
		case livePods[e.PodUID] != nil:
			p.release(e.ContainerID)
		default:
			if _, _, err := l.Release(e.ContainerID); err != nil {
				return nil, err
			}
			p.removeContainerDir(e.ContainerID)
			p.removeMdevs(ctx, e.Mdev)
		}
	}
	p.sweepClaims(l)
	p.synced.Store(true)
	p.log.Info("synchronized with the runtime", "containers", len(containers), "held", len(l.Entries()), "unrealised", unrealised)
	return nil, nil
}

func sandboxUID(pods []*nriapi.PodSandbox, c *nriapi.Container) string {
	for _, pod := range pods {
		if pod.GetId() == c.GetPodSandboxId() {
			return pod.GetUid()
		}
	}
	return ""
}

// readopt re-adopts a running container the ledger lost, from its tessera.dev/ledger-entry
// annotation (which only the plugin's adjustment sets; the ledger still refuses any over-commit).
func (p *Plugin) readopt(c *nriapi.Container) {
	l := p.agent.Ledger()
	raw, ok := c.GetAnnotations()[api.AnnotationLedgerEntry]
	if _, known := l.Get(c.GetId()); known || !ok {
		return
	}
	var e ledger.Entry
	if err := json.Unmarshal([]byte(raw), &e); err != nil || e.ContainerID != c.GetId() {
		p.log.Error("cannot re-adopt container: bad ledger annotation", "id", c.GetId(), "err", err)
		return
	}
	var err error
	if _, held := l.Get(holdID(e.PodUID, e.Container)); held {
		err = l.Move(holdID(e.PodUID, e.Container), e, p.agent.Inventory())
	} else {
		err = l.Reserve(e, p.agent.Inventory())
	}
	if err != nil {
		p.log.Error("cannot re-adopt container", "id", c.GetId(), "err", err)
		return
	}
	p.log.Info("re-adopted running container", "id", c.GetId(), "pod", e.Namespace+"/"+e.Pod)
}

// reportUnrealised reports a running container holding GPU devices with no ledger entry: it started
// without the plugin (before Tessera was installed, or past a runtime without the realisation hook).
func (p *Plugin) reportUnrealised(ctx context.Context, pod *nriapi.PodSandbox, c *nriapi.Container) bool {
	if p.isAdmin(pod) {
		return false
	}
	e, known := p.agent.Ledger().Get(c.GetId())
	x := p.devices()
	var entry *ledger.Entry
	if known {
		entry = &e
	}
	bad := ungranted(c.GetLinux().GetDevices(), "the running container", x, p.grantedNumbers(entry, x))
	if len(bad) == 0 {
		return false
	}
	if priv, err := p.privilegedContainer(ctx, pod, c.GetName()); err == nil && priv {
		return false
	}
	msg := fmt.Sprintf("container %q is running with GPU devices Tessera did not grant or record: %s; delete the pod so it is recreated through the kubelet's grant",
		c.GetName(), strings.Join(bad, "; "))
	p.log.Error("unrealised GPU container", "pod", pod.GetNamespace()+"/"+pod.GetName(), "container", c.GetName(), "devices", bad)
	p.warn(pod, "TesseraUnrealisedGPU", msg)
	return true
}

// ReleaseUnlisted frees the holds of pods the kubelet no longer lists (PodResources), for when the
// runtime's sandbox events were missed. A hold goes only when two consecutive lists both lack its
// pod, so a kubelet that has just restarted and lists nothing yet frees nothing at once.
func (p *Plugin) ReleaseUnlisted(ctx context.Context, listed map[podresources.Key]podresources.Grant) {
	pods := map[string]bool{}
	for k := range listed {
		pods[k.Namespace+"/"+k.Pod] = true
	}
	p.unlistedMu.Lock()
	defer p.unlistedMu.Unlock()
	missing := map[string]bool{}
	for _, e := range p.agent.Ledger().Entries() {
		if !isHold(e.ContainerID) || pods[e.Namespace+"/"+e.Pod] {
			continue
		}
		missing[e.PodUID] = true
		if p.unlisted[e.PodUID] {
			p.log.Info("the kubelet no longer lists the pod; releasing its holds", "pod", e.Namespace+"/"+e.Pod)
			p.releasePod(ctx, e.PodUID)
		}
	}
	p.unlisted = missing
}
