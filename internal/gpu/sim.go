package gpu

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	"github.com/NVIDIA/go-nvlib/pkg/nvlib/device"
	"github.com/NVIDIA/go-nvlib/pkg/nvmdev"
	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"k8s.io/apimachinery/pkg/util/validation/field"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// KindSimulatedNode is the kind of a node description file.
const KindSimulatedNode = "SimulatedNode"

// Description is a simulated node: which GPUs, which of them run MIG or host mdev vGPUs, and the
// topology. It is read from YAML (--node-description) or is DefaultDescription.
type Description struct {
	APIVersion    string `json:"apiVersion"`
	Kind          string `json:"kind"`
	DriverVersion string `json:"driverVersion,omitempty"`
	// CUDADriverVersion is what NVML reports as the driver's CUDA version (13000: CUDA 13.0, the
	// default with driver 580).
	CUDADriverVersion int `json:"cudaDriverVersion,omitempty"`
	// Seed makes UUIDs deterministic; two nodes of one simulated cluster need different seeds.
	Seed string `json:"seed,omitempty"`
	// Topology is "nvswitch" (every pair on NVLink, like a DGX) or "pcie" (pairs on a PCIe switch).
	Topology string `json:"topology,omitempty"`
	// GPUsPerNUMA groups consecutive GPUs into NUMA nodes.
	GPUsPerNUMA int      `json:"gpusPerNUMA,omitempty"`
	GPUs        []SimGPU `json:"gpus"`
}

// SimGPU is a group of identical simulated GPUs.
type SimGPU struct {
	// Model is one of the models in SimModels, e.g. "A100-SXM4-40GB".
	Model string `json:"model"`
	Count int    `json:"count"`
	// MIG, when set, turns MIG mode on and creates these instances (profiles) on each GPU.
	MIG []string `json:"mig,omitempty"`
	// Mdev makes these GPUs mdev parents (a vGPU host), usable only through mdev vGPUs.
	Mdev bool `json:"mdev,omitempty"`
}

// DefaultDescription is the built-in node: a DGX-A100-like 8 x A100-SXM4-40GB on NVSwitch, six GPUs
// for whole/shared use, one mdev parent for Kata vGPUs and one in MIG mode.
const DefaultDescription = `apiVersion: tessera.dev/v1
kind: SimulatedNode
driverVersion: 580.95.05
seed: tessera-sim
topology: nvswitch
gpusPerNUMA: 4
gpus:
- model: A100-SXM4-40GB
  count: 6
- model: A100-SXM4-40GB
  count: 1
  mdev: true
- model: A100-SXM4-40GB
  count: 1
  mig: [3g.20gb, 2g.10gb, 1g.5gb, 1g.5gb]
`

// H100Description is a DGX-H100-like 8 x H100 SXM5 80GB on NVSwitch (every pair on NVLink): six
// GPUs for whole/shared use and two in MIG mode holding between them every H100 profile kind,
// each GPU's instances fitting its 7 compute and 8 memory slices.
const H100Description = `apiVersion: tessera.dev/v1
kind: SimulatedNode
driverVersion: 580.95.05
seed: tessera-sim-h100
topology: nvswitch
gpusPerNUMA: 4
gpus:
- model: H100-SXM5-80GB
  count: 6
- model: H100-SXM5-80GB
  count: 1
  mig: [3g.40gb, 2g.20gb, 1g.10gb+me, 1g.10gb]
- model: H100-SXM5-80GB
  count: 1
  mig: [4g.40gb, 1g.20gb, 1g.10gb]
`

// BuiltinDescriptions are the node descriptions --node-description accepts by name instead of a file.
var BuiltinDescriptions = map[string]string{
	"dgx-a100": DefaultDescription,
	"dgx-h100": H100Description,
}

// ParseDescription strictly decodes and checks a node description.
func ParseDescription(data []byte) (*Description, error) {
	d := &Description{}
	if err := api.DecodeYAML(data, d, "simulated node description"); err != nil {
		return nil, err
	}
	var errs field.ErrorList
	if d.APIVersion != api.Version || d.Kind != KindSimulatedNode {
		errs = append(errs, field.Invalid(field.NewPath("apiVersion"), d.APIVersion+"/"+d.Kind,
			fmt.Sprintf("apiVersion/kind must be %s/%s", api.Version, KindSimulatedNode)))
	}
	if d.Seed == "" {
		d.Seed = "tessera-sim"
	}
	if d.DriverVersion == "" {
		d.DriverVersion = "580.95.05"
	}
	if d.CUDADriverVersion == 0 {
		d.CUDADriverVersion = 13000
	}
	switch d.Topology {
	case "":
		d.Topology = "nvswitch"
	case "nvswitch", "pcie":
	default:
		errs = append(errs, field.NotSupported(field.NewPath("topology"), d.Topology, []string{"nvswitch", "pcie"}))
	}
	if d.GPUsPerNUMA == 0 {
		d.GPUsPerNUMA = 4
	}
	total := 0
	for i, g := range d.GPUs {
		p := field.NewPath("gpus").Index(i)
		if _, ok := SimModels[g.Model]; !ok {
			errs = append(errs, field.NotSupported(p.Child("model"), g.Model, simModelNames()))
		}
		if g.Count < 1 || g.Count > 64 {
			errs = append(errs, field.Invalid(p.Child("count"), g.Count, "must be between 1 and 64"))
		}
		if g.Mdev && len(g.MIG) > 0 {
			errs = append(errs, field.Forbidden(p, "a GPU is either an mdev parent or in MIG mode, not both"))
		}
		for j, prof := range g.MIG {
			if !api.IsMIGProfile(prof) {
				errs = append(errs, field.Invalid(p.Child("mig").Index(j), prof, "not a MIG profile like 1g.5gb"))
			}
		}
		if m, ok := SimModels[g.Model]; ok && len(g.MIG) > 0 && !m.migCapable() {
			errs = append(errs, field.Forbidden(p.Child("mig"), g.Model+" has no MIG mode"))
		}
		total += min(max(g.Count, 0), 65) // bounded: no overflow however large the counts
	}
	if total < 1 || total > 64 {
		errs = append(errs, field.Invalid(field.NewPath("gpus"), total, "a node has 1 to 64 GPUs"))
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("invalid simulated node description: %w", errs.ToAggregate())
	}
	return d, nil
}

func simModelNames() []string {
	var names []string
	for n := range SimModels {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// simBackend is the simulated node: a go-nvml mock server shaped by a Description, discovered
// through the same code as real hardware.
type simBackend struct {
	desc       *Description
	srv        *server.Server
	devRoot    string
	driverRoot string
	simRoot    string
	stateDir   string
	mdev       *nvmdev.MockNvmdev
	events     simEvents
	// migs are the MIG device handles per parent GPU index; migSerial counts the instances each
	// GPU has had (their UUIDs).
	migMu     sync.Mutex
	migs      map[int][]nvml.Device
	migSerial map[int]int

	faultMu sync.Mutex
	faults  map[int]*simGPUState
	// procs is the simulated driver's per-process accounting (sim_procs.go).
	procs simProcs

	mu     sync.Mutex
	closed bool
}

// OpenSim builds the simulated node and its device nodes.
func OpenSim(opts Options) (Backend, error) {
	raw := []byte(DefaultDescription)
	if builtin, ok := BuiltinDescriptions[opts.NodeDescription]; ok {
		raw = []byte(builtin)
	} else if opts.NodeDescription != "" {
		var err error
		if raw, err = os.ReadFile(opts.NodeDescription); err != nil {
			return nil, fmt.Errorf("read simulated node description: %w", err)
		}
	}
	desc, err := ParseDescription(raw)
	if err != nil {
		return nil, err
	}
	stateDir := opts.StateDir
	if stateDir == "" {
		stateDir = "/var/run/tessera/sim"
	}
	root := filepath.Join(stateDir, "root")
	devRoot, driverRoot := opts.DevRoot, opts.DriverRoot
	if devRoot == "" {
		devRoot = root
	}
	if driverRoot == "" {
		driverRoot = root
	}
	if filepath.Clean(devRoot) == "/" {
		return nil, fmt.Errorf("the simulated node must not create device nodes in the real /dev: leave --dev-root empty or pick another root")
	}
	b := &simBackend{desc: desc, devRoot: devRoot, driverRoot: driverRoot, simRoot: root, stateDir: stateDir, migs: map[int][]nvml.Device{}, migSerial: map[int]int{},
		faults: map[int]*simGPUState{}, events: simEvents{sets: map[*simEventSet]bool{}, waitErrs: make(chan nvml.Return, 16)},
		procs: simProcs{dir: filepath.Join(root, SimDriverStateInContainer), procRoot: "/proc"}}
	if driverRoot == root {
		if err := writeSimDriverRoot(root, desc.DriverVersion, opts.SimDriverDir); err != nil {
			return nil, err
		}
	}
	if err := b.build(); err != nil {
		b.Close()
		return nil, err
	}
	return b, nil
}

func (b *simBackend) Name() string { return "sim" }

func (b *simBackend) NVML() nvml.Interface { return b.srv }

// build creates the mock server, MIG instances, mdev parents, the mig-minors table and device nodes.
func (b *simBackend) build() error {
	var configs []gpus.Config
	var groups []SimGPU
	for _, g := range b.desc.GPUs {
		for i := 0; i < g.Count; i++ {
			configs = append(configs, SimModels[g.Model].config)
			groups = append(groups, g)
		}
	}
	srv, err := server.New(server.WithGPUs(configs...), server.WithDriverVersion(b.desc.DriverVersion), server.WithCUDADriverVersion(b.desc.CUDADriverVersion))
	if err != nil {
		return fmt.Errorf("build simulated NVML server: %w", err)
	}
	b.srv = srv
	if err := os.MkdirAll(b.stateDir, 0o755); err != nil {
		return fmt.Errorf("create simulated node state dir: %w", err)
	}
	if err := makeSimDriverState(b.procs.dir); err != nil {
		return err
	}
	if err := writeMigMinors(b.migMinorsPath(), len(configs)); err != nil {
		return fmt.Errorf("write simulated mig-minors: %w", err)
	}
	devlib := device.New(srv)
	for i, h := range srv.Devices {
		d := h.(*server.Device)
		g := groups[i]
		b.shapeDevice(d, SimModels[g.Model].migCapable())
		if len(g.MIG) > 0 {
			if err := b.createMIG(devlib, d, g.MIG); err != nil {
				return fmt.Errorf("simulated GPU %d: %w", i, err)
			}
		}
		if g.Mdev {
			if err := b.addMdevParent(d); err != nil {
				return fmt.Errorf("simulated GPU %d mdev parent: %w", i, err)
			}
		}
	}
	b.shapeServer()
	return nil
}

func (b *simBackend) migMinorsPath() string { return filepath.Join(b.stateDir, "mig-minors") }

// uuid derives a stable UUID body from the description's seed.
func (b *simBackend) uuid(parts ...any) string {
	sum := sha256.Sum256([]byte(fmt.Sprint(append([]any{b.desc.Seed}, parts...)...)))
	h := hex.EncodeToString(sum[:16])
	return h[0:8] + "-" + h[8:12] + "-4" + h[13:16] + "-8" + h[17:20] + "-" + h[20:32]
}

// shapeDevice fills in what go-nvml's mock device leaves out: stable identity, PCI address, NUMA
// node, NVLink state; strictDevice makes it refuse what real NVML refuses.
func (b *simBackend) shapeDevice(d *server.Device, migCapable bool) {
	d.UUID = "GPU-" + b.uuid("gpu", d.Index)
	d.PciBusID = fmt.Sprintf("0000:%02x:00.0", 0x07+d.Index*8)
	d.MemoryInfo.Free = d.MemoryInfo.Total
	name := strings.TrimPrefix(d.Config.Name, "Mock ")
	numa := d.Index / b.desc.GPUsPerNUMA
	d.GetNameFunc = func() (string, nvml.Return) { return name, nvml.SUCCESS }
	d.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) {
		p := nvml.PciInfo{PciDeviceId: d.Config.PciDeviceId, Bus: uint32(0x07 + d.Index*8)}
		for i, c := range "0000" + d.PciBusID {
			p.BusId[i] = int8(c)
		}
		return p, nvml.SUCCESS
	}
	d.GetNumaNodeIdFunc = func() (int, nvml.Return) { return numa, nvml.SUCCESS }
	d.GetNvLinkStateFunc = func(link int) (nvml.EnableState, nvml.Return) {
		if b.desc.Topology == "nvswitch" && link < nvlinksOf(d.Config.Architecture) {
			return nvml.FEATURE_ENABLED, nvml.SUCCESS
		}
		return nvml.FEATURE_DISABLED, nvml.SUCCESS
	}
	b.strictDevice(d, migCapable)
}

// createMIG enables MIG mode and creates one GPU instance with a full compute instance per profile,
// the way mig-parted would: placements that fit together, created through the strict calls.
func (b *simBackend) createMIG(devlib device.Interface, d *server.Device, profiles []string) error {
	d.SetMigMode(nvml.DEVICE_MIG_ENABLE)
	infos := make([]nvml.GpuInstanceProfileInfo, len(profiles))
	cis := make([]int, len(profiles))
	for j, want := range profiles {
		var err error
		if infos[j], cis[j], err = findGIProfile(devlib, d, want); err != nil {
			return err
		}
	}
	placed, ok := fitPlacements(d, infos)
	if !ok {
		return fmt.Errorf("MIG profiles %s do not fit together on %s", strings.Join(profiles, ", "), d.Config.Name)
	}
	for j, want := range profiles {
		gih, ret := d.CreateGpuInstanceWithPlacement(&infos[j], &placed[j])
		if ret != nvml.SUCCESS {
			return nvmlErr("create GPU instance "+want, ret)
		}
		ciInfo, ret := gih.GetComputeInstanceProfileInfo(cis[j], nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if ret != nvml.SUCCESS {
			return nvmlErr("get compute instance profile of "+want, ret)
		}
		if _, ret := gih.CreateComputeInstance(&ciInfo); ret != nvml.SUCCESS {
			return nvmlErr("create compute instance "+want, ret)
		}
	}
	return nil
}

// findGIProfile finds the GPU instance profile whose name (as go-nvlib prints it) is want, and the
// compute instance profile that spans it.
func findGIProfile(devlib device.Interface, d *server.Device, want string) (nvml.GpuInstanceProfileInfo, int, error) {
	ciBySlices := map[uint32]int{1: nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, 2: nvml.COMPUTE_INSTANCE_PROFILE_2_SLICE,
		3: nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE, 4: nvml.COMPUTE_INSTANCE_PROFILE_4_SLICE, 6: nvml.COMPUTE_INSTANCE_PROFILE_6_SLICE,
		7: nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE, 8: nvml.COMPUTE_INSTANCE_PROFILE_8_SLICE}
	var known []string
	for i := 0; i < nvml.GPU_INSTANCE_PROFILE_COUNT; i++ {
		info, ret := d.GetGpuInstanceProfileInfo(i)
		if ret != nvml.SUCCESS {
			continue
		}
		ci, ok := ciBySlices[info.SliceCount]
		if !ok {
			continue
		}
		p, err := devlib.NewMigProfile(i, ci, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, info.MemorySizeMB, d.MemoryInfo.Total)
		if err != nil {
			continue
		}
		if p.String() == want {
			return info, ci, nil
		}
		known = append(known, p.String())
	}
	return nvml.GpuInstanceProfileInfo{}, 0, fmt.Errorf("MIG profile %q is not offered by %s (it offers %s)", want, d.Config.Name, strings.Join(known, ", "))
}

// addMdevParent registers the GPU as an mdev parent in go-nvlib's simulated sysfs tree.
func (b *simBackend) addMdevParent(d *server.Device) error {
	if b.mdev == nil {
		m, err := nvmdev.NewMock()
		if err != nil {
			return err
		}
		b.mdev = m
	}
	if err := b.mdev.AddMockA100Parent(d.PciBusID, d.Index/b.desc.GPUsPerNUMA); err != nil {
		return err
	}
	// The kernel provides a write-only "create" file per type; go-nvlib's mock tree lacks it.
	parents, err := b.mdev.GetAllParentDevices()
	if err != nil {
		return err
	}
	for _, p := range parents {
		dirs, _ := filepath.Glob(filepath.Join(p.Path, "mdev_supported_types", "nvidia-*"))
		for _, dir := range dirs {
			if err := os.WriteFile(filepath.Join(dir, "create"), nil, 0o200); err != nil {
				return err
			}
		}
	}
	return nil
}

// shapeServer adds topology and an event set the tests can feed.
func (b *simBackend) shapeServer() {
	b.srv.DeviceGetP2PStatusFunc = func(d1, d2 nvml.Device, idx nvml.GpuP2PCapsIndex) (nvml.GpuP2PStatus, nvml.Return) {
		if idx == nvml.P2P_CAPS_INDEX_NVLINK && b.desc.Topology == "nvswitch" {
			return nvml.P2P_STATUS_OK, nvml.SUCCESS
		}
		return nvml.P2P_STATUS_NOT_SUPPORTED, nvml.SUCCESS
	}
	b.srv.DeviceGetTopologyCommonAncestorFunc = func(d1, d2 nvml.Device) (nvml.GpuTopologyLevel, nvml.Return) {
		a, _ := d1.GetIndex()
		c, _ := d2.GetIndex()
		switch {
		case a/2 == c/2:
			return nvml.TOPOLOGY_SINGLE, nvml.SUCCESS
		case a/b.desc.GPUsPerNUMA == c/b.desc.GPUsPerNUMA:
			return nvml.TOPOLOGY_NODE, nvml.SUCCESS
		}
		return nvml.TOPOLOGY_SYSTEM, nvml.SUCCESS
	}
	b.srv.EventSetCreateFunc = b.newEventSet
	b.serveProcesses()
	// "The UUID of the target GPU or MIG instance"; NOT_FOUND "if uuid does not match a valid device".
	b.srv.DeviceGetHandleByUUIDFunc = func(uuid string) (nvml.Device, nvml.Return) {
		for _, d := range b.srv.Devices {
			if d.(*server.Device).UUID == uuid {
				return d, nvml.SUCCESS
			}
		}
		for i := range b.srv.Devices {
			for _, m := range b.migHandles(i) {
				if u, _ := m.GetUUID(); u == uuid {
					return m, nvml.SUCCESS
				}
			}
		}
		return nil, nvml.ERROR_NOT_FOUND
	}
}

func (b *simBackend) Discover(ctx context.Context) (*Node, error) {
	n, err := discover(b.srv, discoverOptions{migMinorsPath: b.migMinorsPath()})
	if err != nil {
		return nil, err
	}
	n.DevRoot, n.DriverRoot = b.devRoot, b.driverRoot
	n.ProcDevices = filepath.Join(b.simRoot, "proc/devices")
	n.SimGPUFile = filepath.Join(b.simRoot, SimGPUFileInContainer)
	n.SimDriverState = b.procs.dir
	if b.mdev != nil {
		if err := addMdev(n, b.mdev); err != nil {
			return nil, err
		}
	}
	if err := writeSimGPUFile(n); err != nil {
		return nil, fmt.Errorf("simulated driver GPU file: %w", err)
	}
	if err := EnsureDeviceNodes(n); err != nil {
		return nil, err
	}
	if err := createVFIONodes(n); err != nil {
		return nil, err
	}
	return n, nil
}

// CreateMdev creates the mdev through go-nvlib like on real sysfs, then plays the kernel's part in
// the simulated tree: the device appears under its parent and the type has one instance fewer.
func (b *simBackend) CreateMdev(parentBus, typeName, uuid string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.mdev == nil {
		return fmt.Errorf("create mdev %s: the simulated node has no mdev parents", uuid)
	}
	if err := createMdev(b.mdev, parentBus, typeName, uuid); err != nil {
		return err
	}
	parents, err := b.mdev.GetAllParentDevices()
	if err != nil {
		return err
	}
	for _, p := range parents {
		if !strings.EqualFold(p.Address, parentBus) {
			continue
		}
		types, err := mdevTypes(p)
		if err != nil {
			return err
		}
		for _, t := range types {
			if t.Name != typeName {
				continue
			}
			if t.Available < 1 {
				return fmt.Errorf("create mdev %s: no %s instances left on %s", uuid, typeName, parentBus)
			}
			if err := b.mdev.AddMockA100Mdev(uuid, typeName, t.ID, p.Path); err != nil {
				return fmt.Errorf("create simulated mdev %s: %w", uuid, err)
			}
			return setAvailable(p.Path, t.ID, t.Available-1)
		}
	}
	return fmt.Errorf("create mdev %s: no type %s on %s", uuid, typeName, parentBus)
}

// RemoveMdev undoes CreateMdev in the simulated tree.
func (b *simBackend) RemoveMdev(uuid string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.mdev == nil {
		return nil
	}
	return removeMdev(b.mdev, uuid, func(d *nvmdev.Device) error {
		typeDir, err := filepath.EvalSymlinks(filepath.Join(d.Path, "mdev_type"))
		if err != nil {
			return err
		}
		raw, err := os.ReadFile(filepath.Join(typeDir, "available_instances"))
		if err != nil {
			return err
		}
		var avail int
		fmt.Sscanf(string(raw), "%d", &avail)
		parentDir := filepath.Dir(filepath.Dir(typeDir))
		if err := os.Remove(d.Path); err != nil {
			return err
		}
		if err := os.RemoveAll(filepath.Join(parentDir, uuid)); err != nil {
			return err
		}
		return setAvailable(parentDir, filepath.Base(typeDir), avail+1)
	})
}

func setAvailable(parentDir, typeID string, n int) error {
	return os.WriteFile(filepath.Join(parentDir, "mdev_supported_types", typeID, "available_instances"), []byte(fmt.Sprint(n)), 0o644)
}

func (b *simBackend) WatchHealth(ctx context.Context, opts HealthOptions, report func(HealthEvent)) error {
	log := opts.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	go b.watchFaultFiles(ctx, log)
	return watchHealth(ctx, b.srv, opts, report)
}

func (b *simBackend) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.closed && b.mdev != nil {
		b.mdev.Cleanup()
	}
	b.closed = true
	return nil
}
