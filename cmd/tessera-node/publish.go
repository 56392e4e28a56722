package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// publisher writes the inventory annotation (and the GPU model label) on the agent's Node, which
// is all the extender knows about the node's GPUs, and on every refresh the inventory heartbeat: the
// extender refuses nodes whose heartbeat it has not seen change for longer than its inventoryMaxAge
// (agent gone, GPUs unknown; timed on the extender's clock, not this one). The inventory itself is patched only when it changed, so a heartbeat does not make the
// extender rebuild the node.
//
// With a changed inventory it also sets the GPU labels (gpuNodeLabels), removing those of GPUs and
// models no longer present; migCapable says which GPUs support MIG.
func publisher(ctx context.Context, client kubernetes.Interface, nodeName string, migCapable func(uuid string) bool, log *slog.Logger) func(*api.NodeInventory) {
	last := ""
	return func(inv *api.NodeInventory) {
		data, err := api.EncodeInventory(inv)
		if err != nil {
			log.Error("inventory does not encode; not published", "err", err)
			return
		}
		annotations := map[string]string{api.AnnotationInventoryHeartbeat: time.Now().UTC().Format(time.RFC3339)}
		meta := map[string]any{"annotations": annotations}
		if string(data) != last {
			annotations[api.AnnotationInventory] = string(data)
			var current map[string]string
			if node, err := client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{}); err == nil {
				current = node.Labels
			} else {
				// Labels of models gone since the last start may stay until the next change.
				log.Error("read the Node's labels; stale per-model labels are kept", "node", nodeName, "err", err)
			}
			meta["labels"] = labelsPatch(gpuNodeLabels(inv, migCapable), current)
		}
		if err := patchNodeMeta(ctx, client, nodeName, meta); err != nil {
			log.Error("publish inventory on the Node", "node", nodeName, "err", err)
			return
		}
		if string(data) != last {
			log.Info("inventory published", "node", nodeName, "gpus", len(inv.GPUs))
		}
		last = string(data)
	}
}

// patchNodeMeta merge-patches the Node's metadata (annotations, labels), bounded to 10 s so a slow API
// server does not hold the caller's loop.
func patchNodeMeta(ctx context.Context, client kubernetes.Interface, nodeName string, meta map[string]any) error {
	patch, err := json.Marshal(map[string]any{"metadata": meta})
	if err != nil {
		return fmt.Errorf("encode the Node patch: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err = client.CoreV1().Nodes().Patch(ctx, nodeName, types.MergePatchType, patch, metav1.PatchOptions{})
	return err
}

// holdingsOf is what the ledger holds, per pod, as the extender counts it: whole GPUs and shares of
// running containers and of stopped containers' holds alike (MIG and mdev are the kubelet's to count).
func holdingsOf(node string, entries []ledger.Entry) *api.NodeHoldings {
	h := &api.NodeHoldings{Node: node, Pods: []api.PodHolding{}}
	at := map[string]int{}
	for _, e := range entries {
		if len(e.Devices) == 0 {
			continue
		}
		i, ok := at[e.PodUID]
		if !ok {
			i = len(h.Pods)
			at[e.PodUID] = i
			h.Pods = append(h.Pods, api.PodHolding{Namespace: e.Namespace, Pod: e.Pod, UID: e.PodUID})
		}
		p := &h.Pods[i]
		p.Local = p.Local || e.Local
		p.Containers = append(p.Containers, api.ContainerAssignment{Name: e.Container, Devices: e.Devices})
	}
	return h
}

// publishableHoldings encodes what the ledger holds. One holder that does not validate (say a GPU
// listed twice, from a ledger written before that was refused) must not stop publication for every
// other pod of the node: a container that does not validate on its own is left out, then a pod whose
// containers do not validate together; what was left out is returned, each naming the pod and why.
func publishableHoldings(node string, entries []ledger.Entry) ([]byte, []string) {
	h := holdingsOf(node, entries)
	if data, err := api.EncodeHoldings(h); err == nil {
		return data, nil
	}
	var left []string
	valid := func(p api.PodHolding) error {
		_, err := api.EncodeHoldings(&api.NodeHoldings{Node: node, Pods: []api.PodHolding{p}})
		return err
	}
	pods := make([]api.PodHolding, 0, len(h.Pods))
	for _, p := range h.Pods {
		who := fmt.Sprintf("pod %s/%s (uid %s)", p.Namespace, p.Pod, p.UID)
		kept := p
		kept.Containers = nil
		for _, c := range p.Containers {
			one := p
			one.Containers = []api.ContainerAssignment{c}
			if err := valid(one); err != nil {
				left = append(left, fmt.Sprintf("%s container %q: %v", who, c.Name, err))
				continue
			}
			kept.Containers = append(kept.Containers, c)
		}
		if len(kept.Containers) == 0 {
			continue
		}
		if err := valid(kept); err != nil {
			left = append(left, fmt.Sprintf("%s: %v", who, err))
			continue
		}
		pods = append(pods, kept)
	}
	h.Pods = pods
	data, err := api.EncodeHoldings(h)
	if err != nil {
		return nil, append(left, err.Error())
	}
	return data, left
}

// publishHoldings keeps the holdings annotation on the agent's Node equal to the ledger: it checks
// at once and then every second, and patches only when the content changed (or the last patch
// failed). Holders left out (publishableHoldings) are logged when they change and counted in
// leftOut.
func publishHoldings(ctx context.Context, client kubernetes.Interface, nodeName string, l *ledger.Ledger, leftOut *atomic.Int64, log *slog.Logger) {
	last, lastLeft := "", ""
	go wait.NonSlidingUntilWithContext(ctx, func(ctx context.Context) {
		data, left := publishableHoldings(nodeName, l.Entries())
		leftOut.Store(int64(len(left)))
		if why := strings.Join(left, "; "); why != lastLeft {
			if why != "" {
				log.Error("ledger holdings left out of the Node's holdings annotation (the extender does not count them); the rest is published", "node", nodeName, "leftOut", len(left), "why", why)
			}
			lastLeft = why
		}
		if data != nil && string(data) != last {
			meta := map[string]any{"annotations": map[string]string{api.AnnotationHoldings: string(data)}}
			if err := patchNodeMeta(ctx, client, nodeName, meta); err != nil {
				log.Error("publish ledger holdings on the Node", "node", nodeName, "err", err)
			} else {
				last = string(data)
			}
		}
	}, time.Second)
}
