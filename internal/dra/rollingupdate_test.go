package dra

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"

	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// TestPluginRollingUpdate runs the old and the new agent of a DaemonSet rolling update with maxSurge
// side by side behind the real kubeletplugin helper, each with its own view of the node's one
// ledger file: both register under sockets named for their pods, a claim the old one prepared is
// held for the new one too (it refuses the GPU whole), both prepare claims while both run and
// neither loses the other's, and once the old one stops, the new one unprepares the old one's claim.
func TestPluginRollingUpdate(t *testing.T) {
	dir, err := os.MkdirTemp("/tmp", "tsr-dra-ru-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	registry, plugin := filepath.Join(dir, "registry"), filepath.Join(dir, "plugin")
	if err := os.MkdirAll(registry, 0o755); err != nil {
		t.Fatal(err)
	}
	ledgerPath := filepath.Join(dir, "ledger.json")
	share := map[resourceapi.QualifiedName]string{CapacityMemory: "10Gi"}
	s1, s2, s3, whole := claim("s1", share, "gpu-0"), claim("s2", share, "gpu-0"), claim("s3", share, "gpu-1"), claim("whole", nil, "gpu-0")
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a", UID: "node-uid"}}, s1, s2, s3, whole)
	start := func(uid types.UID) (func(), *grpc.ClientConn) {
		l, err := ledger.Open(ledgerPath, nil)
		if err != nil {
			t.Fatal(err)
		}
		a := &fakeAgent{inv: testInventory(), l: l, gen: &cdi.Generator{Vendor: "tessera.dev"}, unhealthy: map[string]string{}, changes: make(chan struct{}, 1)}
		d := New(a, nil)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() {
			done <- d.Run(ctx, Options{NodeName: "node-a", Client: client, RegistrarDir: registry, PluginDir: plugin, RollingUpdateUID: uid})
		}()
		if err := wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, 20*time.Second, true, func(context.Context) (bool, error) {
			return d.Ready() == nil, nil
		}); err != nil {
			t.Fatalf("agent %s never served its sockets: %v", uid, d.Ready())
		}
		conn, err := grpc.NewClient("unix://"+filepath.Join(plugin, "dra-"+string(uid)+".sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		stopped := false
		stop := func() {
			if stopped {
				return
			}
			stopped = true
			conn.Close()
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run of %s: %v", uid, err)
			}
		}
		t.Cleanup(stop)
		return stop, conn
	}
	call := func(conn *grpc.ClientConn, c *resourceapi.ResourceClaim) string {
		t.Helper()
		resp, err := drapb.NewDRAPluginClient(conn).NodePrepareResources(context.Background(), &drapb.NodePrepareResourcesRequest{
			Claims: []*drapb.Claim{{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)}}})
		if err != nil {
			t.Fatal(err)
		}
		return resp.Claims[string(c.UID)].GetError()
	}
	stopOld, oldConn := start("pod-old")
	if e := call(oldConn, s1); e != "" {
		t.Fatalf("old agent prepares s1: %s", e)
	}
	_, newConn := start("pod-new")
	for _, uid := range []types.UID{"pod-old", "pod-new"} {
		if _, err := os.Stat(filepath.Join(registry, kubeletplugin.RollingUpdateRegistrarSocketFile(registry, DriverName, uid))); err != nil {
			t.Errorf("registration socket of %s while both run: %v", uid, err)
		}
	}
	// The old agent still serves the kubelet's calls: what it prepares now the new one must not lose.
	if e := call(oldConn, s3); e != "" {
		t.Fatalf("old agent prepares s3 during the update: %s", e)
	}
	if e := call(newConn, whole); !strings.Contains(e, "holds") {
		t.Errorf("the new agent gives GPU 0 whole while the old one's claim holds a share of it: %q", e)
	}
	if e := call(newConn, s2); e != "" {
		t.Errorf("the new agent prepares s2 during the update: %s", e)
	}
	stopOld()
	l, err := ledger.Open(ledgerPath, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []*resourceapi.ResourceClaim{s1, s2, s3} {
		if _, ok := l.Get(ledger.ClaimID(string(c.UID))); !ok {
			t.Errorf("claim %s is not prepared after the old agent stopped", c.Name)
		}
	}
	res, err := drapb.NewDRAPluginClient(newConn).NodeUnprepareResources(context.Background(), &drapb.NodeUnprepareResourcesRequest{
		Claims: []*drapb.Claim{{Namespace: "ns", Name: "s1", Uid: string(s1.UID)}}})
	if err != nil || res.Claims[string(s1.UID)].GetError() != "" {
		t.Fatalf("the new agent unprepares the old one's claim: %v %v", err, res)
	}
	if _, ok := l.Get(ledger.ClaimID(string(s1.UID))); ok {
		t.Error("s1 is still held after the new agent unprepared it")
	}
}
