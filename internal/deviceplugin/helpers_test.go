package deviceplugin

import (
	"context"
	"errors"
	"fmt"
	"io"
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
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// fakeKubelet plays the kubelet's side of the device plugin API over the real v1beta1 gRPC
// services: on start it wipes the sockets in its directory and serves Registration on kubelet.sock;
// on Register it dials the plugin's socket back, asks for its options and keeps a ListAndWatch
// stream open, as the kubelet's device manager does, and refuses a registration on a socket path
// whose endpoint is still connected, as kubelet 1.37's does.
type fakeKubelet struct {
	t    *testing.T
	dir  string
	grpc *grpc.Server

	mu        sync.Mutex
	endpoints map[string]*endpoint // by resource: the latest registration wins, as in the kubelet
	requests  []*pluginapi.RegisterRequest
	reject    int // refuse this many more Register calls
	refused   int
}

// endpoint is the kubelet's connection to one registered plugin.
type endpoint struct {
	req     *pluginapi.RegisterRequest
	options *pluginapi.DevicePluginOptions
	client  pluginapi.DevicePluginClient
	conn    *grpc.ClientConn
	cancel  context.CancelFunc

	mu     sync.Mutex
	lists  [][]*pluginapi.Device // every ListAndWatch response, in order
	closed bool                  // the stream ended
}

func startFakeKubelet(t *testing.T, dir string) *fakeKubelet {
	t.Helper()
	// The kubelet's device manager removes every socket in the directory when it starts.
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
	k := &fakeKubelet{t: t, dir: dir, grpc: grpc.NewServer(), endpoints: make(map[string]*endpoint)}
	pluginapi.RegisterRegistrationServer(k.grpc, &registrationService{k: k})
	go func() { _ = k.grpc.Serve(lis) }()
	t.Cleanup(k.stop)
	return k
}

// stop shuts the kubelet down: kubelet.sock goes away (the listener unlinks it) and the streams end.
func (k *fakeKubelet) stop() {
	k.grpc.Stop()
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, e := range k.endpoints {
		e.cancel()
		e.conn.Close()
	}
	clear(k.endpoints)
}

type registrationService struct {
	pluginapi.UnimplementedRegistrationServer
	k *fakeKubelet
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
	if old := k.endpoints[req.GetResourceName()]; old != nil && old.req.GetEndpoint() == req.GetEndpoint() && !old.isClosed() {
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
	e := &endpoint{req: req, options: opts, client: client, conn: conn, cancel: cancel}
	go e.watch(stream)

	k.mu.Lock()
	defer k.mu.Unlock()
	if old := k.endpoints[req.GetResourceName()]; old != nil {
		old.cancel()
		old.conn.Close()
	}
	k.endpoints[req.GetResourceName()] = e
	k.requests = append(k.requests, req)
	return &pluginapi.Empty{}, nil
}

func (e *endpoint) watch(stream grpc.ServerStreamingClient[pluginapi.ListAndWatchResponse]) {
	for {
		resp, err := stream.Recv()
		if err != nil {
			e.mu.Lock()
			e.closed = true
			e.mu.Unlock()
			return
		}
		e.mu.Lock()
		e.lists = append(e.lists, resp.GetDevices())
		e.mu.Unlock()
	}
}

func (e *endpoint) isClosed() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.closed
}

func (e *endpoint) history() [][]*pluginapi.Device {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.lists)
}

func (e *endpoint) latest() []*pluginapi.Device {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.lists) == 0 {
		return nil
	}
	return e.lists[len(e.lists)-1]
}

// rejectNext makes the kubelet refuse the next n registrations.
func (k *fakeKubelet) rejectNext(n int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.reject = n
}

func (k *fakeKubelet) rejected() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.refused
}

func (k *fakeKubelet) endpoint(resource string) *endpoint {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.endpoints[resource]
}

func (k *fakeKubelet) registrations(resource string) int {
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

// waitServed waits until resource is registered and its first device list arrived, and returns
// the endpoint.
func (k *fakeKubelet) waitServed(resource string) *endpoint {
	k.t.Helper()
	var e *endpoint
	waitFor(k.t, "kubelet to receive "+resource+"'s device list", func() bool {
		e = k.endpoint(resource)
		return e != nil && len(e.history()) > 0
	})
	return e
}

// waitTimeout bounds every wait: generous, because a loaded 2-core machine is slow, and a passing
// test never waits that long.
const waitTimeout = 10 * time.Second

// waitFor polls cond until it holds or waitTimeout passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", waitTimeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// shortTempDir returns a fresh directory with a short path: a unix socket path must fit in 108
// bytes, which t.TempDir() under a long test name or $TMPDIR may exceed.
func shortTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("/tmp", "tdp-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// testWriter sends log lines to the test's log until the test ends; gRPC goroutines may still log
// during shutdown, and t.Log after the end panics.
type testWriter struct {
	mu   sync.Mutex
	t    *testing.T
	done bool
}

func newTestWriter(t *testing.T) io.Writer {
	w := &testWriter{t: t}
	t.Cleanup(func() { w.mu.Lock(); w.done = true; w.mu.Unlock() })
	return w
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.done {
		return 0, errors.New("test finished")
	}
	w.t.Log(string(p))
	return len(p), nil
}
