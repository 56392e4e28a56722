package vcuda

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
)

// Layout of the shared accounting region (version 1), as written by
// src/region.h. All fields are little-endian; see README.md.
const (
	RegionMagic   = 0x31414455435653 // "SVCUDA1\0"
	RegionVersion = 1
	regionFrozen  = uint64(1) << 63
	maxGPUs       = 64
)

// RegionGPU is one GPU record of a container's region.
type RegionGPU struct {
	UUID           string
	MemCap         uint64 // bytes, from the limits file
	Cores          uint32 // percent, from the limits file
	Used           uint64 // bytes held by the container's live processes
	Reclaiming     bool   // a dead-process reclaim is recomputing Used
	ThrottledNs    uint64 // total time launches waited for the compute limiter
	ThrottleEvents uint64 // launches that waited
	OOMEvents      uint64 // allocations refused at the cap
	Reclaims       uint64 // reclaims that dropped dead processes
	BusyNs         uint64 // device time charged by the compute limiter
}

// RegionProcess is a process slot in use.
type RegionProcess struct {
	PID  uint32
	Used []uint64 // bytes per GPU record
}

// Region is a snapshot of a container's region, for the node agent's metrics.
type Region struct {
	Container string
	GPUs      []RegionGPU
	Processes []RegionProcess
}

// ReadRegion reads the region file that vcuda maintains for a container. The
// words are updated concurrently; a snapshot is consistent enough for metrics.
func ReadRegion(path string) (*Region, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return ParseRegion(b)
}

// ParseRegion decodes a region image.
func ParseRegion(b []byte) (*Region, error) {
	le := binary.LittleEndian
	if len(b) < 4096 {
		return nil, fmt.Errorf("vcuda region: %d bytes, too short", len(b))
	}
	if m := le.Uint64(b[0:]); m != RegionMagic {
		return nil, fmt.Errorf("vcuda region: bad magic %#x", m)
	}
	if v := le.Uint32(b[8:]); v != RegionVersion {
		return nil, fmt.Errorf("vcuda region: version %d, want %d", v, RegionVersion)
	}
	total := le.Uint64(b[16:])
	ngpus, nslots := le.Uint32(b[24:]), le.Uint32(b[28:])
	gpuOff, gpuSize := le.Uint32(b[32:]), le.Uint32(b[36:])
	slotOff, slotSize := le.Uint32(b[40:]), le.Uint32(b[44:])
	if uint64(len(b)) < total || ngpus > maxGPUs || gpuSize < 224 || slotSize < 64+8*maxGPUs ||
		uint64(gpuOff)+uint64(ngpus)*uint64(gpuSize) > total ||
		uint64(slotOff)+uint64(nslots)*uint64(slotSize) > total {
		return nil, fmt.Errorf("vcuda region: inconsistent header")
	}
	r := &Region{Container: cstring(b[48 : 48+256])}
	for i := uint32(0); i < ngpus; i++ {
		g := b[gpuOff+i*gpuSize:]
		used := le.Uint64(g[64:])
		r.GPUs = append(r.GPUs, RegionGPU{
			UUID:           cstring(g[:48]),
			MemCap:         le.Uint64(g[48:]),
			Cores:          le.Uint32(g[56:]),
			Used:           used &^ regionFrozen,
			Reclaiming:     used&regionFrozen != 0,
			ThrottledNs:    le.Uint64(g[192:]),
			ThrottleEvents: le.Uint64(g[200:]),
			OOMEvents:      le.Uint64(g[208:]),
			Reclaims:       le.Uint64(g[216:]),
			BusyNs:         le.Uint64(g[224:]),
		})
	}
	for i := uint32(0); i < nslots; i++ {
		s := b[slotOff+i*slotSize:]
		pid := le.Uint32(s[0:])
		if pid == 0 {
			continue
		}
		p := RegionProcess{PID: pid, Used: make([]uint64, ngpus)}
		for g := uint32(0); g < ngpus; g++ {
			p.Used[g] = le.Uint64(s[64+8*g:])
		}
		r.Processes = append(r.Processes, p)
	}
	return r, nil
}

func cstring(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}
