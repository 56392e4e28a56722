// Package fakekubelet is a test double for the kubelet's device-facing half, over the real APIs:
// the device plugin Registration service on kubelet.sock, a connection to every registered plugin
// (GetDevicePluginOptions, a ListAndWatch stream, Allocate as the device manager calls it), and,
// when asked, the PodResources API listing what Allocate granted. It is as strict as kubelet 1.37
// where the plugins depend on it: it wipes the sockets of its directory when it starts, and it
// refuses a registration on a socket path whose endpoint is still connected.
//
// The device plugin unit tests (internal/deviceplugin) and the end-to-end suite (test/e2e) share it.
package fakekubelet

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/util/wait"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/tessera-gpu/tessera/internal/podresources"
	"github.com/tessera-gpu/tessera/internal/podresources/podresourcestest"
)

// Kubelet is one run of the fake kubelet; a restarted kubelet is a new Start on the same directory.
type Kubelet struct {
	dir    string // the device-plugin directory
	reg    *grpc.Server
	grants *podresourcestest.Server // what Allocate granted
	podres string                   // the PodResources socket, once served

	mu sync.Mutex
	// As kubelet 1.37's device manager: every connected endpoint of a resource by its socket
	// (endpointStore), the newest one the one Allocate goes to (endpoints; another connected one
	// is promoted when it disconnects), and one device list per resource, the last any endpoint
	// sent (genericDeviceUpdateCallback).
	endpoints map[string]*Endpoint
	store     map[string]map[string]*Endpoint
	devices   map[string][]*pluginapi.Device
	requests  []*pluginapi.RegisterRequest
	reject    int // refuse this many more Register calls
	refused   int
}

// Endpoint is the kubelet's connection to one registered plugin.
type Endpoint struct {
	k       *Kubelet
	req     *pluginapi.RegisterRequest
	options *pluginapi.DevicePluginOptions
	client  pluginapi.DevicePluginClient
	conn    *grpc.ClientConn
	cancel  context.CancelFunc

	mu     sync.Mutex
	lists  [][]*pluginapi.Device // every ListAndWatch response, in order
	closed bool                  // the stream ended
}

// Start starts a kubelet on the device-plugin directory dir (made if missing). Like the kubelet's
// device manager it first removes every socket in the directory, so plugins already there must
// notice and register again; then it serves Registration on dir/kubelet.sock. It stops when the
// test ends.
func Start(t testing.TB, dir string) *Kubelet {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatalf("kubelet: %v", err)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatalf("read %s: %v", dir, err)
	}
	for _, e := range entries {
		if e.Type()&os.ModeSocket != 0 {
			if err := os.Remove(filepath.Join(dir, e.Name())); err != nil {
				t.Fatalf("kubelet cleanup: %v", err)
			}
		}
	}
	lis, err := net.Listen("unix", filepath.Join(dir, "kubelet.sock"))
	if err != nil {
		t.Fatalf("kubelet listen: %v", err)
	}
	k := &Kubelet{dir: dir, reg: grpc.NewServer(), grants: podresourcestest.NewServer(), endpoints: make(map[string]*Endpoint),
		store: make(map[string]map[string]*Endpoint), devices: make(map[string][]*pluginapi.Device)}
	pluginapi.RegisterRegistrationServer(k.reg, &registrationService{k: k})
	go func() { _ = k.reg.Serve(lis) }()
	t.Cleanup(k.Stop)
	return k
}

// PluginDir is the device-plugin directory (kubelet.sock and the plugins' sockets).
func (k *Kubelet) PluginDir() string { return k.dir }

// ServePodResources serves the PodResources API on socket, listing what Allocate granted, until
// the test ends.
func (k *Kubelet) ServePodResources(t testing.TB, socket string) {
	t.Helper()
	srv, err := k.grants.Serve(socket)
	if err != nil {
		t.Fatal(err)
	}
	k.podres = socket
	t.Cleanup(srv.Stop)
}

// PodResourcesSocket is where ServePodResources serves ("" before it is called).
func (k *Kubelet) PodResourcesSocket() string { return k.podres }

// Stop shuts the kubelet down: kubelet.sock goes away (the listener unlinks it) and the streams
// end. Stopping twice is harmless.
func (k *Kubelet) Stop() {
	k.reg.Stop()
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, byPath := range k.store {
		for _, e := range byPath {
			e.cancel()
			e.conn.Close()
		}
	}
	clear(k.endpoints)
	clear(k.store)
}

type registrationService struct {
	pluginapi.UnimplementedRegistrationServer
	k *Kubelet
}

func (r *registrationService) Register(ctx context.Context, req *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	k := r.k
	k.mu.Lock()
	if k.reject > 0 {
		k.reject--
		k.refused++
		k.mu.Unlock()
		return nil, status.Error(codes.Unavailable, "fake kubelet: not ready")
	}
	// kubelet 1.37 (devicemanager PluginConnected) refuses a registration on a socket path whose
	// earlier endpoint is still connected.
	if k.store[req.GetResourceName()][req.GetEndpoint()] != nil {
		k.refused++
		k.mu.Unlock()
		return nil, fmt.Errorf("device plugin already connected: %s", filepath.Join(k.dir, req.GetEndpoint()))
	}
	k.mu.Unlock()
	if req.GetVersion() != pluginapi.Version {
		return nil, fmt.Errorf("unsupported version %q", req.GetVersion())
	}
	conn, err := grpc.NewClient("unix://"+filepath.Join(k.dir, req.GetEndpoint()),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("dial plugin: %w", err)
	}
	client := pluginapi.NewDevicePluginClient(conn)
	octx, cancelOpts := context.WithTimeout(ctx, 10*time.Second)
	defer cancelOpts()
	opts, err := client.GetDevicePluginOptions(octx, &pluginapi.Empty{}, grpc.WaitForReady(true))
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("plugin options: %w", err)
	}
	sctx, cancel := context.WithCancel(context.Background())
	stream, err := client.ListAndWatch(sctx, &pluginapi.Empty{})
	if err != nil {
		cancel()
		conn.Close()
		return nil, fmt.Errorf("ListAndWatch: %w", err)
	}
	e := &Endpoint{k: k, req: req, options: opts, client: client, conn: conn, cancel: cancel}
	go e.watch(stream)

	k.mu.Lock()
	defer k.mu.Unlock()
	// Endpoints connected before stay connected (their streams go on): the newest is the primary.
	res := req.GetResourceName()
	if k.store[res] == nil {
		k.store[res] = make(map[string]*Endpoint)
	}
	k.store[res][req.GetEndpoint()] = e
	k.endpoints[res] = e
	k.requests = append(k.requests, req)
	return &pluginapi.Empty{}, nil
}

// disconnected is PluginDisconnected: the endpoint leaves the store and, if others of its resource
// are connected, one of them becomes the primary; the last one stays the primary, stopped, and
// the resource's devices turn unhealthy.
func (k *Kubelet) disconnected(e *Endpoint) {
	k.mu.Lock()
	defer k.mu.Unlock()
	res := e.req.GetResourceName()
	byPath := k.store[res]
	if byPath[e.req.GetEndpoint()] != e {
		return
	}
	delete(byPath, e.req.GetEndpoint())
	for _, other := range byPath {
		k.endpoints[res] = other
		return
	}
	// The last one (markResourceUnhealthy): its devices stay listed, unhealthy.
	var devs []*pluginapi.Device
	for _, d := range k.devices[res] {
		devs = append(devs, &pluginapi.Device{ID: d.GetID(), Health: pluginapi.Unhealthy, Topology: d.GetTopology()})
	}
	k.devices[res] = devs
}

func (e *Endpoint) watch(stream grpc.ServerStreamingClient[pluginapi.ListAndWatchResponse]) {
	for {
		resp, err := stream.Recv()
		if err != nil {
			e.mu.Lock()
			e.closed = true
			e.mu.Unlock()
			e.k.disconnected(e)
			return
		}
		e.mu.Lock()
		e.lists = append(e.lists, resp.GetDevices())
		e.mu.Unlock()
		e.k.mu.Lock()
		e.k.devices[e.req.GetResourceName()] = resp.GetDevices()
		e.k.mu.Unlock()
	}
}

// Request is the plugin's RegisterRequest.
func (e *Endpoint) Request() *pluginapi.RegisterRequest { return e.req }

// Options is what the plugin answered to GetDevicePluginOptions at registration.
func (e *Endpoint) Options() *pluginapi.DevicePluginOptions { return e.options }

// Client calls the plugin over the kubelet's connection.
func (e *Endpoint) Client() pluginapi.DevicePluginClient { return e.client }

// Closed reports whether the plugin's ListAndWatch stream ended.
func (e *Endpoint) Closed() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.closed
}

// History is every device list the plugin sent, in order.
func (e *Endpoint) History() [][]*pluginapi.Device {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.lists)
}

// Latest is the plugin's last device list (nil before the first).
func (e *Endpoint) Latest() []*pluginapi.Device {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.lists) == 0 {
		return nil
	}
	return e.lists[len(e.lists)-1]
}

// RejectNext makes the kubelet refuse the next n registrations (Unavailable, as a kubelet still
// starting answers).
func (k *Kubelet) RejectNext(n int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.reject = n
}

// Rejected counts the registrations refused, by RejectNext or for a still-connected path.
func (k *Kubelet) Rejected() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.refused
}

// Endpoint is the primary endpoint of resource, the one Allocate goes to (nil if none): the newest
// registration, or after it disconnected another one still connected.
func (k *Kubelet) Endpoint(resource string) *Endpoint {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.endpoints[resource]
}

// Registrations counts the registrations of resource this kubelet accepted.
func (k *Kubelet) Registrations(resource string) int {
	k.mu.Lock()
	defer k.mu.Unlock()
	n := 0
	for _, r := range k.requests {
		if r.GetResourceName() == resource {
			n++
		}
	}
	return n
}

// Resources lists the registered resources that sent a device list, sorted.
func (k *Kubelet) Resources() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	var out []string
	for r, devs := range k.devices {
		if len(devs) > 0 && k.endpoints[r] != nil {
			out = append(out, r)
		}
	}
	slices.Sort(out)
	return out
}

// Healthy returns the healthy device IDs of a resource (nil if the resource is not registered).
func (k *Kubelet) Healthy(resource string) []string {
	k.mu.Lock()
	devs := k.devices[resource]
	k.mu.Unlock()
	var ids []string
	for _, d := range devs {
		if d.Health == pluginapi.Healthy {
			ids = append(ids, d.ID)
		}
	}
	return ids
}

// WaitServed waits (10 s at most) until resource is registered and its first device list
// arrived, and returns the endpoint.
func (k *Kubelet) WaitServed(t testing.TB, resource string) *Endpoint {
	t.Helper()
	var e *Endpoint
	poll(t, 10*time.Second, 10*time.Millisecond, func() bool {
		e = k.Endpoint(resource)
		return e != nil && len(e.History()) > 0
	}, func() string { return "kubelet to receive " + resource + "'s device list" })
	return e
}

// WaitHealthy waits (30 s at most) until a resource has exactly n healthy devices.
func (k *Kubelet) WaitHealthy(t testing.TB, resource string, n int) {
	t.Helper()
	poll(t, 30*time.Second, 50*time.Millisecond, func() bool { return len(k.Healthy(resource)) == n }, func() string {
		return fmt.Sprintf("%s: want %d healthy devices, have %d (%v)", resource, n, len(k.Healthy(resource)), k.Healthy(resource))
	})
}

// poll checks cond every interval until it holds, or fails the test with what() after timeout.
func poll(t testing.TB, timeout, interval time.Duration, cond func() bool, what func() string) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), interval, timeout, true, func(context.Context) (bool, error) { return cond(), nil })
	if err != nil {
		t.Fatalf("timed out after %v waiting for %s", timeout, what())
	}
}

// Allocate picks n free healthy devices of a resource for a container, calls the plugin's Allocate
// like the kubelet's device manager and records the grant for PodResources; it returns the CDI
// device names the plugin answered with.
func (k *Kubelet) Allocate(t testing.TB, ns, pod, container, resource string, n int) []string {
	t.Helper()
	inUse := k.grants.InUse(resource)
	e := k.Endpoint(resource)
	k.mu.Lock()
	devs := k.devices[resource]
	k.mu.Unlock()
	var ids []string
	if e != nil {
		for _, d := range devs {
			if d.Health == pluginapi.Healthy && !inUse[d.ID] && len(ids) < n {
				ids = append(ids, d.ID)
			}
		}
	}
	if e == nil || len(ids) < n {
		t.Fatalf("kubelet: %s has %d free healthy devices, %s/%s needs %d", resource, len(ids), ns, pod, n)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := e.client.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: ids}}})
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
func (k *Kubelet) Forget(ns, pod string) { k.grants.Forget(ns, pod) }
