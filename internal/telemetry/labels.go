package telemetry

import (
	"strconv"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// Label names of the node agent's series. Per-GPU series carry dcgm-exporter's labels (gpu, UUID,
// device, modelName, hostname) so they join with its DCGM_FI_* series; per-container series add
// namespace, pod and container as dcgm-exporter's Kubernetes mapping does. hostname is
// dcgm-exporter's current spelling (Hostname before NVIDIA/dcgm-exporter#655); joins should use
// UUID, the one label every dcgm-exporter version spells the same and fills the same.
var (
	GPULabels       = []string{"gpu", "UUID", "device", "modelName", "hostname"}
	ContainerLabels = []string{"namespace", "pod", "container", "gpu", "UUID", "hostname"}
)

// GPULabelValues are GPULabels' values for g on node.
func GPULabelValues(g *api.GPU, node string) []string {
	return []string{strconv.Itoa(g.Index), g.UUID, "nvidia" + strconv.Itoa(g.Minor), g.Model, node}
}

// ContainerLabelValues are ContainerLabels' values for a container's series on g.
func ContainerLabelValues(namespace, pod, container string, g *api.GPU, node string) []string {
	return []string{namespace, pod, container, strconv.Itoa(g.Index), g.UUID, node}
}
