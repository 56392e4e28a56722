package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	rspec "github.com/opencontainers/runtime-spec/specs-go"
	"k8s.io/apimachinery/pkg/util/wait"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/nri"
)

// The container phase: a runc container whose GPU, driver files and hooks come only from the CDI
// specs tessera-node wrote (as containerd injects them), and for a share the vcuda files exactly as
// the NRI plugin adds them (nri.VCUDAMounts). Nothing else of the host reaches the container.
func runContainer(args []string) error {
	fs := flag.NewFlagSet("container", flag.ContinueOnError)
	work := fs.String("work", "", "the node phase's work folder (cdi/, inventory.json); containers go under containers/ (required)")
	out := fs.String("out", "", "phase result file (required)")
	rootfs := fs.String("rootfs", "", "the container's root file system: busybox, glibc, cudaprobe (required)")
	runc := fs.String("runc", "runc", "runc binary")
	index := fs.Int("gpu-index", 0, "which GPU of the inventory to give the containers")
	shareMiB := fs.Int64("share-mib", 4096, "the share container's memory cap")
	shareCores := fs.Int("share-cores", 100, "the share container's compute cap (percent)")
	dry := fs.Bool("dry-run", false, "the simulated node and the fake driver")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *work == "" || *out == "" || !filepath.IsAbs(*rootfs) {
		return fmt.Errorf("-work, -out and an absolute -rootfs are required")
	}
	start := time.Now()
	p := newPhase("container", *dry)
	_, g, r, err := setupContainers(*work, *index, *runc, *rootfs, filepath.Join(*work, "containers"))
	if err != nil {
		return err
	}
	gen := &cdi.Generator{Vendor: configv1.DefaultCDIVendor}
	p.Env["gpu_uuid"], p.Env["gpu_model"] = g.UUID, g.Model
	p.Env["container_runtime"] = filepath.Base(*runc) // runc, or nsrunc: the preflight's fallback

	// A whole GPU: exactly that GPU, the whole of its memory.
	const probeWhole = "echo ==list; nvidia-smi -L; echo ==info; cudaprobe info"
	got, err := r.run("whole", []string{gen.Name(cdi.ClassGPU, g.UUID)}, nil, probeWhole)
	if err != nil {
		p.check("whole GPU container runs", false, "runc run", "%v", err)
	} else {
		p.check("whole GPU container runs", true, "runc run", "devices %s", gen.Name(cdi.ClassGPU, g.UUID))
		checkListsOnly(p, "whole", got, g.UUID)
		info := section(got, "info")
		dev := words(firstMatch(info, `(?m)^device=0 .*$`))
		p.check("whole: CUDA sees one GPU", strings.Contains(info, "devices=1\n") && dev["uuid"] == g.UUID, "cudaprobe info (cuDeviceGetCount, cuDeviceGetUuid_v2)", "%s", oneLine(info))
		p.check("whole: CUDA sees all its memory", dev["total_mem"] == strconv.FormatInt(g.MemoryBytes, 10), "cuDeviceTotalMem_v2", "CUDA %s bytes, inventory %d", dev["total_mem"], g.MemoryBytes)
	}

	// A share: the GPU plus the share token (the library) plus the NRI plugin's preload and limits.
	capBytes := *shareMiB << 20
	extra, err := shareMounts(filepath.Join(*work, "containers", "share-vcuda"), "gpuproof-share", g.UUID, capBytes, *shareCores, true)
	if err != nil {
		return err
	}
	const granule = 64 << 20
	probeShare := fmt.Sprintf("echo ==preload; cat /etc/ld.so.preload; echo ==list; nvidia-smi -L; echo ==info; cudaprobe info; "+
		"echo ==fill; cudaprobe fill %d; echo ==smi; (cudaprobe hold %d 4 &) ; sleep 2; nvidia-smi; sleep 3", granule, granule)
	got, err = r.run("share", []string{gen.Name(cdi.ClassGPU, g.UUID), gen.Name(cdi.ClassShare, cdi.ShareName)}, extra, probeShare)
	if err != nil {
		p.check("share container runs", false, "runc run", "%v", err)
		return finish(p, *out, start)
	}
	p.check("share container runs", true, "runc run", "cap %d MiB, %d%% compute", *shareMiB, *shareCores)
	p.check("share: ld.so.preload names vcuda", strings.TrimSpace(section(got, "preload")) == api.VCUDALibraryInContainer, "cat /etc/ld.so.preload", "%q", strings.TrimSpace(section(got, "preload")))
	checkListsOnly(p, "share", got, g.UUID)
	dev := words(firstMatch(section(got, "info"), `(?m)^device=0 .*$`))
	p.check("share: CUDA reports the cap", dev["total_mem"] == strconv.FormatInt(capBytes, 10) && dev["meminfo_total"] == strconv.FormatInt(capBytes, 10),
		"cudaprobe info under vcuda (cuDeviceTotalMem_v2, cuMemGetInfo_v2)", "total_mem %s, meminfo_total %s, cap %d", dev["total_mem"], dev["meminfo_total"], capBytes)
	fill := words(section(got, "fill"))
	alloc, _ := strconv.ParseInt(fill["allocated"], 10, 64)
	free, _ := strconv.ParseInt(fill["meminfo_free"], 10, 64)
	// OOM (2) at the cap: not past it, and not more than one granule before what vcuda said was free.
	p.check("share: OOM at the cap", fill["stopped_by"] == "2" && alloc <= capBytes && alloc >= free-granule,
		"cudaprobe fill (cuMemAlloc_v2 in 64 MiB blocks until an error)", "allocated %d of cap %d (free at start %d), stopped by CUDA error %s", alloc, capBytes, free, fill["stopped_by"])
	p.figure(Figure{Name: "share: bytes allocated before OOM", Value: float64(alloc), Unit: "bytes", MeasuredBy: "cudaprobe fill in the share container", Goal: fmt.Sprintf("<= cap %d", capBytes), Status: passFail(alloc <= capBytes)})
	smi := section(got, "smi")
	m := regexp.MustCompile(`(\d+)\s*MiB\s*/\s*(\d+)\s*MiB`).FindStringSubmatch(smi)
	p.check("share: nvidia-smi shows the cap", m != nil && m[2] == strconv.FormatInt(*shareMiB, 10), "nvidia-smi in the container (NVML through vcuda)", "%s", firstOrNone(m))
	p.Env["share_nvidia_smi"] = oneLine(smi)
	return finish(p, *out, start)
}

// setupContainers reads what the node phase left in work (the inventory, the CDI specs) and returns
// the GPU with the given index and a runner whose containers live under dir.
func setupContainers(work string, index int, runc, rootfs, dir string) (*api.NodeInventory, *api.GPU, *runner, error) {
	inv, err := readInventory(filepath.Join(work, "inventory.json"))
	if err != nil {
		return nil, nil, nil, err
	}
	var g *api.GPU
	for i := range inv.GPUs {
		if inv.GPUs[i].Index == index {
			g = &inv.GPUs[i]
		}
	}
	if g == nil {
		return nil, nil, nil, fmt.Errorf("no GPU with index %d in the inventory", index)
	}
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(filepath.Join(work, "cdi")), cdiapi.WithAutoRefresh(false))
	if err != nil {
		return nil, nil, nil, fmt.Errorf("load the CDI specs: %w", err)
	}
	return inv, g, &runner{runc: runc, rootfs: rootfs, dir: dir, cache: cache}, nil
}

// shareMounts are the vcuda files of a share container exactly as the NRI plugin adds them
// (nri.VCUDAMounts: the preload, the limits, the accounting region), kept in dir; preload false
// leaves out /etc/ld.so.preload: a container that walks past vcuda.
func shareMounts(dir, id, uuid string, capBytes int64, cores int, preload bool) ([]rspec.Mount, error) {
	region := filepath.Join(dir, "region")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	// The accounting region: on a node the plugin puts it on its own small tmpfs (region.go); here a
	// plain file writable by the container's user does.
	if err := os.WriteFile(region, nil, 0o666); err != nil {
		return nil, err
	}
	if err := os.Chmod(region, 0o666); err != nil {
		return nil, err
	}
	mounts, err := nri.VCUDAMounts(dir, region, id, []api.DeviceAssignment{{UUID: uuid, MemoryBytes: capBytes, CoresPercent: cores}}, "", false)
	if err != nil {
		return nil, err
	}
	var out []rspec.Mount
	for _, m := range mounts {
		if !preload && m.Destination == "/etc/ld.so.preload" {
			continue
		}
		out = append(out, rspec.Mount{Destination: m.Destination, Type: m.Type, Source: m.Source, Options: m.Options})
	}
	return out, nil
}

func passFail(ok bool) string {
	if ok {
		return Pass
	}
	return Fail
}

// checkListsOnly: nvidia-smi -L in the container lists exactly the GPU given.
func checkListsOnly(p *Phase, name, got, uuid string) {
	list := smiListLine.FindAllStringSubmatch(section(got, "list"), -1)
	p.check(name+": nvidia-smi -L lists exactly that GPU", len(list) == 1 && list[0][2] == uuid, "nvidia-smi -L in the container", "%s", oneLine(section(got, "list")))
}

// section returns what the container printed after "==name" and before the next "==".
func section(out, name string) string {
	_, after, ok := strings.Cut(out, "=="+name+"\n")
	if !ok {
		return ""
	}
	if i := strings.Index(after, "\n=="); i >= 0 {
		after = after[:i+1]
	}
	return after
}

func firstMatch(s, re string) string { return regexp.MustCompile(re).FindString(s) }

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

type runner struct {
	runc, rootfs, dir string
	cache             *cdiapi.Cache
}

// run creates the bundle of one container (runc's default spec, the rootfs, the CDI devices, extra
// mounts), runs the shell command in it and returns its output.
func (r *runner) run(name string, devices []string, mounts []rspec.Mount, command string) (string, error) {
	bundle, err := r.prepare(name, devices, mounts, command, "")
	if err != nil {
		return "", err
	}
	id := fmt.Sprintf("gpuproof-%s-%d", name, os.Getpid())
	defer output(30*time.Second, nil, r.runc, "delete", "--force", id) //nolint:errcheck // best effort: the container may be gone
	got, err := output(2*time.Minute, nil, r.runc, "run", "--bundle", bundle, id)
	if err := os.WriteFile(filepath.Join(bundle, "output.txt"), []byte(got), 0o644); err != nil {
		return "", err
	}
	return got, err
}

// prepare writes the bundle of one container: runc's default spec with the rootfs, the CDI devices,
// extra mounts and the shell command; cgroupsPath ("": runc's default) places it where the memory
// guard finds a container ID.
func (r *runner) prepare(name string, devices []string, mounts []rspec.Mount, command, cgroupsPath string) (string, error) {
	bundle := filepath.Join(r.dir, name)
	if err := os.MkdirAll(bundle, 0o755); err != nil {
		return "", err
	}
	_ = os.Remove(filepath.Join(bundle, "config.json"))
	if _, err := output(time.Minute, nil, r.runc, "spec", "--bundle", bundle); err != nil {
		return "", err
	}
	data, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		return "", err
	}
	spec := &rspec.Spec{}
	if err := json.Unmarshal(data, spec); err != nil {
		return "", fmt.Errorf("runc's default spec: %w", err)
	}
	spec.Root = &rspec.Root{Path: r.rootfs}
	spec.Hostname = "gpuproof-" + name
	spec.Process.Terminal = false
	spec.Process.Args = []string{"/bin/sh", "-c", command}
	if cgroupsPath != "" && spec.Linux != nil {
		spec.Linux.CgroupsPath = cgroupsPath
	}
	if len(devices) > 0 {
		if _, err := r.cache.InjectDevices(spec, devices...); err != nil {
			return "", fmt.Errorf("inject CDI devices %v: %w", devices, err)
		}
	}
	spec.Mounts = append(spec.Mounts, mounts...)
	if data, err = json.MarshalIndent(spec, "", "  "); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o644); err != nil {
		return "", err
	}
	return bundle, nil
}

// started is a container running in the background (runner.start): the host measures it while it runs.
type started struct {
	runc, id, bundle string
	out              *syncBuffer
	done             chan struct{}
	exit             int // runc run's exit status (137: SIGKILL), valid once done is closed
	err              error
}

// start runs the shell command in a new container without waiting for it; stop ends it.
func (r *runner) start(name string, devices []string, mounts []rspec.Mount, command, cgroupsPath string) (*started, error) {
	bundle, err := r.prepare(name, devices, mounts, command, cgroupsPath)
	if err != nil {
		return nil, err
	}
	s := &started{runc: r.runc, id: fmt.Sprintf("gpuproof-%s-%d", name, os.Getpid()), bundle: bundle, out: &syncBuffer{}, done: make(chan struct{})}
	_, _ = output(30*time.Second, nil, r.runc, "delete", "--force", s.id) // a leftover of an earlier run
	cmd := exec.Command(r.runc, "run", "--bundle", bundle, s.id)
	cmd.Stdout, cmd.Stderr = s.out, s.out
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("runc run %s: %w", s.id, err)
	}
	go func() {
		s.err = cmd.Wait()
		s.exit = cmd.ProcessState.ExitCode()
		close(s.done)
	}()
	return s, nil
}

// waitLine waits until the container printed the line, or ended, or the timeout passed; it looks
// at once, then every 50 ms.
func (s *started) waitLine(line string, timeout time.Duration) bool {
	printed := func() bool { return strings.Contains("\n"+s.out.String(), "\n"+line+"\n") }
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	defer context.AfterFunc(wait.ContextForChannel(s.done), cancel)() // an ended container prints no more
	_ = wait.PollUntilContextCancel(ctx, 50*time.Millisecond, true, func(context.Context) (bool, error) { return printed(), nil })
	return printed()
}

// pid is the host pid of the container's first process, as runc knows it.
func (s *started) pid() (int, error) {
	got, err := output(30*time.Second, nil, s.runc, "state", s.id)
	if err != nil {
		return 0, err
	}
	var st struct {
		Pid    int    `json:"pid"`
		Status string `json:"status"`
	}
	if err := json.Unmarshal([]byte(got), &st); err != nil {
		return 0, fmt.Errorf("runc state %s: %w", s.id, err)
	}
	if st.Pid <= 0 || st.Status != "running" {
		return 0, fmt.Errorf("runc state %s: %s (pid %d)", s.id, st.Status, st.Pid)
	}
	return st.Pid, nil
}

// wait waits up to timeout for the container to end by itself: its exit status, or -1 if it runs on.
func (s *started) wait(timeout time.Duration) int {
	select {
	case <-s.done:
		return s.exit
	case <-time.After(timeout):
		return -1
	}
}

// running reports whether the container still runs.
func (s *started) running() bool {
	select {
	case <-s.done:
		return false
	default:
		return true
	}
}

// stop kills the container if it still runs, removes it and saves its output beside its bundle.
func (s *started) stop() string {
	if s.running() {
		_, _ = output(30*time.Second, nil, s.runc, "kill", s.id, "KILL")
		s.wait(30 * time.Second)
	}
	_, _ = output(30*time.Second, nil, s.runc, "delete", "--force", s.id)
	got := s.out.String()
	_ = os.WriteFile(filepath.Join(s.bundle, "output.txt"), []byte(got), 0o644)
	return got
}

// syncBuffer is a bytes.Buffer a container writes while the phase reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
