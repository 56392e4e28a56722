package cdi

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"strconv"

	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/pkg/parser"
	specs "tags.cncf.io/container-device-interface/specs-go"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/gpu"
)

// Device classes Tessera publishes (the "class" in vendor/class=name).
const (
	ClassGPU   = "gpu"   // whole GPUs, by UUID and by index, plus "all"
	ClassMIG   = "mig"   // MIG instances, by MIG UUID
	ClassMdev  = "mdev"  // mdev vGPUs (VFIO), by mdev UUID, for VM runtimes
	ClassShare = "vgpu"  // the fractional token: control nodes + the vcuda library
	ShareName  = "share" // the one device of ClassShare
	AllName    = "all"
	// CommonName is the whole-GPU token's device: the control nodes only. The GPU itself is added
	// per container by the NRI plugin, which knows the pod and its assignment.
	CommonName = "common"
	// WholeTokenEnv is set by the common device: it marks a container granted whole-GPU tokens.
	WholeTokenEnv = "TESSERA_GPU_TOKEN"
)

// Generator builds the specs for one node.
type Generator struct {
	// Vendor is the vendor part of every name, e.g. "tessera.dev".
	Vendor string
	// VCUDALibrary is the host path of libvcuda.so mounted into share containers.
	VCUDALibrary string
	// Driver is where the NVIDIA driver is; every GPU spec carries its files.
	Driver *Driver
}

// Name returns the fully qualified CDI device name vendor/class=device.
func (g *Generator) Name(class, device string) string {
	return parser.QualifiedName(g.Vendor, class, device)
}

// Specs returns one spec per class that has devices on this node.
func (g *Generator) Specs(n *gpu.Node) ([]*specs.Spec, error) {
	if err := parser.ValidateVendorName(g.Vendor); err != nil {
		return nil, fmt.Errorf("CDI vendor %q: %w", g.Vendor, err)
	}
	if !filepath.IsAbs(g.VCUDALibrary) {
		return nil, fmt.Errorf("the vcuda library path must be absolute, got %q (set --vcuda-library)", g.VCUDALibrary)
	}
	var out []*specs.Spec
	add := func(class string, common specs.ContainerEdits, devices []specs.Device) error {
		if len(devices) == 0 {
			return nil
		}
		// Each spec gets its own copy: the edits are rewritten in place (numbers, host paths).
		own, err := copyEdits(common)
		if err != nil {
			return err
		}
		s := &specs.Spec{Kind: g.Vendor + "/" + class, ContainerEdits: own, Devices: devices}
		v, err := cdiapi.MinimumRequiredVersion(s)
		if err != nil {
			return fmt.Errorf("CDI spec %s: %w", s.Kind, err)
		}
		s.Version = v
		out = append(out, s)
		return nil
	}
	if g.Driver == nil {
		return nil, fmt.Errorf("no NVIDIA driver configured for the CDI specs: they would carry no libcuda")
	}
	driver := *g.Driver
	if driver.Root == "" {
		driver.Root = n.DriverRoot
	}
	if driver.DevRoot == "" {
		driver.DevRoot = n.DevRoot
	}
	control, err := g.controlEdits(n, &driver)
	if err != nil {
		return nil, err
	}
	if err := add(ClassGPU, control, wholeGPUDevices(n)); err != nil {
		return nil, err
	}
	if err := add(ClassMIG, control, migDevices(n)); err != nil {
		return nil, err
	}
	if err := add(ClassMdev, specs.ContainerEdits{}, mdevDevices(n)); err != nil {
		return nil, err
	}
	if shareable(n) {
		if err := add(ClassShare, control, []specs.Device{g.shareDevice()}); err != nil {
			return nil, err
		}
	}
	for _, s := range out {
		if err := fillSpecDeviceNumbers(s); err != nil {
			return nil, err
		}
		if err := driver.toHostPaths(s); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func copyEdits(e specs.ContainerEdits) (specs.ContainerEdits, error) {
	var out specs.ContainerEdits
	data, err := json.Marshal(e)
	if err == nil {
		err = json.Unmarshal(data, &out)
	}
	if err != nil {
		return out, fmt.Errorf("copy CDI edits: %w", err)
	}
	return out, nil
}

func fillSpecDeviceNumbers(s *specs.Spec) error {
	if err := fillDeviceNumbers(&s.ContainerEdits); err != nil {
		return fmt.Errorf("CDI spec %s: %w", s.Kind, err)
	}
	for i := range s.Devices {
		if err := fillDeviceNumbers(&s.Devices[i].ContainerEdits); err != nil {
			return fmt.Errorf("CDI device %s=%s: %w", s.Kind, s.Devices[i].Name, err)
		}
	}
	return nil
}

// controlEdits are what every GPU container needs: the driver's common edits from nvcdi (control
// device nodes, libraries, nvidia-smi, firmware, IPC sockets, hooks), NVIDIA_VISIBLE_DEVICES=void so
// a legacy nvidia-container-runtime hook adds no devices on its own, and on the simulated node the
// file its driver reads its GPUs from.
func (g *Generator) controlEdits(n *gpu.Node, driver *Driver) (specs.ContainerEdits, error) {
	edits, err := driver.CommonEdits()
	if err != nil {
		return specs.ContainerEdits{}, err
	}
	edits.Env = append(edits.Env, "NVIDIA_VISIBLE_DEVICES=void")
	edits.Mounts = append(edits.Mounts, simEdits(n)...)
	return edits, nil
}

func deviceNodes(nodes []gpu.DeviceNode) []*specs.DeviceNode {
	out := make([]*specs.DeviceNode, 0, len(nodes))
	for _, d := range nodes {
		out = append(out, &specs.DeviceNode{Path: d.Path, HostPath: d.HostPath, Permissions: "rw"})
	}
	return out
}

func shareable(n *gpu.Node) bool {
	for i := range n.GPUs {
		if n.GPUs[i].Shareable() {
			return true
		}
	}
	return false
}

// wholeGPUDevices names every GPU usable whole by UUID and by index, and all of them as "all".
// MIG-mode GPUs and mdev parents are left out: they are used only through their instances.
func wholeGPUDevices(n *gpu.Node) []specs.Device {
	var devs []specs.Device
	var all []*specs.DeviceNode
	for i := range n.GPUs {
		g := &n.GPUs[i]
		if !g.Shareable() {
			continue
		}
		node := deviceNodes([]gpu.DeviceNode{n.GPUNode(g)})
		edits := specs.ContainerEdits{DeviceNodes: node, Env: []string{"TESSERA_GPU_" + strconv.Itoa(g.Index) + "=" + g.UUID}}
		devs = append(devs,
			specs.Device{Name: g.UUID, ContainerEdits: edits},
			specs.Device{Name: strconv.Itoa(g.Index), ContainerEdits: edits})
		all = append(all, node...)
	}
	if len(all) > 0 {
		devs = append(devs,
			specs.Device{Name: AllName, ContainerEdits: specs.ContainerEdits{DeviceNodes: all}},
			specs.Device{Name: CommonName, ContainerEdits: specs.ContainerEdits{Env: []string{WholeTokenEnv + "=whole"}}})
	}
	return devs
}

func migDevices(n *gpu.Node) []specs.Device {
	var devs []specs.Device
	for i := range n.GPUs {
		g := &n.GPUs[i]
		if g.MIG == nil {
			continue
		}
		for j := range g.MIG.Instances {
			m := &g.MIG.Instances[j]
			devs = append(devs, specs.Device{Name: m.UUID, ContainerEdits: specs.ContainerEdits{
				DeviceNodes: deviceNodes(n.MIGNodes(g, m)),
				Env:         []string{"TESSERA_MIG_PROFILE=" + m.Profile},
			}})
		}
	}
	return devs
}

func mdevDevices(n *gpu.Node) []specs.Device {
	var devs []specs.Device
	for i := range n.Mdevs {
		m := &n.Mdevs[i]
		devs = append(devs, specs.Device{Name: m.UUID, ContainerEdits: specs.ContainerEdits{DeviceNodes: deviceNodes(n.VFIONodes(m))}})
	}
	return devs
}

// shareDevice is the fractional token: the assigned GPUs themselves are added per container by the
// NRI plugin, which alone knows the pod; the token carries the vcuda library so it is in place.
func (g *Generator) shareDevice() specs.Device {
	return specs.Device{Name: ShareName, ContainerEdits: specs.ContainerEdits{
		Mounts: []*specs.Mount{{
			HostPath:      g.VCUDALibrary,
			ContainerPath: api.VCUDALibraryInContainer,
			Options:       []string{"ro", "nosuid", "nodev", "bind"},
		}},
	}}
}

// DeviceNames lists every qualified device name in the specs.
func DeviceNames(all []*specs.Spec) []string {
	var names []string
	for _, s := range all {
		vendor, class := parser.ParseQualifier(s.Kind)
		for _, d := range s.Devices {
			names = append(names, parser.QualifiedName(vendor, class, d.Name))
		}
	}
	return names
}
