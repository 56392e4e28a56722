package e2e

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/tessera-gpu/tessera/internal/podresources"
)

// FakeKubelet plays the kubelet's device-facing half over the real APIs: it serves Registration
// on kubelet.sock, dials each registered plugin, keeps its ListAndWatch stream, calls Allocate
// like the kubelet's device manager, and serves the PodResources API with what it allocated.
type FakeKubelet struct {
	PluginDir    string
	PodResSocket string

	mu      sync.Mutex
	reg     *grpc.Server
	podres  *grpc.Server
	plugins map[string]*fakePlugin // by resource
	grants  *podresources.Server
	changed chan struct{}
}

type fakePlugin struct {
	conn    *grpc.ClientConn
	client  pluginapi.DevicePluginClient
	devices []*pluginapi.Device
	cancel  context.CancelFunc
}

// StartFakeKubelet starts the registration and pod-resources servers under dir.
func StartFakeKubelet(t testing.TB, dir string) *FakeKubelet {
	t.Helper()
	k := &FakeKubelet{PluginDir: filepath.Join(dir, "device-plugins"), PodResSocket: filepath.Join(dir, "pod-resources.sock"),
		plugins: map[string]*fakePlugin{}, grants: podresources.NewServer(), changed: make(chan struct{}, 1)}
	if err := os.MkdirAll(k.PluginDir, 0o755); err != nil {
		t.Fatal(err)
	}
	k.Start(t)
	srv, err := k.grants.Serve(k.PodResSocket)
	if err != nil {
		t.Fatal(err)
	}
	k.podres = srv
	t.Cleanup(func() { k.Stop(); k.podres.Stop() })
	return k
}

// Start (re)starts the registration server. Like a restarting kubelet, it first deletes every socket
// in the plugin directory, so plugins must notice and register again.
func (k *FakeKubelet) Start(t testing.TB) {
	t.Helper()
	entries, _ := os.ReadDir(k.PluginDir)
	for _, e := range entries {
		os.Remove(filepath.Join(k.PluginDir, e.Name()))
	}
	lis, err := net.Listen("unix", filepath.Join(k.PluginDir, "kubelet.sock"))
	if err != nil {
		t.Fatal(err)
	}
	k.mu.Lock()
	k.reg = grpc.NewServer()
	pluginapi.RegisterRegistrationServer(k.reg, &regServer{k: k})
	k.mu.Unlock()
	go k.reg.Serve(lis)
}

// Stop stops the registration server and drops every plugin (a kubelet going away).
func (k *FakeKubelet) Stop() {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.reg != nil {
		k.reg.Stop()
		k.reg = nil
	}
	for r, p := range k.plugins {
		p.cancel()
		p.conn.Close()
		delete(k.plugins, r)
	}
}

type regServer struct {
	pluginapi.UnimplementedRegistrationServer
	k *FakeKubelet
}

func (s *regServer) Register(ctx context.Context, req *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	k := s.k
	conn, err := grpc.NewClient("unix://"+filepath.Join(k.PluginDir, req.Endpoint), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	p := &fakePlugin{conn: conn, client: pluginapi.NewDevicePluginClient(conn)}
	lctx, cancel := context.WithCancel(context.Background())
	p.cancel = cancel
	k.mu.Lock()
	if old, ok := k.plugins[req.ResourceName]; ok {
		old.cancel()
		old.conn.Close()
	}
	k.plugins[req.ResourceName] = p
	k.mu.Unlock()
	go k.listAndWatch(lctx, req.ResourceName, p)
	return &pluginapi.Empty{}, nil
}

func (k *FakeKubelet) listAndWatch(ctx context.Context, resource string, p *fakePlugin) {
	stream, err := p.client.ListAndWatch(ctx, &pluginapi.Empty{})
	if err != nil {
		return
	}
	for {
		resp, err := stream.Recv()
		if err != nil {
			return
		}
		k.mu.Lock()
		p.devices = resp.Devices
		k.mu.Unlock()
		select {
		case k.changed <- struct{}{}:
		default:
		}
	}
}

// Healthy returns the healthy device IDs of a resource (nil if the resource is not registered).
func (k *FakeKubelet) Healthy(resource string) []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	p, ok := k.plugins[resource]
	if !ok {
		return nil
	}
	var ids []string
	for _, d := range p.devices {
		if d.Health == pluginapi.Healthy {
			ids = append(ids, d.ID)
		}
	}
	return ids
}

// Resources lists the registered resources.
func (k *FakeKubelet) Resources() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	var out []string
	for r, p := range k.plugins {
		if len(p.devices) > 0 {
			out = append(out, r)
		}
	}
	slices.Sort(out)
	return out
}

// WaitHealthy waits until a resource has exactly n healthy devices.
func (k *FakeKubelet) WaitHealthy(t testing.TB, resource string, n int) {
	t.Helper()
	if err := waitFor(30*time.Second, 50*time.Millisecond, func() (bool, error) { return len(k.Healthy(resource)) == n, nil }); err != nil {
		t.Fatalf("%s: want %d healthy devices, have %d (%v)", resource, n, len(k.Healthy(resource)), k.Healthy(resource))
	}
}

// Allocate picks n free healthy devices of a resource for a container, calls the plugin's Allocate
// and records the grant; it returns the CDI device names the plugin answered with.
func (k *FakeKubelet) Allocate(t testing.TB, ns, pod, container, resource string, n int) []string {
	t.Helper()
	inUse := k.grants.InUse(resource)
	k.mu.Lock()
	p, ok := k.plugins[resource]
	var ids []string
	if ok {
		for _, d := range p.devices {
			if d.Health == pluginapi.Healthy && !inUse[d.ID] && len(ids) < n {
				ids = append(ids, d.ID)
			}
		}
	}
	k.mu.Unlock()
	if !ok || len(ids) < n {
		t.Fatalf("kubelet: %s has %d free healthy devices, %s/%s needs %d", resource, len(ids), ns, pod, n)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := p.client.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: ids}}})
	if err != nil {
		t.Fatalf("Allocate %s %v: %v", resource, ids, err)
	}
	cr := resp.ContainerResponses[0]
	if len(cr.Envs) > 0 {
		t.Errorf("Allocate %s returned environment variables %v; Tessera returns CDI names only", resource, cr.Envs)
	}
	var names []string
	for _, d := range cr.CdiDevices {
		names = append(names, d.Name)
	}
	k.grants.Add(podresources.Key{Namespace: ns, Pod: pod, Container: container}, resource, ids...)
	return names
}

// Forget drops a pod's grants (the kubelet does so when the pod is gone).
func (k *FakeKubelet) Forget(ns, pod string) { k.grants.Forget(ns, pod) }
