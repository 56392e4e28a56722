// Package podresourcestest is a test double for the kubelet's side of the PodResources API: a server
// that lists what it is told was granted, for the unit tests that read grants and for the fake
// kubelet of the end-to-end suite (internal/testing/fakekubelet).
package podresourcestest

import (
	"context"
	"fmt"
	"net"
	"sort"
	"strings"
	"sync"

	"google.golang.org/grpc"
	podresv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/tessera-gpu/tessera/internal/podresources"
)

// Server serves the PodResources API from grants it is told about.
type Server struct {
	podresv1.UnimplementedPodResourcesListerServer
	mu     sync.Mutex
	grants map[podresources.Key]podresources.Grant
}

// NewServer returns an empty server.
func NewServer() *Server { return &Server{grants: map[podresources.Key]podresources.Grant{}} }

// Add records devices of a resource granted to a container; resource may be a
// podresources.ClaimKey, whose IDs are "<driver>/<pool>/<device>".
func (s *Server) Add(k podresources.Key, resource string, ids ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.grants[k] == nil {
		s.grants[k] = podresources.Grant{}
	}
	s.grants[k][resource] = append(s.grants[k][resource], ids...)
}

// InUse returns every device ID of a resource granted to any container.
func (s *Server) InUse(resource string) map[string]bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]bool{}
	for _, g := range s.grants {
		for _, id := range g[resource] {
			out[id] = true
		}
	}
	return out
}

// Forget drops every grant of a pod.
func (s *Server) Forget(namespace, pod string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for k := range s.grants {
		if k.Namespace == namespace && k.Pod == pod {
			delete(s.grants, k)
		}
	}
}

// Serve listens on a unix socket; stop the returned server to end.
func (s *Server) Serve(socket string) (*grpc.Server, error) {
	lis, err := net.Listen("unix", socket)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", socket, err)
	}
	g := grpc.NewServer()
	podresv1.RegisterPodResourcesListerServer(g, s)
	go g.Serve(lis)
	return g, nil
}

// List implements the API: device-plugin grants as Devices, claim grants as DynamicResources.
func (s *Server) List(context.Context, *podresv1.ListPodResourcesRequest) (*podresv1.ListPodResourcesResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	pods := map[[2]string]*podresv1.PodResources{}
	keys := make([]podresources.Key, 0, len(s.grants))
	for k := range s.grants {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return fmt.Sprint(keys[i]) < fmt.Sprint(keys[j]) })
	resp := &podresv1.ListPodResourcesResponse{}
	for _, k := range keys {
		pk := [2]string{k.Namespace, k.Pod}
		pr := pods[pk]
		if pr == nil {
			pr = &podresv1.PodResources{Namespace: k.Namespace, Name: k.Pod}
			pods[pk] = pr
			resp.PodResources = append(resp.PodResources, pr)
		}
		g := s.grants[k]
		c := &podresv1.ContainerResources{Name: k.Container}
		res := make([]string, 0, len(g))
		for r := range g {
			if !podresources.IsClaimKey(r) {
				res = append(res, r)
			}
		}
		sort.Strings(res)
		for _, r := range res {
			c.Devices = append(c.Devices, &podresv1.ContainerDevices{ResourceName: r, DeviceIds: g[r]})
		}
		for _, ref := range g.Claims() { // sorted, as the keys are
			c.DynamicResources = append(c.DynamicResources, dynamicResource(ref, g[podresources.ClaimKey(ref.Namespace, ref.Name)]))
		}
		pr.Containers = append(pr.Containers, c)
	}
	return resp, nil
}

// dynamicResource is a claim grant ("<driver>/<pool>/<device>" IDs) as the kubelet lists it.
func dynamicResource(ref podresources.ClaimRef, ids []string) *podresv1.DynamicResource {
	dr := &podresv1.DynamicResource{ClaimNamespace: ref.Namespace, ClaimName: ref.Name}
	for _, id := range ids {
		parts := strings.SplitN(id, "/", 3)
		for len(parts) < 3 {
			parts = append(parts, "")
		}
		dr.ClaimResources = append(dr.ClaimResources, &podresv1.ClaimResource{DriverName: parts[0], PoolName: parts[1], DeviceName: parts[2]})
	}
	return dr
}
