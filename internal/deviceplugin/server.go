package deviceplugin

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// server answers the kubelet's device plugin calls for one resource. It outlives the gRPC server
// that carries it: when the kubelet restarts, the socket and gRPC server are recreated, but the
// device snapshot (and so what a new ListAndWatch stream first sees) stays.
type server struct {
	pluginapi.UnimplementedDevicePluginServer

	resource  string
	src       Source
	preferred bool // advertise GetPreferredAllocation
	log       *slog.Logger
	observe   func(resource string, took time.Duration, err error) // may be nil

	mu      sync.Mutex
	devices []*pluginapi.Device // last list read from src: private copies, sorted by ID, never mutated
	changed chan struct{}       // closed (and replaced) when devices change, to wake every stream
}

func newServer(resource string, src Source, preferred bool, log *slog.Logger) *server {
	s := &server{resource: resource, src: src, preferred: preferred, log: log, changed: make(chan struct{})}
	s.refresh()
	return s
}

// refresh rereads the resource's devices from the Source and wakes the ListAndWatch streams when
// the list differs from the last one; an unchanged list wakes nobody, so the kubelet is not sent
// duplicates every time the Source signals a change elsewhere.
func (s *server) refresh() {
	devs := normalizeDevices(s.src.Devices(s.resource))
	s.mu.Lock()
	defer s.mu.Unlock()
	if devicesEqual(s.devices, devs) {
		return
	}
	s.devices = devs
	close(s.changed)
	s.changed = make(chan struct{})
}

// snapshot returns the current device list and the channel closed on its next change.
func (s *server) snapshot() ([]*pluginapi.Device, <-chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.devices, s.changed
}

func (s *server) options() *pluginapi.DevicePluginOptions {
	return &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: s.preferred}
}

// GetDevicePluginOptions returns the same options the plugin registered with.
func (s *server) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return s.options(), nil
}

// ListAndWatch sends the device list now and again on every change, until the kubelet closes the
// stream or the gRPC server stops (which cancels the stream's context).
func (s *server) ListAndWatch(_ *pluginapi.Empty, stream grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	// Reread rather than trust the snapshot: a Source change signal may have been coalesced away
	// while no stream was open.
	s.refresh()
	var sent []*pluginapi.Device
	first := true
	for {
		devs, changed := s.snapshot()
		if first || !devicesEqual(sent, devs) {
			if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: devs}); err != nil {
				return fmt.Errorf("send %s devices to the kubelet: %w", s.resource, err)
			}
			s.log.Debug("sent device list", "devices", len(devs), "healthy", countHealthy(devs))
			sent, first = devs, false
		}
		select {
		case <-changed:
		case <-stream.Context().Done():
			return nil
		}
	}
}

// Allocate asks the Source for each container's response (CDI device names). IDs the plugin never
// advertised are refused before the Source sees them: the kubelet only allocates advertised IDs, so
// an unknown one means the device list changed under it (a MIG instance went away).
func (s *server) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (resp *pluginapi.AllocateResponse, err error) {
	if s.observe != nil {
		defer func(start time.Time) { s.observe(s.resource, time.Since(start), err) }(time.Now())
	}
	known := make(map[string]bool)
	for _, d := range s.src.Devices(s.resource) {
		known[d.GetID()] = true
	}
	resp = &pluginapi.AllocateResponse{}
	for _, c := range req.GetContainerRequests() {
		ids := c.GetDevicesIds()
		if len(ids) == 0 {
			return nil, status.Errorf(codes.InvalidArgument, "%s: allocate: container request without device IDs", s.resource)
		}
		var unknown []string
		for _, id := range ids {
			if !known[id] {
				unknown = append(unknown, id)
			}
		}
		if len(unknown) > 0 {
			return nil, status.Errorf(codes.InvalidArgument, "%s: allocate %v: unknown device IDs %v", s.resource, ids, unknown)
		}
		cr, err := s.src.Allocate(s.resource, ids)
		if err != nil {
			s.log.Warn("allocate failed", "devices", ids, "err", err)
			return nil, grpcError(err, "%s: allocate %v", s.resource, ids)
		}
		if cr == nil {
			return nil, status.Errorf(codes.Internal, "%s: allocate %v: no response from the device source", s.resource, ids)
		}
		s.log.Info("allocated", "devices", ids, "cdi_devices", cdiNames(cr))
		resp.ContainerResponses = append(resp.ContainerResponses, cr)
	}
	return resp, nil
}

// GetPreferredAllocation passes each container's choice to the Source.
func (s *server) GetPreferredAllocation(_ context.Context, req *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	resp := &pluginapi.PreferredAllocationResponse{}
	for _, c := range req.GetContainerRequests() {
		ids, err := s.src.Preferred(s.resource, c.GetAvailableDeviceIDs(), c.GetMustIncludeDeviceIDs(), int(c.GetAllocationSize()))
		if err != nil {
			s.log.Warn("preferred allocation failed", "available", c.GetAvailableDeviceIDs(),
				"must_include", c.GetMustIncludeDeviceIDs(), "size", c.GetAllocationSize(), "err", err)
			return nil, grpcError(err, "%s: preferred allocation of %d", s.resource, c.GetAllocationSize())
		}
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerPreferredAllocationResponse{DeviceIDs: ids})
	}
	return resp, nil
}

// PreStartContainer is never called (PreStartRequired is false): devices need no preparation
// beyond what Allocate and the NRI plugin do.
func (s *server) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

// grpcError keeps a Source's own gRPC status code (it may know better, e.g. ResourceExhausted) and
// otherwise reports Internal; either way the message says which resource and call failed, because
// the kubelet shows it verbatim in the pod's admission error.
func grpcError(err error, format string, args ...any) error {
	msg := fmt.Sprintf(format, args...)
	var se interface{ GRPCStatus() *status.Status }
	if errors.As(err, &se) {
		st := se.GRPCStatus()
		return status.Errorf(st.Code(), "%s: %s", msg, st.Message())
	}
	return status.Errorf(codes.Internal, "%s: %v", msg, err)
}

// normalizeDevices copies the Source's devices (so later changes to its objects cannot race with
// sends) and sorts them by ID (so a Source that lists in map order does not look changed).
func normalizeDevices(in []*pluginapi.Device) []*pluginapi.Device {
	out := make([]*pluginapi.Device, 0, len(in))
	for _, d := range in {
		if d != nil {
			out = append(out, proto.Clone(d).(*pluginapi.Device))
		}
	}
	slices.SortFunc(out, func(a, b *pluginapi.Device) int { return strings.Compare(a.GetID(), b.GetID()) })
	return out
}

func devicesEqual(a, b []*pluginapi.Device) bool {
	return slices.EqualFunc(a, b, func(x, y *pluginapi.Device) bool { return proto.Equal(x, y) })
}

func countHealthy(devs []*pluginapi.Device) int {
	n := 0
	for _, d := range devs {
		if d.GetHealth() == pluginapi.Healthy {
			n++
		}
	}
	return n
}

func cdiNames(cr *pluginapi.ContainerAllocateResponse) []string {
	var names []string
	for _, d := range cr.GetCdiDevices() {
		names = append(names, d.GetName())
	}
	return names
}
