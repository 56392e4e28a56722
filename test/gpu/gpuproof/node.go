package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
	api "github.com/tessera-gpu/tessera/api/v1"
)

// driverRootCandidates are where NVIDIA drivers are installed, in the order tried: the GPU
// Operator's driver container, the host itself, a flat folder (GKE, some images).
var driverRootCandidates = []string{"/run/nvidia/driver", "/", "/usr/local/nvidia", "/home/kubernetes/bin/nvidia"}

// libDirs are the library folders nvcdi searches under a driver root.
var libDirs = []string{"usr/lib/x86_64-linux-gnu", "usr/lib64", "lib64", "lib/x86_64-linux-gnu", "lib", "usr/lib"}

// findDriverRoot returns the first candidate root holding libnvidia-ml.so.1.
func findDriverRoot(candidates []string) (string, error) {
	for _, root := range candidates {
		for _, d := range libDirs {
			if _, err := os.Stat(filepath.Join(root, d, "libnvidia-ml.so.1")); err == nil {
				return root, nil
			}
		}
	}
	return "", fmt.Errorf("no libnvidia-ml.so.1 under any of %v (in %v): pass -driver-root", candidates, libDirs)
}

func runNode(args []string) error {
	fs := flag.NewFlagSet("node", flag.ContinueOnError)
	node := fs.String("tessera-node", "tessera-node", "tessera-node binary")
	backend := fs.String("backend", "nvml", "nvml (a real GPU) or sim (the dry run)")
	driverRoot := fs.String("driver-root", "auto", "the driver root for --backend=nvml; auto: the first of "+strings.Join(driverRootCandidates, ", ")+" holding libnvidia-ml.so.1")
	work := fs.String("work", "", "work folder: cdi/, data/, inventory.json (required)")
	out := fs.String("out", "", "phase result file (required)")
	vcudaLib := fs.String("vcuda-library", "", "absolute path of libvcuda.so the share spec mounts (required)")
	probe := fs.String("cudaprobe", "cudaprobe", "cudaprobe, run on the host for CUDA's view of the GPUs")
	smi := fs.String("nvidia-smi", "nvidia-smi", "the host's nvidia-smi")
	dry := fs.Bool("dry-run", false, "the simulated node and the fake driver: results are marked dry_run")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *work == "" || *out == "" || !filepath.IsAbs(*vcudaLib) {
		return fmt.Errorf("-work, -out and an absolute -vcuda-library are required")
	}
	start := time.Now()
	p := newPhase("node", *dry)
	if err := os.MkdirAll(*work, 0o755); err != nil {
		return fmt.Errorf("work folder: %w", err)
	}
	cdiDir := filepath.Join(*work, "cdi")
	invPath := filepath.Join(*work, "inventory.json")
	gen := []string{"cdi", "generate", "--backend=" + *backend, "--cdi-dir=" + cdiDir, "--data-dir=" + filepath.Join(*work, "data"),
		"--vcuda-library=" + *vcudaLib, "--inventory=" + invPath}
	if *backend == "nvml" {
		root := *driverRoot
		if root == "auto" {
			var err error
			if root, err = findDriverRoot(driverRootCandidates); err != nil {
				return err
			}
		}
		p.Env["driver_root"] = root
		gen = append(gen, "--driver-root="+root)
	}
	gen = append(gen, fs.Args()...)
	t0 := time.Now()
	names, err := output(2*time.Minute, nil, *node, gen...)
	p.Env["cdi_generate"] = "tessera-node " + strings.Join(gen, " ")
	if err != nil {
		p.check("cdi generate", false, "tessera-node cdi generate", "%v", err)
		return finish(p, *out, start)
	}
	p.check("cdi generate", true, "tessera-node cdi generate", "%d device names in %.2f s", len(strings.Fields(names)), time.Since(t0).Seconds())
	inv, err := readInventory(invPath)
	if err != nil {
		return err
	}
	p.Env["driver_version"] = inv.DriverVersion
	if len(inv.GPUs) > 0 {
		p.Env["gpu_model"] = inv.GPUs[0].Model
		p.Env["gpu_count"] = strconv.Itoa(len(inv.GPUs))
	}
	checkSpecs(p, cdiDir, inv)

	// The references: the host's nvidia-smi (NVML), CUDA (cudaprobe on the host) and sysfs (NUMA).
	smiGPUs, smiErr := nvidiaSMIQuery(*smi)
	if smiErr != nil {
		p.skip("nvidia-smi --query-gpu", "nvidia-smi", "no reference from the query (%v); UUIDs and names from nvidia-smi -L", smiErr)
		smiGPUs, smiErr = nvidiaSMIList(*smi)
	}
	if smiErr != nil {
		p.check("nvidia-smi", false, "nvidia-smi", "%v", smiErr)
	}
	probeOut, perr := output(time.Minute, nil, *probe, "info")
	cudaGPUs, cudaVersion := parseProbeInfo(probeOut)
	if perr != nil {
		p.check("cudaprobe info on the host", false, "cudaprobe (CUDA driver API)", "%v", perr)
	}
	p.Env["cuda_driver_version"] = cudaVersion
	compareInventory(p, inv, smiGPUs, cudaGPUs, *dry)
	return finish(p, *out, start)
}

func readInventory(path string) (*api.NodeInventory, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read the inventory tessera-node wrote: %w", err)
	}
	inv := &api.NodeInventory{}
	if err := json.Unmarshal(data, inv); err != nil {
		return nil, fmt.Errorf("decode %s: %w", path, err)
	}
	return inv, nil
}

// checkSpecs loads the specs with the CDI library (as containerd does) and checks that every GPU
// has a device and that the common edits carry the driver's CUDA library, NVML and nvidia-smi.
func checkSpecs(p *Phase, cdiDir string, inv *api.NodeInventory) {
	const by = "CDI library (tags.cncf.io/container-device-interface) loading the written specs"
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(cdiDir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		p.check("specs load", false, by, "%v", err)
		return
	}
	if errs := cache.GetErrors(); len(errs) > 0 {
		p.check("specs load", false, by, "%v", errs)
		return
	}
	var missing []string
	for _, g := range inv.GPUs {
		if g.Shareable() && cache.GetDevice(configv1.DefaultCDIVendor+"/gpu="+g.UUID) == nil {
			missing = append(missing, g.UUID)
		}
	}
	p.check("specs load", len(missing) == 0, by, "%d devices; GPUs without a device: %v", len(cache.ListDevices()), missing)
	for _, want := range []string{"libcuda.so.", "libnvidia-ml.so.", "nvidia-smi"} {
		var found []string
		for _, vendor := range cache.ListVendors() {
			for _, s := range cache.GetVendorSpecs(vendor) {
				for _, m := range s.ContainerEdits.Mounts {
					if strings.HasPrefix(filepath.Base(m.ContainerPath), want) {
						found = append(found, m.HostPath)
					}
				}
			}
		}
		p.check("specs mount "+strings.TrimSuffix(want, "."), len(found) > 0, by, "%s", firstOrNone(found))
	}
	var hooks []string
	for _, vendor := range cache.ListVendors() {
		for _, s := range cache.GetVendorSpecs(vendor) {
			for _, h := range s.ContainerEdits.Hooks {
				if len(h.Args) > 1 {
					hooks = append(hooks, h.Args[1])
				}
			}
			break
		}
	}
	p.Env["cdi_hooks"] = strings.Join(hooks, ",")
}

func firstOrNone(s []string) string {
	if len(s) == 0 {
		return "none"
	}
	return s[0]
}

// refGPU is one GPU as a reference tool reports it; zero values are "not reported".
type refGPU struct {
	UUID, Name, PCI, CC string
	MemMiB              int64
	MemBytes            int64
	SMs                 int
}

// nvidiaSMIQuery asks the host's nvidia-smi (without vcuda) for what the inventory holds.
func nvidiaSMIQuery(smi string) (map[string]refGPU, error) {
	out, err := output(time.Minute, nil, smi, "--query-gpu=uuid,name,memory.total,pci.bus_id,compute_cap", "--format=csv,noheader,nounits")
	if err != nil {
		return nil, err
	}
	r := csv.NewReader(strings.NewReader(out))
	r.TrimLeadingSpace = true
	rows, err := r.ReadAll()
	if err != nil {
		return nil, fmt.Errorf("parse nvidia-smi --query-gpu output %q: %w", out, err)
	}
	gpus := map[string]refGPU{}
	for _, row := range rows {
		if len(row) != 5 {
			return nil, fmt.Errorf("nvidia-smi --query-gpu row %q: want 5 fields", row)
		}
		mem, err := strconv.ParseInt(strings.TrimSpace(row[2]), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("nvidia-smi memory.total %q: %w", row[2], err)
		}
		g := refGPU{UUID: strings.TrimSpace(row[0]), Name: strings.TrimSpace(row[1]), MemMiB: mem, PCI: normalizeBusID(row[3]), CC: strings.TrimSpace(row[4])}
		gpus[g.UUID] = g
	}
	return gpus, nil
}

var smiListLine = regexp.MustCompile(`(?m)^GPU \d+: (.+) \(UUID: (GPU-[0-9a-fA-F-]+)\)$`)

// nvidiaSMIList is the fallback: names and UUIDs from nvidia-smi -L.
func nvidiaSMIList(smi string) (map[string]refGPU, error) {
	out, err := output(time.Minute, nil, smi, "-L")
	if err != nil {
		return nil, err
	}
	gpus := map[string]refGPU{}
	for _, m := range smiListLine.FindAllStringSubmatch(out, -1) {
		gpus[m[2]] = refGPU{UUID: m[2], Name: m[1]}
	}
	if len(gpus) == 0 {
		return nil, fmt.Errorf("nvidia-smi -L listed no GPU: %q", out)
	}
	return gpus, nil
}

// normalizeBusID turns NVML's "00000000:18:00.0" into sysfs's "0000:18:00.0" (as tessera-node does).
func normalizeBusID(id string) string {
	id = strings.ToLower(strings.TrimSpace(id))
	if dom, rest, ok := strings.Cut(id, ":"); ok && len(dom) == 8 {
		return dom[4:] + ":" + rest
	}
	return id
}

// parseProbeInfo reads `cudaprobe info`: the GPUs by UUID and the driver's CUDA version.
func parseProbeInfo(out string) (map[string]refGPU, string) {
	gpus := map[string]refGPU{}
	version := ""
	for _, line := range strings.Split(out, "\n") {
		kv := words(line)
		if v, ok := kv["cuda_driver_version"]; ok {
			version = v
		}
		if _, ok := kv["device"]; !ok {
			continue
		}
		g := refGPU{UUID: kv["uuid"], Name: strings.ReplaceAll(kv["name"], "_", " "), PCI: kv["pci"], CC: kv["cc"]}
		g.MemBytes, _ = strconv.ParseInt(kv["total_mem"], 10, 64)
		g.SMs, _ = strconv.Atoi(kv["sms"])
		gpus[g.UUID] = g
	}
	return gpus, version
}

// words parses "key=value key=value" output.
func words(line string) map[string]string {
	kv := map[string]string{}
	for _, w := range strings.Fields(line) {
		if k, v, ok := strings.Cut(w, "="); ok {
			kv[k] = v
		}
	}
	return kv
}

// compareInventory holds tessera-node's inventory against nvidia-smi (NVML as NVIDIA's tool reads
// it), CUDA (cudaprobe) and sysfs, GPU by GPU. On the fake driver the PCI address CUDA reports is
// the fake's own (minor+1), so that one comparison is not made in a dry run. A GPU in MIG mode is
// no CUDA device (nvidia-smi lists it, CUDA lists its instances): the instance CUDA lists is held
// against the inventory's.
func compareInventory(p *Phase, inv *api.NodeInventory, smi, cuda map[string]refGPU, dry bool) {
	p.check("GPU count", len(inv.GPUs) == len(smi) && len(smi) > 0, "nvidia-smi", "inventory %d GPUs, nvidia-smi %d", len(inv.GPUs), len(smi))
	for _, g := range inv.GPUs {
		id := fmt.Sprintf("GPU %d (%s)", g.Index, g.UUID)
		s, ok := smi[g.UUID]
		p.check(id+" UUID", ok, "nvidia-smi", "inventory UUID %s %s by nvidia-smi", g.UUID, map[bool]string{true: "listed", false: "NOT listed"}[ok])
		if !ok {
			continue
		}
		p.check(id+" model", s.Name == g.Model, "nvidia-smi", "inventory %q, nvidia-smi %q", g.Model, s.Name)
		if s.MemMiB > 0 {
			p.check(id+" memory", g.MemoryBytes>>20 == s.MemMiB, "nvidia-smi memory.total (MiB)", "inventory %d MiB, nvidia-smi %d MiB", g.MemoryBytes>>20, s.MemMiB)
		}
		if s.PCI != "" {
			p.check(id+" PCI", s.PCI == g.PCIBusID, "nvidia-smi pci.bus_id", "inventory %s, nvidia-smi %s", g.PCIBusID, s.PCI)
		}
		if s.CC != "" {
			p.check(id+" compute capability", s.CC == g.ComputeCapability, "nvidia-smi compute_cap", "inventory %s, nvidia-smi %s", g.ComputeCapability, s.CC)
		}
		c, ok := cuda[g.UUID]
		switch {
		case g.MIG != nil:
			// CUDA enumerates a GPU in MIG mode only as its MIG devices (one a process at most).
			p.check(id+" CUDA", !ok, "cudaprobe info (CUDA driver API)", "a GPU in MIG mode is no CUDA device: CUDA %s %s",
				map[bool]string{true: "lists", false: "does not list"}[ok], g.UUID)
			for _, m := range g.MIG.Instances {
				if c, ok := cuda[m.UUID]; ok {
					mid := id + " MIG " + m.UUID
					p.check(mid+" SM count", c.SMs == m.SMCount, "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)", "inventory %d, CUDA %d", m.SMCount, c.SMs)
					p.check(mid+" memory (CUDA)", c.MemBytes == m.MemoryBytes, "cuDeviceTotalMem_v2", "inventory %d bytes, CUDA %d bytes", m.MemoryBytes, c.MemBytes)
				}
			}
		case !ok:
			p.check(id+" CUDA", false, "cudaprobe info (CUDA driver API)", "CUDA does not list %s", g.UUID)
		default:
			p.check(id+" SM count", c.SMs == g.SMCount, "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)", "inventory %d, CUDA %d", g.SMCount, c.SMs)
			p.check(id+" memory (CUDA)", c.MemBytes == g.MemoryBytes, "cuDeviceTotalMem_v2", "inventory %d bytes, CUDA %d bytes", g.MemoryBytes, c.MemBytes)
			if dry {
				p.skip(id+" PCI (CUDA)", "cuDeviceGetAttribute(PCI_*)", "the fake driver reports its own PCI address (%s)", c.PCI)
			} else {
				p.check(id+" PCI (CUDA)", c.PCI == g.PCIBusID, "cuDeviceGetAttribute(PCI_*)", "inventory %s, CUDA %s", g.PCIBusID, c.PCI)
			}
		}
		numa, err := os.ReadFile(filepath.Join("/sys/bus/pci/devices", g.PCIBusID, "numa_node"))
		if err != nil {
			p.skip(id+" NUMA", "sysfs numa_node", "no sysfs entry for %s (%v); inventory says %d", g.PCIBusID, err, g.NUMANode)
			continue
		}
		want, _ := strconv.Atoi(strings.TrimSpace(string(numa)))
		p.check(id+" NUMA", want == g.NUMANode, "sysfs /sys/bus/pci/devices/<bus>/numa_node", "inventory %d, sysfs %d", g.NUMANode, want)
	}
}

// output runs a command with a deadline and returns its stdout (stderr goes into the error).
func output(timeout time.Duration, env []string, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.WaitDelay = 5 * time.Second
	if env != nil {
		cmd.Env = env
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("%s %s: %w: %s%s", filepath.Base(name), strings.Join(args, " "), err,
			lastLines(stdout.String(), 5), lastLines(stderr.String(), 10))
	}
	return stdout.String(), nil
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}
