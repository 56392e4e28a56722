// Package podresources reads the kubelet's PodResources API: the one trustworthy record of which
// devices the kubelet granted to which container (a pod's annotations are user-writable; this is not).
package podresources

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	podresv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// DefaultSocket is where the kubelet serves the API.
const DefaultSocket = "/var/lib/kubelet/pod-resources/kubelet.sock"

// Grant is what the kubelet gave one container: device IDs per resource name.
type Grant map[string][]string

// Count returns how many devices of a resource were granted.
func (g Grant) Count(resource string) int { return len(g[resource]) }

// claimKeyPrefix marks the DRA ResourceClaims of a grant: "resourceclaim/<namespace>/<name>" ->
// the claim's devices as "<driver>/<pool>/<device>". A resource name has at most one slash, so no
// device-plugin resource looks like one.
const claimKeyPrefix = "resourceclaim/"

// ClaimKey is the grant key of the DRA ResourceClaim namespace/name.
func ClaimKey(namespace, name string) string { return claimKeyPrefix + namespace + "/" + name }

// ClaimRef names a ResourceClaim the kubelet prepared for a container.
type ClaimRef struct{ Namespace, Name string }

// Claims lists the DRA ResourceClaims the kubelet granted the container (PodResources' dynamic
// resources), sorted.
func (g Grant) Claims() []ClaimRef {
	var out []ClaimRef
	for k := range g {
		if rest, ok := strings.CutPrefix(k, claimKeyPrefix); ok {
			if ns, name, ok := strings.Cut(rest, "/"); ok {
				out = append(out, ClaimRef{ns, name})
			}
		}
	}
	slices.SortFunc(out, func(a, b ClaimRef) int { return strings.Compare(a.Namespace+"/"+a.Name, b.Namespace+"/"+b.Name) })
	return out
}

// IsClaimKey reports whether a grant key is a DRA claim's rather than a device-plugin resource's.
func IsClaimKey(k string) bool { return strings.HasPrefix(k, claimKeyPrefix) }

// Client lists pod resources over a unix socket; it reconnects when the kubelet restarts.
type Client struct {
	socket string
	mu     sync.Mutex
	conn   *grpc.ClientConn
}

// New returns a client for the kubelet's pod-resources socket (dialled lazily).
func New(socket string) *Client { return &Client{socket: socket} }

func (c *Client) client() (podresv1.PodResourcesListerClient, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn == nil {
		conn, err := grpc.NewClient("unix://"+c.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return nil, fmt.Errorf("connect to the kubelet's pod resources API at %s: %w", c.socket, err)
		}
		c.conn = conn
	}
	return podresv1.NewPodResourcesListerClient(c.conn), nil
}

// Container returns the grant of one container of a pod; an unknown pod or container has an empty grant.
func (c *Client) Container(ctx context.Context, namespace, pod, container string) (Grant, error) {
	all, err := c.List(ctx)
	if err != nil {
		return nil, err
	}
	return all[Key{namespace, pod, container}], nil
}

// Key names a container.
type Key struct{ Namespace, Pod, Container string }

// List returns every container's grant.
func (c *Client) List(ctx context.Context) (map[Key]Grant, error) {
	cl, err := c.client()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	resp, err := cl.List(ctx, &podresv1.ListPodResourcesRequest{})
	if err != nil {
		return nil, fmt.Errorf("list pod resources from the kubelet (%s): %w", c.socket, err)
	}
	out := map[Key]Grant{}
	for _, p := range resp.GetPodResources() {
		for _, ctr := range p.GetContainers() {
			g := Grant{}
			for _, d := range ctr.GetDevices() {
				g[d.GetResourceName()] = append(g[d.GetResourceName()], d.GetDeviceIds()...)
			}
			for _, dr := range ctr.GetDynamicResources() {
				k := ClaimKey(dr.GetClaimNamespace(), dr.GetClaimName())
				if _, ok := g[k]; !ok {
					g[k] = nil // a claim with no devices is still granted
				}
				for _, r := range dr.GetClaimResources() {
					g[k] = append(g[k], r.GetDriverName()+"/"+r.GetPoolName()+"/"+r.GetDeviceName())
				}
			}
			out[Key{p.GetNamespace(), p.GetName(), ctr.GetName()}] = g
		}
	}
	return out, nil
}

// Close releases the connection.
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn == nil {
		return nil
	}
	err := c.conn.Close()
	c.conn = nil
	return err
}
