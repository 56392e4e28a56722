package deviceplugin

import (
	"context"
	"fmt"
	"math"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/apimachinery/pkg/util/wait"
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

// registrationBackoff spaces out retries of a failing registration (kubelet not up yet, or refusing
// us), so a node without a kubelet does not get a log line and a dial every few milliseconds: 500 ms
// doubling up to 30 s, each wait ±20%. wait.Backoff's jitter only adds (up to Jitter times the
// base), so the base is 80% of the nominal wait and Jitter 0.5 reaches 120% of it.
func registrationBackoff() wait.Backoff {
	return wait.Backoff{Duration: backoffInitial * 8 / 10, Factor: 2, Jitter: 0.5, Cap: backoffMax * 8 / 10, Steps: math.MaxInt32}
}

const (
	backoffInitial = 500 * time.Millisecond
	backoffMax     = 30 * time.Second
)
