package deviceplugin

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/tessera-gpu/tessera/internal/testing/fakekubelet"
)

const (
	gpuRes  = "nvidia.com/gpu"
	vgpuRes = "tessera.dev/vgpu"
	migRes  = "nvidia.com/mig-1g.10gb"
)

// runManager starts a Manager on dir. The returned stop cancels Run and returns its result once
// it has returned; it also runs (and checks for a nil result) when the test ends.
// testTag is the socket tag of the managers runManager starts.
const testTag = "t1"

func runManager(t *testing.T, src Source, dir string, configure ...func(*Manager)) (*Manager, func() error) {
	t.Helper()
	log := slog.New(slog.NewTextHandler(newTestWriter(t), &slog.HandlerOptions{Level: slog.LevelDebug}))
	m := NewManager(src, Options{PluginDir: dir, Logger: log, SocketTag: testTag})
	for _, c := range configure {
		c(m)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- m.Run(ctx) }()
	stop := sync.OnceValue(func() error {
		cancel()
		select {
		case err := <-errc:
			return err
		case <-time.After(waitTimeout):
			return fmt.Errorf("Run did not return within %v of cancellation", waitTimeout)
		}
	})
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return m, stop
}

func deviceHealth(devs []*pluginapi.Device) map[string]string {
	out := make(map[string]string)
	for _, d := range devs {
		out[d.GetID()] = d.GetHealth()
	}
	return out
}

func waitRegistered(t *testing.T, m *Manager, resources ...string) {
	t.Helper()
	waitFor(t, "Registered() to report "+strings.Join(resources, ", "), func() bool {
		reg := m.Registered()
		for _, r := range resources {
			if !reg[r] {
				return false
			}
		}
		return len(reg) == len(resources)
	})
}

func TestRegistersEveryResource(t *testing.T) {
	dir := shortTempDir(t)
	k := fakekubelet.Start(t, dir)
	src := newFakeSource()
	src.setResource(gpuRes, healthyDevices("gpu-0", "gpu-1"))
	src.setResource(vgpuRes, healthyDevices("vgpu-0", "vgpu-1", "vgpu-2"))
	src.setResource(migRes, healthyDevices("mig-a"))
	m, _ := runManager(t, src, dir)

	tests := []struct {
		resource  string
		socket    string
		preferred bool
		devices   int
	}{
		{gpuRes, "tessera-nvidia.com_gpu-t1.sock", false, 2},
		{vgpuRes, "tessera-tessera.dev_vgpu-t1.sock", false, 3},
		{migRes, "tessera-nvidia.com_mig-1g.10gb-t1.sock", true, 1},
	}
	for _, tc := range tests {
		t.Run(tc.resource, func(t *testing.T) {
			e := k.WaitServed(t, tc.resource)
			if e.Request().GetEndpoint() != tc.socket {
				t.Errorf("endpoint = %q, want %q", e.Request().GetEndpoint(), tc.socket)
			}
			if e.Request().GetVersion() != pluginapi.Version {
				t.Errorf("version = %q", e.Request().GetVersion())
			}
			if got := e.Request().GetOptions().GetGetPreferredAllocationAvailable(); got != tc.preferred {
				t.Errorf("registered GetPreferredAllocationAvailable = %v, want %v", got, tc.preferred)
			}
			if got := e.Options().GetGetPreferredAllocationAvailable(); got != tc.preferred {
				t.Errorf("GetDevicePluginOptions GetPreferredAllocationAvailable = %v, want %v", got, tc.preferred)
			}
			if e.Options().GetPreStartRequired() {
				t.Error("PreStartRequired is set")
			}
			if n := len(e.Latest()); n != tc.devices {
				t.Errorf("got %d devices, want %d", n, tc.devices)
			}
			if _, err := os.Stat(filepath.Join(dir, tc.socket)); err != nil {
				t.Errorf("socket: %v", err)
			}
			if _, err := e.Client().PreStartContainer(context.Background(), &pluginapi.PreStartContainerRequest{}); err != nil {
				t.Errorf("PreStartContainer: %v", err)
			}
		})
	}
	waitRegistered(t, m, gpuRes, vgpuRes, migRes)
}

func TestListAndWatchSendsHealthChanges(t *testing.T) {
	dir := shortTempDir(t)
	k := fakekubelet.Start(t, dir)
	src := newFakeSource()
	src.setResource(gpuRes, healthyDevices("gpu-1", "gpu-0"))
	runManager(t, src, dir)

	e := k.WaitServed(t, gpuRes)
	first := e.History()[0]
	if got, want := deviceHealth(first), map[string]string{"gpu-0": pluginapi.Healthy, "gpu-1": pluginapi.Healthy}; !maps.Equal(got, want) {
		t.Fatalf("initial list %v, want %v", got, want)
	}

	src.setHealth(gpuRes, "gpu-1", pluginapi.Unhealthy)
	waitFor(t, "gpu-1 to be reported Unhealthy", func() bool {
		return deviceHealth(e.Latest())["gpu-1"] == pluginapi.Unhealthy
	})
	if got := deviceHealth(e.Latest())["gpu-0"]; got != pluginapi.Healthy {
		t.Errorf("gpu-0 became %s", got)
	}

	// A change signal that changes nothing for this resource must not resend the list: wait until
	// the manager has reread the devices, then make a real change and count what arrived.
	before := src.calls()
	src.signal()
	waitFor(t, "the manager to reread devices", func() bool { return src.calls() > before })
	src.setHealth(gpuRes, "gpu-1", pluginapi.Healthy)
	waitFor(t, "gpu-1 to be reported Healthy again", func() bool {
		return deviceHealth(e.Latest())["gpu-1"] == pluginapi.Healthy
	})
	if n := len(e.History()); n != 3 {
		t.Errorf("kubelet received %d lists, want 3 (initial, unhealthy, healthy)", n)
	}
}

func TestAllocate(t *testing.T) {
	dir := shortTempDir(t)
	k := fakekubelet.Start(t, dir)
	src := newFakeSource()
	src.setResource(gpuRes, healthyDevices("gpu-0", "gpu-1", "gpu-2"))
	var observed struct {
		sync.Mutex
		calls []error
	}
	runManager(t, src, dir, func(m *Manager) {
		m.opts.ObserveAllocate = func(resource string, took time.Duration, err error) {
			observed.Lock()
			defer observed.Unlock()
			if resource != gpuRes || took <= 0 {
				t.Errorf("ObserveAllocate(%q, %v)", resource, took)
			}
			observed.calls = append(observed.calls, err)
		}
	})
	e := k.WaitServed(t, gpuRes)

	tests := []struct {
		name       string
		containers [][]string
		allocErr   error
		wantCDI    [][]string
		wantCode   codes.Code
		wantInMsg  []string
	}{
		{
			name:       "one container",
			containers: [][]string{{"gpu-0", "gpu-2"}},
			wantCDI:    [][]string{{"nvidia.com/gpu=gpu-0", "nvidia.com/gpu=gpu-2"}},
		},
		{
			name:       "two containers",
			containers: [][]string{{"gpu-1"}, {"gpu-0"}},
			wantCDI:    [][]string{{"nvidia.com/gpu=gpu-1"}, {"nvidia.com/gpu=gpu-0"}},
		},
		{
			name:       "unknown ID",
			containers: [][]string{{"gpu-0", "gpu-9"}},
			wantCode:   codes.InvalidArgument,
			wantInMsg:  []string{gpuRes, "unknown device IDs [gpu-9]"},
		},
		{
			name:       "source fails",
			containers: [][]string{{"gpu-0"}},
			allocErr:   errors.New("ledger: gpu-0 is held by another mode"),
			wantCode:   codes.Internal,
			wantInMsg:  []string{gpuRes, "gpu-0", "ledger: gpu-0 is held by another mode"},
		},
		{
			name:       "source status kept",
			containers: [][]string{{"gpu-0"}},
			allocErr:   status.Error(codes.ResourceExhausted, "no mdev instance left"),
			wantCode:   codes.ResourceExhausted,
			wantInMsg:  []string{gpuRes, "no mdev instance left"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			src.set(func(f *fakeSource) { f.allocErr = tc.allocErr })
			req := &pluginapi.AllocateRequest{}
			for _, ids := range tc.containers {
				req.ContainerRequests = append(req.ContainerRequests, &pluginapi.ContainerAllocateRequest{DevicesIds: ids})
			}
			resp, err := e.Client().Allocate(context.Background(), req)
			// Every call is observed once, with its error (the agent's Allocate histogram).
			observed.Lock()
			calls := observed.calls
			observed.calls = nil
			observed.Unlock()
			if len(calls) != 1 || (calls[0] == nil) != (err == nil) {
				t.Errorf("ObserveAllocate calls %v for Allocate error %v", calls, err)
			}
			if tc.wantCode != codes.OK {
				st, _ := status.FromError(err)
				if st.Code() != tc.wantCode {
					t.Fatalf("error %v, want code %v", err, tc.wantCode)
				}
				for _, s := range tc.wantInMsg {
					if !strings.Contains(st.Message(), s) {
						t.Errorf("message %q lacks %q", st.Message(), s)
					}
				}
				return
			}
			if err != nil {
				t.Fatalf("Allocate: %v", err)
			}
			var got [][]string
			for _, cr := range resp.GetContainerResponses() {
				got = append(got, cdiNames(cr))
			}
			if !slices.EqualFunc(got, tc.wantCDI, slices.Equal) {
				t.Errorf("CDI devices %v, want %v", got, tc.wantCDI)
			}
		})
	}
}

func TestGetPreferredAllocation(t *testing.T) {
	dir := shortTempDir(t)
	k := fakekubelet.Start(t, dir)
	src := newFakeSource()
	src.setResource(migRes, healthyDevices("mig-a", "mig-b", "mig-c", "mig-d"))
	runManager(t, src, dir)
	e := k.WaitServed(t, migRes)
	if !e.Request().GetOptions().GetGetPreferredAllocationAvailable() {
		t.Fatal("MIG resource registered without GetPreferredAllocationAvailable")
	}

	resp, err := e.Client().GetPreferredAllocation(context.Background(), &pluginapi.PreferredAllocationRequest{
		ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{{
			AvailableDeviceIDs:   []string{"mig-b", "mig-c", "mig-d"},
			MustIncludeDeviceIDs: []string{"mig-d"},
			AllocationSize:       2,
		}},
	})
	if err != nil {
		t.Fatalf("GetPreferredAllocation: %v", err)
	}
	if got := resp.GetContainerResponses()[0].GetDeviceIDs(); !slices.Equal(got, []string{"mig-d", "mig-b"}) {
		t.Errorf("preferred %v, want [mig-d mig-b]", got)
	}
	var call prefCall
	src.set(func(f *fakeSource) { call = f.lastPref })
	want := prefCall{migRes, []string{"mig-b", "mig-c", "mig-d"}, []string{"mig-d"}, 2}
	if call.resource != want.resource || !slices.Equal(call.available, want.available) ||
		!slices.Equal(call.mustInclude, want.mustInclude) || call.size != want.size {
		t.Errorf("Source.Preferred got %+v, want %+v", call, want)
	}

	src.set(func(f *fakeSource) { f.preferredErr = errors.New("topology unknown") })
	_, err = e.Client().GetPreferredAllocation(context.Background(), &pluginapi.PreferredAllocationRequest{
		ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{{AvailableDeviceIDs: []string{"mig-a"}, AllocationSize: 1}},
	})
	if st, _ := status.FromError(err); st.Code() != codes.Internal || !strings.Contains(st.Message(), "topology unknown") {
		t.Errorf("error %v, want Internal with the Source's message", err)
	}
}

// servingOneGPU starts a fake kubelet and a manager with one healthy GPU (gpu-0) in its own
// plugin directory, and waits until the kubelet is served.
func servingOneGPU(t *testing.T) (dir string, k *fakekubelet.Kubelet, src *fakeSource, m *Manager) {
	t.Helper()
	dir = shortTempDir(t)
	k = fakekubelet.Start(t, dir)
	src = newFakeSource()
	src.setResource(gpuRes, healthyDevices("gpu-0"))
	m, _ = runManager(t, src, dir)
	k.WaitServed(t, gpuRes)
	return dir, k, src, m
}

func TestResourceAddedAndRemovedAtRuntime(t *testing.T) {
	dir, k, src, m := servingOneGPU(t)
	waitRegistered(t, m, gpuRes)

	// A MIG profile appears.
	src.setResource(migRes, healthyDevices("mig-a", "mig-b"))
	e := k.WaitServed(t, migRes)
	if n := len(e.Latest()); n != 2 {
		t.Errorf("got %d MIG devices, want 2", n)
	}
	resp, err := e.Client().Allocate(context.Background(), &pluginapi.AllocateRequest{
		ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{"mig-b"}}},
	})
	if err != nil {
		t.Fatalf("Allocate on the new resource: %v", err)
	}
	if got := cdiNames(resp.GetContainerResponses()[0]); !slices.Equal(got, []string{migRes + "=mig-b"}) {
		t.Errorf("CDI devices %v", got)
	}
	waitRegistered(t, m, gpuRes, migRes)

	// And goes again: its server stops and its socket is removed; the other resource is untouched.
	migSock := filepath.Join(dir, socketName(migRes, testTag))
	src.removeResource(migRes)
	waitRegistered(t, m, gpuRes)
	waitFor(t, "the MIG socket to be removed", func() bool {
		_, err := os.Stat(migSock)
		return errors.Is(err, os.ErrNotExist)
	})
	if k.Registrations(gpuRes) != 1 {
		t.Errorf("gpu registered %d times, want 1", k.Registrations(gpuRes))
	}
}

func TestReregistersAfterKubeletRestart(t *testing.T) {
	dir := shortTempDir(t)
	k1 := fakekubelet.Start(t, dir)
	src := newFakeSource()
	src.setResource(gpuRes, healthyDevices("gpu-0", "gpu-1"))
	src.setResource(migRes, healthyDevices("mig-a"))
	m, _ := runManager(t, src, dir)
	k1.WaitServed(t, gpuRes)
	k1.WaitServed(t, migRes)
	waitRegistered(t, m, gpuRes, migRes)

	// The kubelet restarts: kubelet.sock goes away, the new kubelet wipes the directory (our
	// sockets too) and creates a new kubelet.sock.
	k1.Stop()
	k2 := fakekubelet.Start(t, dir)

	for _, r := range []string{gpuRes, migRes} {
		e := k2.WaitServed(t, r)
		if n := len(e.Latest()); n == 0 {
			t.Errorf("%s: new kubelet got no devices", r)
		}
	}
	e := k2.Endpoint(gpuRes)
	resp, err := e.Client().Allocate(context.Background(), &pluginapi.AllocateRequest{
		ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{"gpu-1"}}},
	})
	if err != nil {
		t.Fatalf("Allocate through the new kubelet: %v", err)
	}
	if got := cdiNames(resp.GetContainerResponses()[0]); !slices.Equal(got, []string{gpuRes + "=gpu-1"}) {
		t.Errorf("CDI devices %v", got)
	}
	waitRegistered(t, m, gpuRes, migRes)

	// Health changes still reach the new kubelet.
	src.setHealth(gpuRes, "gpu-0", pluginapi.Unhealthy)
	waitFor(t, "the new kubelet to see gpu-0 Unhealthy", func() bool {
		return deviceHealth(k2.Endpoint(gpuRes).Latest())["gpu-0"] == pluginapi.Unhealthy
	})
}

func TestRecreatesDeletedSocket(t *testing.T) {
	dir, k, _, _ := servingOneGPU(t)

	if err := os.Remove(filepath.Join(dir, socketName(gpuRes, testTag))); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a second registration", func() bool { return k.Registrations(gpuRes) >= 2 })
	e := k.WaitServed(t, gpuRes)
	if _, err := e.Client().Allocate(context.Background(), &pluginapi.AllocateRequest{
		ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{"gpu-0"}}},
	}); err != nil {
		t.Fatalf("Allocate on the recreated socket: %v", err)
	}
}

func TestRegistersWhenKubeletStartsLater(t *testing.T) {
	dir := shortTempDir(t)
	src := newFakeSource()
	src.setResource(gpuRes, healthyDevices("gpu-0"))
	m, _ := runManager(t, src, dir)
	waitFor(t, "the plugin socket", func() bool {
		_, err := os.Stat(filepath.Join(dir, socketName(gpuRes, testTag)))
		return err == nil
	})
	if m.Registered()[gpuRes] {
		t.Fatal("registered without a kubelet")
	}

	k := fakekubelet.Start(t, dir)
	k.WaitServed(t, gpuRes)
	waitRegistered(t, m, gpuRes)
}

func TestRetriesRejectedRegistration(t *testing.T) {
	dir := shortTempDir(t)
	k := fakekubelet.Start(t, dir)
	k.RejectNext(2)
	src := newFakeSource()
	src.setResource(gpuRes, healthyDevices("gpu-0"))
	m, _ := runManager(t, src, dir)

	k.WaitServed(t, gpuRes)
	waitRegistered(t, m, gpuRes)
	if n := k.Rejected(); n != 2 {
		t.Errorf("kubelet rejected %d registrations, want 2", n)
	}
}

// TestPollingAlone covers a node where inotify is unavailable: the poll must notice both a
// kubelet restart and a deleted socket.
func TestPollingAlone(t *testing.T) {
	dir := shortTempDir(t)
	k1 := fakekubelet.Start(t, dir)
	src := newFakeSource()
	src.setResource(gpuRes, healthyDevices("gpu-0"))
	m, _ := runManager(t, src, dir, func(m *Manager) {
		m.opts.PollInterval = 50 * time.Millisecond
		m.watch = func(context.Context, string, *slog.Logger) (<-chan struct{}, error) {
			return nil, errors.New("inotify unavailable")
		}
	})
	k1.WaitServed(t, gpuRes)

	k1.Stop()
	k2 := fakekubelet.Start(t, dir)
	k2.WaitServed(t, gpuRes)
	waitRegistered(t, m, gpuRes)

	if err := os.Remove(filepath.Join(dir, socketName(gpuRes, testTag))); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a registration after the socket was deleted", func() bool { return k2.Registrations(gpuRes) >= 2 })
	e := k2.WaitServed(t, gpuRes)
	if _, err := e.Client().Allocate(context.Background(), &pluginapi.AllocateRequest{
		ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{"gpu-0"}}},
	}); err != nil {
		t.Fatalf("Allocate on the recreated socket: %v", err)
	}
}

func TestShutdownRemovesSockets(t *testing.T) {
	dir := shortTempDir(t)
	k := fakekubelet.Start(t, dir)
	src := newFakeSource()
	src.setResource(gpuRes, healthyDevices("gpu-0"))
	src.setResource(vgpuRes, healthyDevices("vgpu-0"))
	_, stop := runManager(t, src, dir)
	e := k.WaitServed(t, gpuRes)
	k.WaitServed(t, vgpuRes)

	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}

	entries, _ := os.ReadDir(dir)
	var left []string
	for _, de := range entries {
		left = append(left, de.Name())
	}
	if !slices.Equal(left, []string{"kubelet.sock"}) {
		t.Errorf("directory holds %v after shutdown, want only kubelet.sock", left)
	}
	waitFor(t, "the kubelet's ListAndWatch stream to end", e.Closed)
}

func TestSocketName(t *testing.T) {
	tests := map[string]string{
		"nvidia.com/gpu":           "tessera-nvidia.com_gpu.sock",
		"tessera.dev/vgpu":         "tessera-tessera.dev_vgpu.sock",
		"nvidia.com/mig-1g.10gb":   "tessera-nvidia.com_mig-1g.10gb.sock",
		"tessera.dev/mdev-A100-4C": "tessera-tessera.dev_mdev-A100-4C.sock",
	}
	for in, want := range tests {
		if got := socketName(in, ""); got != want {
			t.Errorf("socketName(%q) = %q, want %q", in, got, want)
		}
		if got, want := socketName(in, "x1"), strings.TrimSuffix(want, ".sock")+"-x1.sock"; got != want {
			t.Errorf("socketName(%q, x1) = %q, want %q", in, got, want)
		}
	}
	if a, b := NewManager(nil, Options{}).opts.SocketTag, NewManager(nil, Options{}).opts.SocketTag; a == "" || a == b || strings.Contains(a, "-") {
		t.Errorf("default socket tags %q, %q: want a fresh one per manager, without '-'", a, b)
	}
}

func TestBackoff(t *testing.T) {
	b := registrationBackoff()
	tests := []time.Duration{ // nominal waits; each may be off by ±20% jitter
		500 * time.Millisecond, time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second,
		16 * time.Second, 30 * time.Second, 30 * time.Second, 30 * time.Second,
	}
	for i, nominal := range tests {
		if d := b.Step(); d < nominal*8/10 || d > nominal*12/10 {
			t.Errorf("attempt %d: wait %v, want %v ±20%%", i, d, nominal)
		}
	}
	for range 100 { // the shift must not overflow after many failures
		if d := b.Step(); d < backoffMax*8/10 || d > backoffMax*12/10 {
			t.Fatalf("after many attempts: wait %v, want %v ±20%%", d, backoffMax)
		}
	}
	b = registrationBackoff()
	if d := b.Step(); d < backoffInitial*8/10 || d > backoffInitial*12/10 {
		t.Errorf("after reset: wait %v, want %v ±20%%", d, backoffInitial)
	}
}

// TestStaleSocketsRemoved: a restarted agent serves on a socket of its own tag (never the path the
// kubelet may still hold for its predecessor) and removes the sockets of this resource that nobody
// serves any more (a killed agent's, tagged or from before tags); a socket still served (an agent
// being replaced) stays, as does another resource's.
func TestStaleSocketsRemoved(t *testing.T) {
	dir := shortTempDir(t)
	k := fakekubelet.Start(t, dir)
	dead := func(name string) string { // a socket file nobody listens on, as kill -9 leaves it
		path := filepath.Join(dir, name)
		l, err := net.Listen("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		l.(*net.UnixListener).SetUnlinkOnClose(false)
		l.Close()
		return path
	}
	staleTagged, staleOld := dead(socketName(gpuRes, "old")), dead(socketName(gpuRes, ""))
	otherStale := dead(socketName(vgpuRes, "old"))
	live := filepath.Join(dir, socketName(gpuRes, "live"))
	l, err := net.Listen("unix", live)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	src := newFakeSource()
	src.setResource(gpuRes, healthyDevices("gpu-0"))
	runManager(t, src, dir)
	if e := k.WaitServed(t, gpuRes); e.Request().GetEndpoint() != socketName(gpuRes, testTag) {
		t.Fatalf("endpoint %q, want %q", e.Request().GetEndpoint(), socketName(gpuRes, testTag))
	}
	for path, want := range map[string]bool{staleTagged: false, staleOld: false, live: true, otherStale: true,
		filepath.Join(dir, socketName(gpuRes, testTag)): true} {
		if _, err := os.Stat(path); (err == nil) != want {
			t.Errorf("%s: exists %v, want %v", filepath.Base(path), err == nil, want)
		}
	}
}

// TestFakeKubeletRefusesConnectedPath: the fake kubelet is as unkind as kubelet 1.37 (devicemanager
// PluginConnected): a registration on a socket path whose endpoint is still connected is refused,
// which is why every agent start serves on a socket of its own tag.
func TestFakeKubeletRefusesConnectedPath(t *testing.T) {
	dir, _, _, _ := servingOneGPU(t)
	err := register(context.Background(), filepath.Join(dir, "kubelet.sock"), socketName(gpuRes, testTag), gpuRes, &pluginapi.DevicePluginOptions{})
	if err == nil || !strings.Contains(err.Error(), "device plugin already connected") {
		t.Fatalf("registration on a connected path: %v, want kubelet 1.37's refusal", err)
	}
}

// TestTwoAgentsServeSideBySide: during a DaemonSet rolling update with maxSurge the new agent's
// device plugins start while the old agent's still serve. Each serves on a socket of its own tag
// and leaves the other's live socket alone; the kubelet (1.37: every endpoint of a resource kept,
// the newest the one Allocate goes to) sends Allocate to the new one; when the old agent stops,
// the new one is still registered and served, and its devices stay healthy.
func TestTwoAgentsServeSideBySide(t *testing.T) {
	dir := shortTempDir(t)
	k := fakekubelet.Start(t, dir)
	src := newFakeSource()
	src.setResource(gpuRes, healthyDevices("gpu-0", "gpu-1"))
	var oldAllocs, newAllocs atomic.Int64
	count := func(n *atomic.Int64) func(*Manager) {
		return func(m *Manager) {
			m.opts.ObserveAllocate = func(string, time.Duration, error) { n.Add(1) }
		}
	}
	oldM, stopOld := runManager(t, src, dir, func(m *Manager) { m.opts.SocketTag = "old" }, count(&oldAllocs))
	k.WaitServed(t, gpuRes)
	waitRegistered(t, oldM, gpuRes)
	oldSocket := filepath.Join(dir, socketName(gpuRes, "old"))
	oldID := statID(oldSocket)

	newM, _ := runManager(t, src, dir, func(m *Manager) { m.opts.SocketTag = "new" }, count(&newAllocs))
	waitRegistered(t, newM, gpuRes)
	waitFor(t, "the kubelet to send Allocate to the new agent", func() bool {
		e := k.Endpoint(gpuRes)
		return e != nil && e.Request().GetEndpoint() == socketName(gpuRes, "new")
	})
	if id := statID(oldSocket); id != oldID {
		t.Fatalf("the old agent's socket was removed or replaced when the new one started (%+v -> %+v)", oldID, id)
	}
	if !oldM.Registered()[gpuRes] {
		t.Error("the old agent lost its registration when the new one started")
	}
	if got := k.Registrations(gpuRes); got != 2 {
		t.Errorf("%d registrations of %s, want 2 (one per agent, none refused or repeated)", got, gpuRes)
	}
	k.Allocate(t, "ns", "p1", "main", gpuRes, 1)
	if oldAllocs.Load() != 0 || newAllocs.Load() != 1 {
		t.Errorf("Allocate answered by old %d, new %d times; want the new agent's endpoint", oldAllocs.Load(), newAllocs.Load())
	}

	// The old pod is deleted.
	if err := stopOld(); err != nil {
		t.Fatalf("old agent: %v", err)
	}
	if _, err := os.Stat(oldSocket); err == nil {
		t.Error("the old agent's socket stayed after it stopped")
	}
	waitFor(t, "the kubelet to drop the old agent's endpoint", func() bool { return k.Registrations(gpuRes) == 2 && len(k.Healthy(gpuRes)) == 2 })
	if e := k.Endpoint(gpuRes); e == nil || e.Closed() || e.Request().GetEndpoint() != socketName(gpuRes, "new") {
		t.Fatalf("after the old agent stopped the kubelet's endpoint is %v, want the new agent's, connected", e)
	}
	if _, err := os.Stat(filepath.Join(dir, socketName(gpuRes, "new"))); err != nil {
		t.Errorf("the new agent's socket: %v", err)
	}
	k.Allocate(t, "ns", "p2", "main", gpuRes, 1)
	if newAllocs.Load() != 2 || !newM.Registered()[gpuRes] {
		t.Errorf("after the old agent stopped: new agent answered %d Allocates, registered %v", newAllocs.Load(), newM.Registered())
	}
}
