package gpu

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// smCounts is the SM count of a whole GPU by PCI device ID (the upper 16 bits of NVML's
// pciDeviceId; NVIDIA's vendor ID 0x10de is the lower half). NVML has no query for it on a full
// GPU: nvmlDeviceGetAttributes is documented for MIG device handles only (nvml.h: "This API
// currently only supports MIG device handles"), and the MIG profiles give the SMs of the largest
// instance, which is less than the GPU's (A100: 98 of 108). The device ID names the exact product
// (H100 SXM5 and H100 PCIe share compute capability 9.0 but have 132 and 114 SMs), so it is the key
// rather than the architecture or the marketing name. Numbers from NVIDIA's product data sheets.
var smCounts = map[uint32]int{
	0x1db1: 80,  // V100-SXM2-16GB
	0x1db4: 80,  // V100-PCIE-16GB
	0x1db5: 80,  // V100-SXM2-32GB
	0x1db6: 80,  // V100-PCIE-32GB
	0x1eb8: 40,  // T4
	0x20b0: 108, // A100-SXM4-40GB
	0x20b2: 108, // A100-SXM4-80GB
	0x20b5: 108, // A100-PCIE-80GB
	0x20f1: 108, // A100-PCIE-40GB
	0x20b7: 56,  // A30
	0x2236: 72,  // A10
	0x26b5: 142, // L40
	0x26b9: 142, // L40S
	0x27b8: 58,  // L4
	0x2321: 132, // H100 NVL
	0x2330: 132, // H100 SXM5 80GB
	0x2331: 114, // H100 PCIe
	0x2335: 132, // H200 SXM 141GB
	0x2342: 132, // GH200
	0x2901: 148, // B200
}

// smCount returns the SM count of a whole GPU: from the device ID table, or from
// nvmlDeviceGetAttributes where a driver answers it on a full GPU although the header does not
// promise it. Anything else is an error naming the product, never a guess: vgpu-cores and MIG
// checks are percentages of this number.
func smCount(d nvml.Device, name string) (int, error) {
	pci, ret := d.GetPciInfo()
	if ret != nvml.SUCCESS {
		return 0, nvmlErr("get PCI info (for the SM count)", ret)
	}
	id := pci.PciDeviceId >> 16
	if n, ok := smCounts[id]; ok {
		return n, nil
	}
	if attrs, ret := d.GetAttributes(); ret == nvml.SUCCESS && attrs.MultiprocessorCount > 0 {
		return int(attrs.MultiprocessorCount), nil
	}
	return 0, fmt.Errorf("SM count of %s (PCI device 0x%04x) unknown: NVML reports SM counts for MIG instances only and this model is not in Tessera's table (internal/gpu/smcount.go); please report the model", name, id)
}
