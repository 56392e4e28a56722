package main

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// testLog writes the code's log lines into the test's output.
func testLog(t testing.TB) *slog.Logger { return slog.New(slog.NewTextHandler(t.Output(), nil)) }

// Everything the ledger holds in whole GPUs or shares is published per pod: local placements and
// holds of stopped containers included; MIG and mdev (the kubelet counts them) are not.
func TestSecurityHoldingsPublished(t *testing.T) {
	g0, g1 := "GPU-00000000-0000-4000-8000-000000000000", "GPU-00000000-0000-4000-8000-000000000001"
	h := holdingsOf("n", []ledger.Entry{
		{ContainerID: "c1", PodUID: "u1", Namespace: "ns", Pod: "local", Container: "a", Local: true, Devices: []api.DeviceAssignment{{UUID: g0, MemoryBytes: 1 << 30}}},
		{ContainerID: "hold:u1/b", PodUID: "u1", Namespace: "ns", Pod: "local", Container: "b", Devices: []api.DeviceAssignment{{UUID: g1, MemoryBytes: 1 << 30}}},
		{ContainerID: "c3", PodUID: "u3", Namespace: "ns", Pod: "mig", Container: "a", MIG: []string{"MIG-x"}},
	})
	if _, err := api.EncodeHoldings(h); err != nil {
		t.Fatal(err)
	}
	if len(h.Pods) != 1 || !h.Pods[0].Local || len(h.Pods[0].Containers) != 2 || h.Pods[0].Containers[1].Devices[0].UUID != g1 {
		t.Errorf("holdings %+v", h)
	}
}

// Every refresh renews the heartbeat; the inventory annotation is patched only when it changed, so
// the extender does not rebuild the node for a heartbeat.
func TestPublisherHeartbeat(t *testing.T) {
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n"}})
	var inventoryPatches int
	client.PrependReactor("patch", "nodes", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if strings.Contains(string(a.(k8stesting.PatchAction).GetPatch()), api.AnnotationInventory+`"`) {
			inventoryPatches++
		}
		return false, nil, nil
	})
	inv := &api.NodeInventory{APIVersion: api.Version, Node: "n", SharesPerGPU: 4, GPUs: []api.GPU{}}
	publish := publisher(context.Background(), client, "n", testLog(t))
	for range 3 {
		publish(inv)
	}
	node, err := client.CoreV1().Nodes().Get(context.Background(), "n", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	hb, err := time.Parse(time.RFC3339, node.Annotations[api.AnnotationInventoryHeartbeat])
	if err != nil || time.Since(hb) > time.Minute {
		t.Errorf("heartbeat %q: %v", node.Annotations[api.AnnotationInventoryHeartbeat], err)
	}
	if node.Annotations[api.AnnotationInventory] == "" || inventoryPatches != 1 {
		t.Errorf("inventory patched %d times for one inventory (want 1), annotation %q", inventoryPatches, node.Annotations[api.AnnotationInventory])
	}
	inv.SharesPerGPU = 8
	publish(inv)
	if inventoryPatches != 2 {
		t.Errorf("a changed inventory was not published (%d patches)", inventoryPatches)
	}
}
