// Package deviceplugin serves the kubelet device plugin API (v1beta1) for each Tessera resource. The
// gRPC servers only translate kubelet calls: what devices exist, their health, what Allocate returns
// and which devices are preferred all come from a Source (the node agent's inventory and ledger).
package deviceplugin

import (
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// Source is the device logic behind the servers.
type Source interface {
	// Resources lists the resource names to serve now, e.g. nvidia.com/gpu, tessera.dev/vgpu,
	// nvidia.com/mig-1g.5gb, tessera.dev/mdev-A100-4C.
	Resources() []string
	// Devices returns the devices of a resource with their health. A device that exists but cannot
	// be given now (a GPU held in another mode, an XID error) is reported Unhealthy, so the kubelet
	// keeps its capacity but not its allocatable count.
	Devices(resource string) []*pluginapi.Device
	// Changed is signalled (non-blocking, coalesced) whenever Resources or any Devices may differ.
	Changed() <-chan struct{}
	// Allocate returns what the kubelet passes to the runtime for these device IDs: CDI device names
	// only (never NVIDIA_VISIBLE_DEVICES). For mdev resources it creates the mdev devices.
	Allocate(resource string, deviceIDs []string) (*pluginapi.ContainerAllocateResponse, error)
	// Preferred picks size devices out of available (including mustInclude), topology-close first.
	Preferred(resource string, available, mustInclude []string, size int) ([]string, error)
}
