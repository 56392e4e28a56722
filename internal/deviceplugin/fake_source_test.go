package deviceplugin

import (
	"fmt"
	"slices"
	"sync"

	"google.golang.org/protobuf/proto"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// fakeSource is a Source whose resources, devices and health the tests change at will. Allocate
// answers with CDI names "<resource>=<id>", the form the node agent's CDI specs use.
type fakeSource struct {
	mu           sync.Mutex
	devices      map[string][]*pluginapi.Device // by resource; the key set is Resources()
	allocErr     error                          // returned by Allocate when set
	preferredErr error
	lastPref     prefCall
	devicesCalls int
	changed      chan struct{}
}

type prefCall struct {
	resource               string
	available, mustInclude []string
	size                   int
}

func newFakeSource() *fakeSource {
	return &fakeSource{devices: make(map[string][]*pluginapi.Device), changed: make(chan struct{}, 1)}
}

func healthyDevices(ids ...string) []*pluginapi.Device {
	var out []*pluginapi.Device
	for _, id := range ids {
		out = append(out, &pluginapi.Device{ID: id, Health: pluginapi.Healthy})
	}
	return out
}

func (f *fakeSource) signal() {
	select {
	case f.changed <- struct{}{}:
	default:
	}
}

// setResource adds or replaces a resource with its devices and signals the change.
func (f *fakeSource) setResource(resource string, devs []*pluginapi.Device) {
	f.mu.Lock()
	f.devices[resource] = devs
	f.mu.Unlock()
	f.signal()
}

func (f *fakeSource) removeResource(resource string) {
	f.mu.Lock()
	delete(f.devices, resource)
	f.mu.Unlock()
	f.signal()
}

// setHealth changes one device's health in place (as a real inventory would) and signals.
func (f *fakeSource) setHealth(resource, id, health string) {
	f.mu.Lock()
	for _, d := range f.devices[resource] {
		if d.ID == id {
			d.Health = health
		}
	}
	f.mu.Unlock()
	f.signal()
}

func (f *fakeSource) set(fn func(f *fakeSource)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

func (f *fakeSource) calls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.devicesCalls
}

func (f *fakeSource) Resources() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for r := range f.devices {
		out = append(out, r)
	}
	slices.Sort(out)
	return out
}

func (f *fakeSource) Devices(resource string) []*pluginapi.Device {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.devicesCalls++
	var out []*pluginapi.Device
	for _, d := range f.devices[resource] {
		out = append(out, proto.Clone(d).(*pluginapi.Device))
	}
	return out
}

func (f *fakeSource) Changed() <-chan struct{} { return f.changed }

func (f *fakeSource) Allocate(resource string, ids []string) (*pluginapi.ContainerAllocateResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.allocErr != nil {
		return nil, f.allocErr
	}
	resp := &pluginapi.ContainerAllocateResponse{}
	for _, id := range ids {
		if !slices.ContainsFunc(f.devices[resource], func(d *pluginapi.Device) bool { return d.ID == id }) {
			return nil, fmt.Errorf("no device %q", id)
		}
		resp.CdiDevices = append(resp.CdiDevices, &pluginapi.CDIDevice{Name: resource + "=" + id})
	}
	return resp, nil
}

// Preferred records its arguments and returns mustInclude topped up from available.
func (f *fakeSource) Preferred(resource string, available, mustInclude []string, size int) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lastPref = prefCall{resource, available, mustInclude, size}
	if f.preferredErr != nil {
		return nil, f.preferredErr
	}
	out := slices.Clone(mustInclude)
	for _, id := range available {
		if len(out) >= size {
			break
		}
		if !slices.Contains(out, id) {
			out = append(out, id)
		}
	}
	return out, nil
}

var _ Source = (*fakeSource)(nil)
