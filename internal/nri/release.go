package nri

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	nriapi "github.com/containerd/nri/pkg/api"
	corev1 "k8s.io/api/core/v1"

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

// StopPodSandbox frees the pod's holds when the pod will run no container again (podFate): a
// sandbox is also stopped when the kubelet recreates it (the sandbox died, the node rebooted), and
// the recreated containers come with the same grant, so their GPUs stay theirs until then.
func (p *Plugin) StopPodSandbox(ctx context.Context, pod *nriapi.PodSandbox) error {
	p.releaseSandbox(ctx, pod, "stopped")
	return nil
}

// RemovePodSandbox frees the pod's holds and removes its mdev devices, by the same rule: the
// kubelet's garbage collection also removes the superseded sandboxes of a pod that still runs.
func (p *Plugin) RemovePodSandbox(ctx context.Context, pod *nriapi.PodSandbox) error {
	p.releaseSandbox(ctx, pod, "removed")
	return nil
}

// releaseSandbox frees the holds of a pod sandbox's pod, known by its pod UID or, for a sandbox
// containerd recovered after a restart (it may report no pod metadata), by its ID; only for a pod
// that will run no container again (podFate).
func (p *Plugin) releaseSandbox(ctx context.Context, pod *nriapi.PodSandbox, how string) {
	p.log.Info("pod sandbox "+how, "id", pod.GetId(), "uid", pod.GetUid(), "pod", pod.GetNamespace()+"/"+pod.GetName())
	uids := map[string]podKey{}
	if pod.GetUid() != "" && pod.GetName() != "" {
		uids[pod.GetUid()] = podKey{pod.GetNamespace(), pod.GetName()}
	}
	for _, e := range p.agent.Ledger().Entries() {
		_, known := uids[e.PodUID]
		if !known && (pod.GetId() != "" && e.SandboxID == pod.GetId() || pod.GetUid() != "" && e.PodUID == pod.GetUid()) {
			uids[e.PodUID] = podKey{e.Namespace, e.Pod} // the name as the entry recorded it
		}
	}
	for uid, k := range uids {
		if !p.holds(uid) {
			continue // most pods hold no GPU: no question to the API server for them
		}
		if fate, why := p.podFate(ctx, k.namespace, k.name, uid); fate == podMayRun {
			p.log.Info("pod sandbox "+how+" but the pod may run again; its devices stay held", "pod", k.namespace+"/"+k.name, "uid", uid, "why", why)
			continue
		}
		p.releasePod(ctx, uid)
	}
}

type podKey struct{ namespace, name string }

// podFate is whether a pod may run a container again, as the API server says.
type podFate int

const (
	// podMayRun: the pod is in the API server and not finished, or the API server cannot say (holds
	// then stay: over-reserving beats a GPU given away while the kubelet still has the grant).
	podMayRun podFate = iota
	// podGone: the API server has no pod of that name and UID.
	podGone
	// podReplaced: podGone, and the API server has another pod of that name, so the kubelet's list
	// naming it says nothing about this one.
	podReplaced
	// podFinished: terminal (Succeeded, Failed) or being deleted; no container of it starts again.
	podFinished
)

// podFate reads the pod's fate from the API server, with the reason.
func (p *Plugin) podFate(ctx context.Context, namespace, name, uid string) (podFate, string) {
	spec, err := p.pods.Pod(ctx, namespace, name, uid)
	switch {
	case errors.Is(err, ErrPodReplaced):
		return podReplaced, err.Error()
	case errors.Is(err, ErrPodGone), errors.Is(err, ErrNoAPIServer):
		return podGone, err.Error()
	case err != nil:
		return podMayRun, "the API server cannot say whether the pod is gone: " + err.Error()
	case spec.DeletionTimestamp != nil:
		return podFinished, "the pod is being deleted"
	case spec.Status.Phase == corev1.PodSucceeded || spec.Status.Phase == corev1.PodFailed:
		return podFinished, "the pod is " + string(spec.Status.Phase)
	}
	return podMayRun, "the pod is " + string(spec.Status.Phase) + " in the API server"
}

// holds reports whether the ledger holds devices for the pod's stopped containers.
func (p *Plugin) holds(uid string) bool {
	for _, e := range p.agent.Ledger().Entries() {
		if e.PodUID == uid && isHold(e.ContainerID) {
			return true
		}
	}
	return false
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

// takeFromPodHolds takes the MIG and mdev devices the kubelet granted e's container away from the
// holds of its pod's other, stopped containers. The kubelet's device manager passes an init
// container's devices on to the pod's later containers (and a recreated sandbox's init container
// gets them back), so a device held for a stopped container of the same pod is the pod's to pass
// on; another pod's holds and running containers' entries keep theirs (the ledger refuses those).
func (p *Plugin) takeFromPodHolds(e *ledger.Entry) error {
	granted := map[string]bool{}
	for _, id := range append(slices.Clone(e.MIG), e.Mdev...) {
		granted[id] = true
	}
	if len(granted) == 0 {
		return nil
	}
	l := p.agent.Ledger()
	for _, h := range l.Entries() {
		if h.PodUID != e.PodUID || !isHold(h.ContainerID) || h.Container == e.Container {
			continue
		}
		left := h
		left.MIG = slices.DeleteFunc(slices.Clone(h.MIG), func(id string) bool { return granted[id] })
		left.Mdev = slices.DeleteFunc(slices.Clone(h.Mdev), func(id string) bool { return granted[id] })
		if len(left.MIG) == len(h.MIG) && len(left.Mdev) == len(h.Mdev) {
			continue
		}
		var err error
		if len(left.Devices) == 0 && len(left.MIG) == 0 && len(left.Mdev) == 0 && len(left.Claims) == 0 {
			_, _, err = l.Release(h.ContainerID)
		} else {
			err = l.Move(h.ContainerID, left, p.agent.Inventory())
		}
		if err != nil {
			return fmt.Errorf("take the devices the kubelet passed on from container %q of the pod: %w", h.Container, err)
		}
		p.log.Info("devices passed on within the pod", "pod", e.Namespace+"/"+e.Pod, "from", h.Container, "to", e.Container)
	}
	return nil
}

// Synchronize rebuilds the ledger from the containers the runtime has: entries of containers that
// are gone become holds of their pod (kept, as every hold, until ReleaseUnlisted finds the pod
// finished or gone), live containers the
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
		case isHold(e.ContainerID):
			// Kept even with no live sandbox (the kubelet may be recreating it: releaseSandbox's rule);
			// ReleaseUnlisted decides, outside the runtime's request: asking the API server here could
			// hold up the registration when it is down (after a reboot of a node whose API server is a
			// static pod waiting on this very runtime).
		case e.PodUID != "":
			// The container is gone (its sandbox may be too, after a reboot): its devices become its
			// pod's hold, for the container the kubelet recreates with the same grant.
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

// ReleaseUnlisted frees the holds of pods that will run no container again, for when the runtime's
// sandbox events were missed or came before the API server knew (a finished pod's phase is written
// after its sandbox stops): a pod the API server shows finished (terminal, being deleted) at once;
// a pod the API server no longer has once two consecutive kubelet lists (PodResources) lack it too,
// so a kubelet that has just restarted and lists nothing yet frees nothing; a pod whose name the API
// server now gives another pod at once (the kubelet lists names, and lists that name for the other
// pod as long as it runs here: waiting for the name to go would keep the hold as long). A pod that
// may still run, or one the API server cannot answer for, keeps its holds.
func (p *Plugin) ReleaseUnlisted(ctx context.Context, listed map[podresources.Key]podresources.Grant) {
	pods := map[string]bool{}
	for k := range listed {
		pods[k.Namespace+"/"+k.Pod] = true
	}
	p.unlistedMu.Lock()
	defer p.unlistedMu.Unlock()
	missing := map[string]bool{}
	seen := map[string]bool{}
	for _, e := range p.agent.Ledger().Entries() {
		if !isHold(e.ContainerID) || seen[e.PodUID] {
			continue
		}
		seen[e.PodUID] = true
		unlisted := !pods[e.Namespace+"/"+e.Pod]
		if unlisted {
			missing[e.PodUID] = true
		}
		fate, why := p.podFate(ctx, e.Namespace, e.Pod, e.PodUID)
		if fate == podFinished || fate == podReplaced || fate == podGone && unlisted && p.unlisted[e.PodUID] {
			p.log.Info("the pod will run no container again; releasing its holds", "pod", e.Namespace+"/"+e.Pod, "why", why)
			p.releasePod(ctx, e.PodUID)
		}
	}
	p.unlisted = missing
}
