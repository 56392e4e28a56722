package dra

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
)

// TestPluginOverGRPC runs the driver behind the real kubeletplugin helper (client-go's fake API
// server): it publishes the node's slices, and NodePrepareResources over the DRA socket, as the
// kubelet calls it, answers with the claim's CDI devices.
func TestPluginOverGRPC(t *testing.T) {
	dir, err := os.MkdirTemp("/tmp", "tsr-dra-") // unix socket paths are short
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	d, _, _ := newDriver(t)
	c := claim("s1", map[resourceapi.QualifiedName]string{CapacityMemory: "10Gi", CapacityCompute: "30"}, "gpu-0")
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a", UID: "node-uid"}}, c)
	// The kubelet's registry exists; the plugin's own directory the driver makes.
	if err := os.MkdirAll(filepath.Join(dir, "registry"), 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- d.Run(ctx, Options{NodeName: "node-a", Client: client, RegistrarDir: filepath.Join(dir, "registry"),
			PluginDir: filepath.Join(dir, "plugin"), RepublishInterval: 50 * time.Millisecond})
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	// The slices reach the API server.
	err = wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 20*time.Second, true, func(ctx context.Context) (bool, error) {
		l, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		n := 0
		for _, s := range l.Items {
			if s.Spec.Driver == DriverName && s.Spec.Pool.Name == "node-a" {
				n += len(s.Spec.Devices)
			}
		}
		return n == 4, nil
	})
	if err != nil {
		t.Fatalf("ResourceSlices with the node's 4 devices were not published: %v", err)
	}
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "plugin", "dra.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	resp, err := drapb.NewDRAPluginClient(conn).NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{
		Claims: []*drapb.Claim{{Namespace: "ns", Name: "s1", Uid: string(c.UID)}}})
	if err != nil {
		t.Fatal(err)
	}
	r := resp.Claims[string(c.UID)]
	if r == nil || r.Error != "" || len(r.Devices) != 1 ||
		!slices.Equal(r.Devices[0].CdiDeviceIds, []string{"tessera.dev/vgpu=share", "tessera.dev/gpu=GPU-a"}) || r.Devices[0].DeviceName != "gpu-0" {
		t.Fatalf("NodePrepareResources answered %v", resp)
	}
}
