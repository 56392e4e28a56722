package main

import (
	"context"
	"flag"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// The node agent on its own, as the guard and feedback phases run it: `tessera-node run` with no
// kubelet, containerd or API server, and a ledger holding the phase's share containers (written
// with internal/ledger before it starts, as the NRI plugin would have). The containers are runc
// containers in cgroups named by their container IDs, as the cgroupfs driver names a pod's.

// agentOpts are the flags the phases that run the agent share.
type agentOpts struct {
	work, out, rootfs, runc, node, vcudaLib, backend, driverRoot string
	index                                                        int
	dry                                                          bool
}

func agentFlags(fs *flag.FlagSet) *agentOpts {
	o := &agentOpts{}
	fs.StringVar(&o.work, "work", "", "the node phase's work folder (cdi/, inventory.json) (required)")
	fs.StringVar(&o.out, "out", "", "phase result file (required)")
	fs.StringVar(&o.rootfs, "rootfs", "", "the containers' root file system, with the probes (required)")
	fs.StringVar(&o.runc, "runc", "runc", "runc binary")
	fs.StringVar(&o.node, "tessera-node", "tessera-node", "tessera-node binary")
	fs.StringVar(&o.vcudaLib, "vcuda-library", "", "libvcuda.so (required)")
	fs.IntVar(&o.index, "gpu-index", 0, "the GPU the share containers get")
	fs.StringVar(&o.backend, "backend", "nvml", "nvml (a real GPU) or sim (the dry run; its flags after --)")
	fs.StringVar(&o.driverRoot, "driver-root", "auto", "the driver root for --backend=nvml (auto: as the node phase finds it)")
	fs.BoolVar(&o.dry, "dry-run", false, "the simulated node and the fake driver")
	return o
}

// shareSpec is one share container's caps in the ledger.
type shareSpec struct {
	memoryBytes int64
	cores       int
}

// agentRun is a running agent and what the phase needs of it.
type agentRun struct {
	dir     string // work/<phase>: data/, run/ (the NRI plugin's state: containers/<id>/), containers/, the log
	gpu     *api.GPU
	runner  *runner
	ids     map[string]string // share name -> container ID
	listen  string            // /metrics
	readLog func() string
	stop    func()
}

// runDir is the agent's --run-dir: the NRI plugin keeps a container's vcuda files in
// runDir/containers/<id> (where the agent writes its measured compute file).
func (a *agentRun) runDir() string { return filepath.Join(a.dir, "run") }

// startAgent starts the agent for the phase with the shares in its ledger and the extra flags,
// and waits for its memory guard. An agent that does not come up is a failed check on p and a nil
// agentRun; err is for what the phase could not set up at all.
func startAgent(p *Phase, o *agentOpts, passthrough []string, phase string, shares map[string]shareSpec, flags ...string) (*agentRun, error) {
	if o.work == "" || o.out == "" || !filepath.IsAbs(o.rootfs) || o.vcudaLib == "" {
		return nil, fmt.Errorf("-work, -out, -vcuda-library and an absolute -rootfs are required")
	}
	dir := filepath.Join(o.work, phase)
	if err := os.RemoveAll(dir); err != nil {
		return nil, err
	}
	_, g, r, err := setupContainers(o.work, o.index, o.runc, o.rootfs, filepath.Join(dir, "containers"))
	if err != nil {
		return nil, err
	}
	agentArgs := []string{"--backend=" + o.backend}
	if o.backend == "nvml" {
		root := o.driverRoot
		if root == "auto" {
			if root, err = findDriverRoot(driverRootCandidates); err != nil {
				return nil, err
			}
		}
		agentArgs = append(agentArgs, "--driver-root="+root)
	}
	agentArgs = append(agentArgs, passthrough...) // the sim backend's state, as the node phase passes it
	ids := map[string]string{}
	l, err := ledger.Open(filepath.Join(dir, "data", "ledger.json"), nil)
	if err != nil {
		return nil, err
	}
	for _, name := range slices.Sorted(maps.Keys(shares)) {
		s := shares[name]
		ids[name] = newContainerID()
		if err := l.Reserve(ledger.Entry{ContainerID: ids[name], PodUID: newContainerID()[:32], Namespace: "gpuproof", Pod: name, Container: "main",
			Devices: []api.DeviceAssignment{{UUID: g.UUID, MemoryBytes: s.memoryBytes, CoresPercent: s.cores}}}, nil); err != nil {
			return nil, fmt.Errorf("ledger entry for %s: %w", name, err)
		}
	}
	listen, err := freePort()
	if err != nil {
		return nil, err
	}
	cmdArgs := append([]string{"run", "--node-name=gpuproof", "--data-dir=" + filepath.Join(dir, "data"), "--cdi-dir=" + filepath.Join(dir, "cdi"),
		"--run-dir=" + filepath.Join(dir, "run"), "--device-plugin-dir=" + filepath.Join(dir, "device-plugins"),
		"--pod-resources-socket=" + filepath.Join(dir, "no-kubelet.sock"), "--nri-socket=" + filepath.Join(dir, "no-nri.sock"),
		"--kubeconfig=" + filepath.Join(dir, "no-kubeconfig"), "--listen=" + listen, "--vcuda-library=" + o.vcudaLib}, flags...)
	cmdArgs = append(cmdArgs, agentArgs...)
	logPath := filepath.Join(dir, "tessera-node.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	agent := exec.Command(o.node, cmdArgs...)
	agent.Stdout, agent.Stderr = logFile, logFile
	agent.Env = append(os.Environ(), "KUBECONFIG=")
	p.Env["agent"] = "tessera-node " + strings.Join(cmdArgs, " ")
	if err := agent.Start(); err != nil {
		logFile.Close()
		p.check("agent runs", false, "tessera-node run", "%v", err)
		return nil, nil
	}
	exited := make(chan error, 1)
	go func() { exited <- agent.Wait() }()
	a := &agentRun{dir: dir, gpu: g, runner: r, ids: ids, listen: listen,
		readLog: func() string { data, _ := os.ReadFile(logPath); return string(data) }}
	a.stop = func() {
		_ = agent.Process.Signal(os.Interrupt)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = agent.Process.Kill()
		}
		logFile.Close()
	}
	up, died := false, false
	_ = wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		select {
		case err := <-exited:
			exited <- err // for stop
			p.check("agent runs", false, "tessera-node run", "exited: %v: %s", err, lastLines(a.readLog(), 10))
			died = true
			return true, nil
		default:
		}
		up = strings.Contains(a.readLog(), "memory guard running")
		return up, nil
	})
	if died {
		a.stop()
		return nil, nil
	}
	p.check("agent runs with the memory guard", up, "tessera-node run's log", "%s", lastLines(firstMatch(a.readLog(), `(?m)^.*memory guard running.*$`), 1))
	if !up {
		a.stop()
		return nil, nil
	}
	return a, nil
}
