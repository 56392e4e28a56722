package nri

import (
	"context"
	"encoding/json"
	"log/slog"
	"os"

	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/tessera-gpu/tessera/internal/ledger"
)

// podEntryID keeps a pod's mdev devices in the ledger after its containers stop: a restarted
// container reuses them (the kubelet does not call Allocate again), so they go with the pod.
func podEntryID(podUID string) string { return "pod:" + podUID }

// StopContainer frees what the container held as soon as its processes are gone.
func (p *Plugin) StopContainer(ctx context.Context, pod *nriapi.PodSandbox, c *nriapi.Container) ([]*nriapi.ContainerUpdate, error) {
	p.release(c.GetId())
	return nil, nil
}

// RemoveContainer releases idempotently (a container removed without a stop event).
func (p *Plugin) RemoveContainer(ctx context.Context, pod *nriapi.PodSandbox, c *nriapi.Container) error {
	p.release(c.GetId())
	return nil
}

// RemovePodSandbox removes the pod's mdev devices.
func (p *Plugin) RemovePodSandbox(ctx context.Context, pod *nriapi.PodSandbox) error {
	e, ok, err := p.agent.Ledger().Release(podEntryID(pod.GetUid()))
	if err != nil {
		slog.Error("release pod devices", "pod", pod.GetNamespace()+"/"+pod.GetName(), "err", err)
		return nil
	}
	if ok {
		for _, id := range e.Mdev {
			if err := p.agent.RemoveMdev(ctx, id); err != nil {
				slog.Error("remove mdev device", "uuid", id, "err", err)
			}
		}
		slog.Info("pod devices released", "pod", pod.GetNamespace()+"/"+pod.GetName(), "mdev", e.Mdev)
	}
	return nil
}

func (p *Plugin) release(containerID string) {
	l := p.agent.Ledger()
	e, ok, err := l.Release(containerID)
	if err != nil {
		slog.Error("release container", "id", containerID, "err", err)
		return
	}
	os.RemoveAll(p.containerDir(containerID))
	if !ok {
		return
	}
	slog.Info("container released", "pod", e.Namespace+"/"+e.Pod, "container", e.Container, "id", containerID)
	if len(e.Mdev) > 0 {
		keep := ledger.Entry{ContainerID: podEntryID(e.PodUID), PodUID: e.PodUID, Namespace: e.Namespace, Pod: e.Pod, Mdev: e.Mdev}
		if prev, had := l.Get(keep.ContainerID); had {
			keep.Mdev = append(prev.Mdev, e.Mdev...)
		}
		if err := l.Reserve(keep, p.agent.Inventory()); err != nil {
			slog.Error("keep pod mdev devices", "pod", e.Namespace+"/"+e.Pod, "err", err)
		}
	}
}

// Synchronize rebuilds the ledger from the containers the runtime has: entries of containers that
// are gone are released, live containers the ledger does not know (it was lost) are re-adopted from
// the entry Tessera annotated them with.
func (p *Plugin) Synchronize(ctx context.Context, pods []*nriapi.PodSandbox, containers []*nriapi.Container) ([]*nriapi.ContainerUpdate, error) {
	l := p.agent.Ledger()
	live := map[string]bool{}
	for _, pod := range pods {
		live[podEntryID(pod.GetUid())] = true
	}
	for _, c := range containers {
		if c.GetState() == nriapi.ContainerState_CONTAINER_STOPPED {
			continue
		}
		live[c.GetId()] = true
		raw, ok := c.GetAnnotations()[AnnotationLedgerEntry]
		if _, known := l.Get(c.GetId()); known || !ok {
			continue
		}
		var e ledger.Entry
		if err := json.Unmarshal([]byte(raw), &e); err != nil || e.ContainerID != c.GetId() {
			slog.Error("cannot re-adopt container: bad ledger annotation", "id", c.GetId(), "err", err)
			continue
		}
		if err := l.Reserve(e, p.agent.Inventory()); err != nil {
			slog.Error("cannot re-adopt container", "id", c.GetId(), "err", err)
			continue
		}
		slog.Info("re-adopted running container", "id", c.GetId(), "pod", e.Namespace+"/"+e.Pod)
	}
	gone, err := l.Retain(live)
	if err != nil {
		return nil, err
	}
	for _, e := range gone {
		os.RemoveAll(p.containerDir(e.ContainerID))
		for _, id := range e.Mdev {
			if e.ContainerID == podEntryID(e.PodUID) {
				p.agent.RemoveMdev(ctx, id)
			}
		}
	}
	p.synced.Store(true)
	slog.Info("synchronized with the runtime", "containers", len(containers), "released", len(gone), "held", len(l.Entries()))
	return nil, nil
}
