package main

import (
	"context"
	"errors"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
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
	publish := publisher(context.Background(), client, "n", func(string) bool { return false }, testLog(t))
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

// One ledger holder that does not validate (a GPU listed twice, as a DRA claim allocated one GPU
// for two requests was before prepare refused it) must not stop the holdings annotation for the
// node's other pods: what validates is published, the rest is named in the log and counted.
func TestSecurityHoldingsSurviveBadEntry(t *testing.T) {
	g := func(i int) string { return "GPU-00000000-0000-4000-8000-00000000000" + string(rune('0'+i)) }
	share := func(i int) api.DeviceAssignment { return api.DeviceAssignment{UUID: g(i), MemoryBytes: 1 << 30} }
	whole := func(i int) api.DeviceAssignment { return api.DeviceAssignment{UUID: g(i), Whole: true} }
	entries := []ledger.Entry{
		{ContainerID: "c1", PodUID: "u1", Namespace: "ns", Pod: "good", Container: "a", Devices: []api.DeviceAssignment{share(0)}},
		{ContainerID: ledger.ClaimID("bad"), PodUID: "u2", Namespace: "ns", Pod: "claim-twice", Container: "resourceclaim/bad",
			Devices: []api.DeviceAssignment{share(1), share(1)}},
		{ContainerID: "c3a", PodUID: "u3", Namespace: "ns", Pod: "half", Container: "a", Devices: []api.DeviceAssignment{whole(2), whole(2)}},
		{ContainerID: "c3b", PodUID: "u3", Namespace: "ns", Pod: "half", Container: "b", Devices: []api.DeviceAssignment{share(3)}},
		{ContainerID: "c4a", PodUID: "u4", Namespace: "ns", Pod: "clash", Container: "a", Devices: []api.DeviceAssignment{whole(4)}},
		{ContainerID: "c4b", PodUID: "u4", Namespace: "ns", Pod: "clash", Container: "b", Devices: []api.DeviceAssignment{whole(4)}},
	}
	data, left := publishableHoldings("n", entries)
	if data == nil {
		t.Fatalf("nothing published; left out: %v", left)
	}
	h, err := api.DecodeHoldings(data)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, p := range h.Pods {
		for _, c := range p.Containers {
			got = append(got, p.UID+"/"+c.Name)
		}
	}
	if want := []string{"u1/a", "u3/b"}; !slices.Equal(got, want) {
		t.Errorf("published %v, want %v (the valid pod, and the valid container of a pod with a bad one)", got, want)
	}
	all := strings.Join(left, "\n")
	if len(left) != 3 || !strings.Contains(all, "ns/claim-twice (uid u2)") || !strings.Contains(all, `ns/half (uid u3) container "a"`) ||
		!strings.Contains(all, "ns/clash (uid u4)") || !strings.Contains(all, "given twice") {
		t.Errorf("left out:\n%s\nwant the claim listing a GPU twice, container a of pod half, and pod clash, each named with why", all)
	}

	// The loop publishes and counts them.
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n"}})
	l, err := ledger.Open(filepath.Join(t.TempDir(), "ledger.json"), nil)
	if err != nil {
		t.Fatal(err)
	}
	inv := &api.NodeInventory{APIVersion: api.Version, Node: "n", SharesPerGPU: 4}
	for i := range 2 {
		inv.GPUs = append(inv.GPUs, api.GPU{UUID: g(i), Index: i, MemoryBytes: 8 << 30, Healthy: true})
	}
	if err := l.Reserve(entries[0], inv); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var leftOut atomic.Int64
	publishHoldings(ctx, client, "n", l, &leftOut, testLog(t))
	deadline := time.Now().Add(5 * time.Second)
	for {
		node, err := client.CoreV1().Nodes().Get(ctx, "n", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if h, err := api.DecodeHoldings([]byte(node.Annotations[api.AnnotationHoldings])); err == nil && len(h.Pods) == 1 && h.Pods[0].UID == "u1" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("holdings annotation %q, want pod u1's", node.Annotations[api.AnnotationHoldings])
		}
		time.Sleep(20 * time.Millisecond)
	}
	if leftOut.Load() != 0 {
		t.Errorf("left-out gauge %d for a valid ledger", leftOut.Load())
	}
}

// TestHoldingsPublishSchedule pins the holdings loop on a synctest bubble's clock: the first patch
// goes at once, a failed patch is tried again a second later, an unchanged ledger is not patched
// again, a changed one is within a second, and the loop ends with its context.
func TestHoldingsPublishSchedule(t *testing.T) { synctest.Test(t, holdingsPublishSchedule) }

func holdingsPublishSchedule(t *testing.T) {
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n"}})
	var patches atomic.Int64 // synctest.Wait orders nothing for the race detector
	client.PrependReactor("patch", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		if patches.Add(1) == 1 {
			return true, nil, errors.New("API server unavailable")
		}
		return false, nil, nil
	})
	l, err := ledger.Open(filepath.Join(t.TempDir(), "ledger.json"), nil)
	if err != nil {
		t.Fatal(err)
	}
	g0 := "GPU-00000000-0000-4000-8000-000000000000"
	inv := &api.NodeInventory{APIVersion: api.Version, Node: "n", SharesPerGPU: 4,
		GPUs: []api.GPU{{UUID: g0, Index: 0, MemoryBytes: 8 << 30, Healthy: true}}}
	reserve := func(pod string) {
		t.Helper()
		e := ledger.Entry{ContainerID: "c-" + pod, PodUID: "u-" + pod, Namespace: "ns", Pod: pod, Container: "a",
			Devices: []api.DeviceAssignment{{UUID: g0, MemoryBytes: 1 << 30}}}
		if err := l.Reserve(e, inv); err != nil {
			t.Fatal(err)
		}
	}
	reserve("p1")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel() // the bubble fails if the loop outlives it
	var leftOut atomic.Int64
	publishHoldings(ctx, client, "n", l, &leftOut, testLog(t))
	check := func(when string, want int) {
		t.Helper()
		synctest.Wait()
		if n := patches.Load(); n != int64(want) {
			t.Fatalf("%s: %d patches, want %d", when, n, want)
		}
	}
	check("at start", 1)
	time.Sleep(1500 * time.Millisecond)
	check("a second after the failed patch", 2)
	time.Sleep(time.Second)
	check("a second later, the ledger unchanged", 2)
	reserve("p2")
	time.Sleep(time.Second)
	check("a second after the ledger changed", 3)
	node, err := client.CoreV1().Nodes().Get(ctx, "n", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if h, err := api.DecodeHoldings([]byte(node.Annotations[api.AnnotationHoldings])); err != nil || len(h.Pods) != 2 {
		t.Errorf("holdings annotation %q (%v), want pods p1 and p2", node.Annotations[api.AnnotationHoldings], err)
	}
}
