package v1

import "fmt"

// testInventory is a valid two-GPU inventory with a MIG GPU, an mdev type and a link.
func testInventory() *NodeInventory {
	return &NodeInventory{
		APIVersion:   Version,
		Node:         "node-a",
		SharesPerGPU: 10,
		GPUs: []GPU{
			{UUID: testUUID(0), Index: 0, Model: "NVIDIA A100-SXM4-40GB", MemoryBytes: 40 << 30, SMCount: 108, NUMANode: 0, PCIBusID: "0000:07:00.0", Minor: 0, Healthy: true,
				Mdev: []MdevType{{Name: "A100-4C", ID: "nvidia-500", Available: 10}}},
			{UUID: testUUID(1), Index: 1, Model: "NVIDIA A100-SXM4-40GB", MemoryBytes: 40 << 30, SMCount: 108, NUMANode: 0, PCIBusID: "0000:0f:00.0", Minor: 1, Healthy: true,
				MIG: &MIG{Instances: []MIGInstance{{UUID: "MIG-" + testUUID(9)[4:], Profile: "1g.5gb", GPUInstanceID: 7, MemoryBytes: 5 << 30, SMCount: 14, GICapMinor: 66, CICapMinor: 67}}}},
		},
		Links: []Link{{A: 0, B: 1, Kind: LinkNVLink, NVLinks: 12}},
	}
}

func testUUID(i int) string { return fmt.Sprintf("GPU-%08x-0000-4000-8000-%012x", i, i) }
