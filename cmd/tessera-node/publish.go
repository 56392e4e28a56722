package main

import (
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// publisher writes the inventory annotation (and the GPU model label) on the agent's Node, which
// is all the extender knows about the node's GPUs.
func publisher(ctx context.Context, client kubernetes.Interface, nodeName string) func(*api.NodeInventory) {
	return func(inv *api.NodeInventory) {
		data, err := api.EncodeInventory(inv)
		if err != nil {
			slog.Error("inventory does not encode; not published", "err", err)
			return
		}
		meta := map[string]any{"annotations": map[string]string{api.AnnotationInventory: string(data)}}
		if len(inv.GPUs) > 0 {
			meta["labels"] = map[string]string{api.LabelGPUModel: labelValue(inv.GPUs[0].Model)}
		}
		patch, _ := json.Marshal(map[string]any{"metadata": meta})
		pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if _, err := client.CoreV1().Nodes().Patch(pctx, nodeName, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			slog.Error("publish inventory on the Node", "node", nodeName, "err", err)
			return
		}
		slog.Info("inventory published", "node", nodeName, "gpus", len(inv.GPUs))
	}
}

// labelValue turns "NVIDIA A100-SXM4-40GB" into a label value "NVIDIA-A100-SXM4-40GB".
func labelValue(s string) string {
	s = strings.Map(func(r rune) rune {
		if r == '-' || r == '_' || r == '.' || (r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z') || (r >= '0' && r <= '9') {
			return r
		}
		return '-'
	}, s)
	return strings.Trim(s[:min(len(s), 63)], "-_.")
}
