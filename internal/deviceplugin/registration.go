package deviceplugin

import (
	"context"
	"fmt"
	"math/rand/v2"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// registerTimeout bounds one Register call. The kubelet dials the plugin's socket back inside
// Register (up to its own 10 s), so this must not be shorter than that.
const registerTimeout = 15 * time.Second

// register announces one resource to the kubelet. endpoint is the socket's file name: the kubelet
// resolves it in its own device-plugin directory.
func register(ctx context.Context, kubeletSocket, endpoint, resource string, opts *pluginapi.DevicePluginOptions) error {
	conn, err := grpc.NewClient("unix://"+kubeletSocket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("connect to kubelet at %s: %w", kubeletSocket, err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, registerTimeout)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     endpoint,
		ResourceName: resource,
		Options:      opts,
	})
	if err != nil {
		return fmt.Errorf("register %s (endpoint %s) with kubelet at %s: %w", resource, endpoint, kubeletSocket, err)
	}
	return nil
}

// backoff spaces out retries of a failing registration (kubelet not up yet, or refusing us), so a
// node without a kubelet does not get a log line and a dial every few milliseconds.
type backoff struct {
	attempt int
}

const (
	backoffInitial = 500 * time.Millisecond
	backoffMax     = 30 * time.Second
)

// next returns the wait before the next attempt: exponential with ±20% jitter, capped.
func (b *backoff) next() time.Duration {
	d := backoffInitial << min(b.attempt, 10)
	b.attempt++
	d = min(d, backoffMax)
	jitter := time.Duration(rand.Int64N(int64(d)/5*2+1)) - d/5
	return d + jitter
}

func (b *backoff) reset() { b.attempt = 0 }
