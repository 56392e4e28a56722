package dra

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"
	drahealthv1 "k8s.io/kubelet/pkg/apis/dra-health/v1"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
)

// TestPluginOverGRPC runs the driver behind the real kubeletplugin helper (client-go's fake API
// server): it publishes the node's slices, and NodePrepareResources over the DRA socket, as the
// kubelet calls it, answers with the claim's CDI devices; the kubelet's health stream (KEP-4680)
// reports the unhealthy GPU, and a recovery reaches both the stream and the slices (republished on
// the change, not polled).
func TestPluginOverGRPC(t *testing.T) {
	dir, err := os.MkdirTemp("/tmp", "tsr-dra-") // unix socket paths are short
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	d, a, _ := newDriver(t)
	if err := d.Ready(); err == nil {
		t.Error("Ready before Run: want an error")
	}
	var observed []string
	var obsMu sync.Mutex
	d.Observe(func(call string, took time.Duration, err error) {
		obsMu.Lock()
		defer obsMu.Unlock()
		observed = append(observed, call+"/"+fmt.Sprint(err == nil))
	})
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
			PluginDir: filepath.Join(dir, "plugin")})
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	// The slices reach the API server, the unhealthy GPU tainted.
	tainted := func() (devices int, taints []string, err error) {
		l, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			return 0, nil, err
		}
		for _, s := range l.Items {
			if s.Spec.Driver == DriverName && s.Spec.Pool.Name == "node-a" {
				devices += len(s.Spec.Devices)
				for _, dev := range s.Spec.Devices {
					for _, tn := range dev.Taints {
						taints = append(taints, dev.Name+":"+tn.Key+":"+string(tn.Effect))
					}
				}
			}
		}
		return devices, taints, nil
	}
	err = wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 20*time.Second, true, func(ctx context.Context) (bool, error) {
		n, taints, err := tainted()
		return n == 5 && slices.Equal(taints, []string{"gpu-3:gpu.tessera.dev/unhealthy:NoSchedule"}), err
	})
	if err != nil {
		n, taints, _ := tainted()
		t.Fatalf("ResourceSlices with the node's 5 devices, gpu-3 tainted, were not published: %v (%d devices, taints %v)", err, n, taints)
	}
	if err := d.Ready(); err != nil {
		t.Errorf("Ready while serving: %v", err)
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
	// The claim's status.devices names the GPU and the share's caps.
	got, err := client.ResourceV1().ResourceClaims("ns").Get(ctx, "s1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var data DeviceData
	if sd := got.Status.Devices; len(sd) != 1 || sd[0].Driver != DriverName || sd[0].Pool != "node-a" || sd[0].Device != "gpu-0" || sd[0].Data == nil ||
		json.Unmarshal(sd[0].Data.Raw, &data) != nil || data != (DeviceData{UUID: "GPU-a", MemoryBytes: 10 << 30, ComputePercent: 30}) {
		t.Errorf("claim status.devices %+v (data %+v), want gpu-0 with the GPU's UUID and the 10 GiB / 30%% caps", sd, data)
	}
	if _, err := drapb.NewDRAPluginClient(conn).NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{
		Claims: []*drapb.Claim{{Namespace: "ns", Name: "s1", Uid: string(c.UID)}}}); err != nil {
		t.Fatal(err)
	}
	obsMu.Lock()
	if !slices.Equal(observed, []string{"prepare/true", "unprepare/true"}) {
		t.Errorf("observed %v, want one prepare and one unprepare, both ok", observed)
	}
	obsMu.Unlock()

	// The kubelet's health stream: every device, gpu-3 unhealthy with its reason.
	stream, err := drahealthv1.NewDRAResourceHealthClient(conn).NodeWatchResources(ctx, &drahealthv1.NodeWatchResourcesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	health := func() map[string]string {
		t.Helper()
		r, err := stream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]string{}
		for _, dh := range r.Devices {
			if dh.Device.PoolName != "node-a" || dh.HealthCheckTimeoutSeconds != 30 || dh.LastUpdatedTime == 0 {
				t.Errorf("device health %v: want pool node-a, a 30 s timeout and a time", dh)
			}
			out[dh.Device.DeviceName] = dh.Health.String() + " " + dh.Message
		}
		return out
	}
	want := map[string]string{"gpu-0": "HEALTHY ", "gpu-1": "HEALTHY ", "gpu-2-mig-1-0": "HEALTHY ", "gpu-2-mig-7-0": "HEALTHY ", "gpu-3": "UNHEALTHY XID 79"}
	if got := health(); !maps.Equal(got, want) {
		t.Errorf("first health report %v, want %v", got, want)
	}
	// Recovery (and a MIG instance going bad) reach the stream at once and the slices.
	a.setHealth("GPU-d", "")
	a.setHealth("MIG-y", "XID 94")
	want["gpu-3"], want["gpu-2-mig-7-0"] = "HEALTHY ", "UNHEALTHY XID 94"
	err = wait.PollUntilContextTimeout(ctx, 0, 20*time.Second, true, func(ctx context.Context) (bool, error) {
		return maps.Equal(health(), want), nil
	})
	if err != nil {
		t.Errorf("health after recovery never became %v: %v", want, err)
	}
	err = wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 20*time.Second, true, func(ctx context.Context) (bool, error) {
		_, taints, err := tainted()
		return slices.Equal(taints, []string{"gpu-2-mig-7-0:gpu.tessera.dev/unhealthy:NoSchedule"}), err
	})
	if err != nil {
		_, taints, _ := tainted()
		t.Errorf("slices after recovery: taints %v, want gpu-2-mig-7-0's only: %v", taints, err)
	}
}
