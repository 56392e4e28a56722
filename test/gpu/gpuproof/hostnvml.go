package main

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/apimachinery/pkg/util/wait"
)

// NVML on the host, as the node agent reads it: the driver's own count of each process's device
// memory, by host pid. In the dry run it is the fake driver's libnvidia-ml.so.1, which lists the
// simulated node's container processes by host pid from the fake's per-process records.

// openNVML loads libnvidia-ml.so.1 from path ("auto": the driver root's, found as the node phase
// finds it).
func openNVML(path string) (nvml.Interface, error) {
	if path == "auto" {
		root, err := findDriverRoot(driverRootCandidates)
		if err != nil {
			return nil, err
		}
		for _, d := range libDirs {
			if p := filepath.Join(root, d, "libnvidia-ml.so.1"); fileExists(p) {
				path = p
				break
			}
		}
	}
	lib := nvml.New(nvml.WithLibraryPath(path))
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("NVML init (%s): %v", path, nvml.ErrorString(ret))
	}
	return lib, nil
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// computeProcesses is every compute process's memory on a GPU, by host pid.
func computeProcesses(lib nvml.Interface, uuid string) (map[uint32]uint64, error) {
	dev, ret := lib.DeviceGetHandleByUUID(uuid)
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("NVML device %s: %v", uuid, nvml.ErrorString(ret))
	}
	infos, ret := dev.GetComputeRunningProcesses()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("NVML compute processes of %s: %v", uuid, nvml.ErrorString(ret))
	}
	out := map[uint32]uint64{}
	for _, p := range infos {
		if p.UsedGpuMemory != math.MaxUint64 { // NVML_VALUE_NOT_AVAILABLE
			out[p.Pid] = max(out[p.Pid], p.UsedGpuMemory)
		}
	}
	return out, nil
}

// pidNamespace is the PID namespace (its inode) of a host pid.
func pidNamespace(pid uint32) (uint64, error) {
	st, err := os.Stat(filepath.Join("/proc", strconv.FormatUint(uint64(pid), 10), "ns", "pid"))
	if err != nil {
		return 0, err
	}
	return st.Sys().(*syscall.Stat_t).Ino, nil
}

// sampler reads a GPU's processes from NVML every interval and keeps, for the processes of one
// PID namespace (a container's), the most each was seen to use.
type sampler struct {
	mu      sync.Mutex
	peak    map[uint32]uint64 // host pid -> most seen
	samples int
	err     error
	stop    chan struct{}
	done    chan struct{}
}

func startSampler(lib nvml.Interface, uuid string, pidns uint64, every time.Duration) *sampler {
	s := &sampler{peak: map[uint32]uint64{}, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		// A sample at once, then each interval after the last ended, until finish.
		wait.Until(func() {
			procs, err := computeProcesses(lib, uuid)
			s.mu.Lock()
			defer s.mu.Unlock()
			s.samples++
			if err != nil && s.err == nil {
				s.err = err
			}
			for pid, used := range procs {
				if ns, err := pidNamespace(pid); err == nil && ns == pidns {
					s.peak[pid] = max(s.peak[pid], used)
				}
			}
		}, every, s.stop)
	}()
	return s
}

// finish stops sampling and returns the most any one process of the namespace used, how many
// processes were seen and how many samples were taken.
func (s *sampler) finish() (peak uint64, procs, samples int, err error) {
	close(s.stop)
	<-s.done
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, v := range s.peak {
		peak = max(peak, v)
	}
	return peak, len(s.peak), s.samples, s.err
}
