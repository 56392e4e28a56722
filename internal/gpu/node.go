package gpu

import (
	"fmt"
	"path/filepath"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// Node is what a backend discovered: the GPUs in the api's terms plus where their device nodes are.
type Node struct {
	DriverVersion string
	// CUDAVersion is api.NodeInventory.CUDAVersion.
	CUDAVersion string
	GPUs        []api.GPU
	// MIGCapable holds the UUIDs of the GPUs that support MIG (NVML answers their MIG mode), enabled
	// or not; the agent labels the Node with it. Not in the inventory: the extender needs only MIG
	// instances that exist.
	MIGCapable map[string]bool
	Links      []api.Link
	// Mdevs are the live mdev devices (vGPUs), whichever parent they are on.
	Mdevs []MdevDevice
	// DevRoot is the host root whose dev/ holds the device nodes ("/", or the simulated node's root).
	DevRoot string
	// DriverRoot is the host root the driver's libraries and binaries are installed under.
	DriverRoot string
	// ProcDevices is the kernel's list of device majors (/proc/devices, or the simulated node's).
	ProcDevices string
	// SimGPUFile is the simulated node only: the host path of the file that tells the simulated
	// driver inside containers which GPU each /dev/nvidiaN is (mounted at SimGPUFileInContainer).
	SimGPUFile string
	// SimDriverState is the simulated node only: the host path of the simulated driver's state
	// directory, where the driver inside containers records each process's device memory (mounted
	// read-write at SimDriverStateInContainer; writable by containers, so for simulation only).
	SimDriverState string
}

// SimGPUFileInContainer is where the simulated driver (vcuda/test's fake libcuda and NVML) reads
// its GPUs from inside a container.
const SimGPUFileInContainer = "/etc/tessera-sim/gpus"

// MdevDevice is one created mdev vGPU.
type MdevDevice struct {
	UUID       string
	Type       string // type name, e.g. "A100-4C"
	ParentBus  string // PCI address of the parent GPU
	IOMMUGroup int
}

// DeviceNode is a device node as a container sees it (Path) and where it is on the host (HostPath).
type DeviceNode struct {
	Path     string
	HostPath string
}

// node returns the DeviceNode for a /dev-relative name such as "nvidia0".
func (n *Node) node(name string) DeviceNode {
	return DeviceNode{Path: filepath.Join("/dev", name), HostPath: filepath.Join(n.DevRoot, "dev", name)}
}

// ControlNodes are the device nodes every GPU container needs besides its GPUs'.
func (n *Node) ControlNodes() []DeviceNode {
	return []DeviceNode{n.node("nvidiactl"), n.node("nvidia-uvm"), n.node("nvidia-uvm-tools")}
}

// GPUNode is the device node of a whole GPU.
func (n *Node) GPUNode(g *api.GPU) DeviceNode { return n.node(fmt.Sprintf("nvidia%d", g.Minor)) }

// MIGNodes are the device nodes of a MIG instance: its parent GPU and its GI and CI access caps.
func (n *Node) MIGNodes(parent *api.GPU, m *api.MIGInstance) []DeviceNode {
	return []DeviceNode{
		n.GPUNode(parent),
		n.node(fmt.Sprintf("nvidia-caps/nvidia-cap%d", m.GICapMinor)),
		n.node(fmt.Sprintf("nvidia-caps/nvidia-cap%d", m.CICapMinor)),
	}
}

// VFIONodes are the device nodes a VM runtime needs for an mdev device: its IOMMU group and the container.
func (n *Node) VFIONodes(m *MdevDevice) []DeviceNode {
	return []DeviceNode{n.node("vfio/vfio"), n.node(fmt.Sprintf("vfio/%d", m.IOMMUGroup))}
}

// Inventory turns the node into the document the agent publishes.
func (n *Node) Inventory(nodeName string, sharesPerGPU int) *api.NodeInventory {
	return &api.NodeInventory{
		APIVersion:    api.Version,
		Node:          nodeName,
		DriverVersion: n.DriverVersion,
		CUDAVersion:   n.CUDAVersion,
		SharesPerGPU:  sharesPerGPU,
		GPUs:          n.GPUs,
		Links:         n.Links,
	}
}

// GPUByUUID returns the GPU with this UUID, or nil.
func (n *Node) GPUByUUID(uuid string) *api.GPU {
	for i := range n.GPUs {
		if n.GPUs[i].UUID == uuid {
			return &n.GPUs[i]
		}
	}
	return nil
}

// MIGByUUID returns a MIG instance and its parent GPU, or nils.
func (n *Node) MIGByUUID(uuid string) (*api.GPU, *api.MIGInstance) {
	for i := range n.GPUs {
		if n.GPUs[i].MIG == nil {
			continue
		}
		for j := range n.GPUs[i].MIG.Instances {
			if n.GPUs[i].MIG.Instances[j].UUID == uuid {
				return &n.GPUs[i], &n.GPUs[i].MIG.Instances[j]
			}
		}
	}
	return nil, nil
}
