// Package podresources reads the kubelet's PodResources API: the one trustworthy record of which
// devices the kubelet granted to which container (a pod's annotations are user-writable; this is not).
package podresources

import (
	"context"
	"fmt"
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
