package vcuda

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"slices"
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

// RegionProcess is a process slot in use. Every field is what the container wrote.
type RegionProcess struct {
	PID       uint32   // in the owner's PID namespace
	Live      bool     // state is live (not being claimed)
	Inflight  uint64   // the owner's threads inside an update of Used
	StartTime uint64   // field 22 of the owner's /proc/<pid>/stat
	PIDNS     uint64   // inode of the owner's PID namespace; 0 unknown
	Used      []uint64 // bytes per GPU record, contexts included
	// Contexts are the owner's contexts per GPU record and what vcuda charged them
	// (slot.ctx[]): at most one per GPU record, each naming a record in use.
	Contexts []RegionContexts
}

// RegionContexts is what a process's contexts on one GPU record were charged.
type RegionContexts struct {
	GPU     int    // GPU record index
	Count   uint32 // live contexts
	Charged uint64 // bytes vcuda charged them (a multiple of 2 MiB), part of Used[GPU]
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

// Sizes of the layout's parts (src/region.h), and the least a reader needs of
// each: a GPU record is read up to busy_ns, a process slot up to used[maxGPUs].
const (
	regionHeaderSize = 4096           // sizeof(vc_region_hdr)
	maxSlots         = 1024           // VC_MAX_SLOTS
	gpuRecordMin     = 224 + 8        // busy_ns at 224
	slotRecordMin    = 64 + 8*maxGPUs // used[] at 64
	regionHeaderMin  = 48 + 256       // container[256] at 48
	slotLive         = 2              // VC_SLOT_LIVE
	// slot.ctx[]: 8 words at 32 (VC_CTX_*): bits 0-6 GPU record + 1, 7-12 the count
	// (63: too many to count), 13-31 the charge in 2 MiB pages.
	slotCtxOffset  = 32
	slotCtxRecords = 8
	ctxSaturated   = 63
	ctxPage        = 2 << 20
)

// ParseRegion decodes a region image. The image is written by processes of the
// container it describes, so it is hostile input: every size, offset and count
// in it is checked against the image before anything is read, and a damaged
// or crafted image is an error naming the bad field, never a panic.
func ParseRegion(b []byte) (*Region, error) {
	le := binary.LittleEndian
	if len(b) < regionHeaderSize {
		return nil, fmt.Errorf("vcuda region: %d bytes, too short", len(b))
	}
	if m := le.Uint64(b[0:]); m != RegionMagic {
		return nil, fmt.Errorf("vcuda region: bad magic %#x", m)
	}
	if v := le.Uint32(b[8:]); v != RegionVersion {
		return nil, fmt.Errorf("vcuda region: version %d, want %d", v, RegionVersion)
	}
	hdrSize, total := le.Uint32(b[12:]), le.Uint64(b[16:])
	ngpus, nslots := le.Uint32(b[24:]), le.Uint32(b[28:])
	gpuOff, gpuSize := uint64(le.Uint32(b[32:])), uint64(le.Uint32(b[36:]))
	slotOff, slotSize := uint64(le.Uint32(b[40:])), uint64(le.Uint32(b[44:]))
	switch {
	case hdrSize != regionHeaderSize:
		return nil, fmt.Errorf("vcuda region: header size %d, want %d", hdrSize, regionHeaderSize)
	case total > uint64(len(b)) || total < regionHeaderSize:
		return nil, fmt.Errorf("vcuda region: total size %d, file has %d bytes", total, len(b))
	case ngpus > maxGPUs:
		return nil, fmt.Errorf("vcuda region: %d gpu records, at most %d", ngpus, maxGPUs)
	case nslots > maxSlots:
		return nil, fmt.Errorf("vcuda region: %d process slots, at most %d", nslots, maxSlots)
	case gpuSize < gpuRecordMin:
		return nil, fmt.Errorf("vcuda region: gpu record size %d, at least %d", gpuSize, gpuRecordMin)
	case slotSize < slotRecordMin:
		return nil, fmt.Errorf("vcuda region: slot size %d, at least %d", slotSize, slotRecordMin)
	case gpuOff < regionHeaderSize || gpuOff+uint64(ngpus)*gpuSize > total:
		return nil, fmt.Errorf("vcuda region: %d gpu records of %d bytes at %d do not fit in %d bytes", ngpus, gpuSize, gpuOff, total)
	case slotOff < regionHeaderSize || slotOff+uint64(nslots)*slotSize > total:
		return nil, fmt.Errorf("vcuda region: %d slots of %d bytes at %d do not fit in %d bytes", nslots, slotSize, slotOff, total)
	}
	// From here every record lies inside b[:total] and is at least as long as
	// what is read of it; nothing past total can be read, even within cap(b).
	b = b[:total:total]
	r := &Region{Container: cstring(b[48:regionHeaderMin])}
	for i := uint64(0); i < uint64(ngpus); i++ {
		g := b[gpuOff+i*gpuSize:][:gpuRecordMin]
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
	for i := uint64(0); i < uint64(nslots); i++ {
		s := b[slotOff+i*slotSize:][:slotRecordMin]
		pid := le.Uint32(s[0:])
		if pid == 0 {
			continue
		}
		p := RegionProcess{PID: pid, Live: le.Uint32(s[4:]) == slotLive, StartTime: le.Uint64(s[8:]),
			Inflight: le.Uint64(s[16:]), PIDNS: le.Uint64(s[24:]), Used: make([]uint64, ngpus)}
		for g := range p.Used {
			p.Used[g] = le.Uint64(s[64+8*g:])
		}
		p.Contexts = slotContexts(s[slotCtxOffset:slotCtxOffset+4*slotCtxRecords], p.Used)
		r.Processes = append(r.Processes, p)
	}
	return r, nil
}

// slotContexts decodes a slot's ctx[] words. An entry naming no GPU record in use, a GPU named
// twice (both dropped), a count too large to be counted, or a charge over what the slot holds on
// the GPU is not a record: the process then gives no measurement on that GPU.
func slotContexts(b []byte, used []uint64) []RegionContexts {
	var out []RegionContexts
	twice := map[int]bool{}
	for i := 0; i < slotCtxRecords; i++ {
		w := binary.LittleEndian.Uint32(b[4*i:])
		if w == 0 {
			continue
		}
		g, n := int(w&0x7f)-1, (w>>7)&0x3f
		if g < 0 || g >= len(used) || n == 0 || n == ctxSaturated || uint64(w>>13)*ctxPage > used[g] {
			continue
		}
		if slices.ContainsFunc(out, func(c RegionContexts) bool { return c.GPU == g }) {
			twice[g] = true
			continue
		}
		out = append(out, RegionContexts{GPU: g, Count: n, Charged: uint64(w>>13) * ctxPage})
	}
	return slices.DeleteFunc(out, func(c RegionContexts) bool { return twice[c.GPU] })
}

func cstring(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}
