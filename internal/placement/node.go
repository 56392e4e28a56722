package placement

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// MilliPerGPU is a whole GPU's compute in per-mille. Placement keeps compute in per-mille so the
// trace's gpu_milli shares are never rounded; the API's percent (tessera.dev/vgpu-cores) is x10.
const MilliPerGPU = 1000

// GPUState is what placement needs to know about one physical GPU: its size and what is committed on it.
type GPUState struct {
	UUID  string
	Index int
	Model string
	// Memory is the GPU's memory in bytes (0 in the simulator, where the trace has no GPU memory).
	Memory     int64
	UsedMemory int64
	// UsedMilli is the compute reserved by shares, per-mille.
	UsedMilli int
	// Shares is how many shares sit on the GPU; a GPU with shares is in shared mode and not offered whole.
	Shares int
	// MaxShares is how many shares the GPU takes at most (the node agent offers SharesPerGPU share
	// tokens per GPU and refuses one more); 0 is no limit (the simulator's trace has none).
	MaxShares int
	// Whole is set when one owner holds the GPU exclusively; it then takes no share.
	Whole bool
	// wholeApplied counts the whole-GPU applies not released yet, so that Apply and Release stay
	// inverses even when a state briefly counts two holders of one GPU (Whole stays set until both go).
	wholeApplied int
	// Usable is false for unhealthy GPUs and MIG-enabled GPUs (usable only through their instances).
	Usable bool
	// Gen is the compute capability x10 (70 for 7.0), 0 when unknown; lower means older.
	Gen int
	// modelID numbers Model process-wide (set by NodeState.Prepare; 0: not numbered), so that
	// fragmentation can key GPU states without hashing and comparing the model's name.
	modelID int32
}

// modelIDs numbers GPU model names (string -> int32, from 1).
var (
	modelIDs    sync.Map
	lastModelID atomic.Int32
)

func numberModel(model string) int32 {
	if id, ok := modelIDs.Load(model); ok {
		return id.(int32)
	}
	id, _ := modelIDs.LoadOrStore(model, lastModelID.Add(1))
	return id.(int32)
}

// FreeMilli is the compute a share could still reserve on the GPU.
func (g *GPUState) FreeMilli() int {
	if !g.Usable || g.Whole {
		return 0
	}
	return MilliPerGPU - g.UsedMilli
}

// shareSlotFree reports whether the GPU can take one more share by count (MaxShares).
func (g *GPUState) shareSlotFree() bool { return g.MaxShares == 0 || g.Shares < g.MaxShares }

// FreeWhole reports whether the GPU can be given whole: usable and in neither mode yet.
func (g *GPUState) FreeWhole() bool { return g.Usable && !g.Whole && g.Shares == 0 }

// NodeState is the free capacity of one node as placement sees it.
type NodeState struct {
	Name   string
	Labels map[string]string
	GPUs   []GPUState
	// Dist is the pairwise topology distance between GPUs (by position in GPUs), nil when unknown.
	Dist [][]int
	// CPUMilli and MemMiB are the node's CPU and host memory; 0 means not tracked here (the
	// kube-scheduler checks them itself; the simulator tracks them as hard constraints).
	CPUMilli, MemMiB int64
	UsedCPU, UsedMem int64
	// MIG and Mdev count the MIG instances per profile and mdev capacity per type (capacity checks only).
	MIG  map[string]int
	Mdev map[string]int
	// TypeID groups nodes whose hardware is identical as fragmentation sees it (GPU models, sizes and
	// health, CPU and memory); 0 is unknown. The simulator and State set it for the fragmentation cache.
	TypeID int
	// static caches facts of the hardware (valid when prepared; set by Prepare).
	static   nodeStatic
	prepared bool
	// usage is a digest of what is in use (UsedCPU, UsedMem, each GPU's counters), kept while
	// tracked: see UsageDigest.
	usage   uint64
	tracked bool
}

type nodeStatic struct {
	usable int
	maxMem int64
}

// Prepare caches the node's static facts for placement; call it after the GPUs are set up (their
// models, sizes and health), not while others may read the node.
func (n *NodeState) Prepare() {
	for i := range n.GPUs {
		n.GPUs[i].modelID = numberModel(n.GPUs[i].Model)
	}
	u, m := usableGPUs(n, &Request{})
	n.static, n.prepared = nodeStatic{usable: u, maxMem: m}, true
}

// TypeKey describes everything static that placement and scoring read from a node (CPU, memory,
// each GPU's model, size, health and generation, topology, MIG and mdev capacity); nodes with equal
// keys may share a TypeID. Names, UUIDs and labels are not part of it.
func (n *NodeState) TypeKey() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d/%d", n.CPUMilli, n.MemMiB)
	for i := range n.GPUs {
		g := &n.GPUs[i]
		fmt.Fprintf(&b, "|%q/%d/%t/%d/%d", g.Model, g.Memory, g.Usable, g.Gen, g.MaxShares)
	}
	fmt.Fprintf(&b, "|dist=%v|mig=%v|mdev=%v", n.Dist, n.MIG, n.Mdev) // %v prints maps sorted
	return b.String()
}

// NewNodeState builds the empty state of a node from its inventory.
func NewNodeState(inv *api.NodeInventory, labels map[string]string) *NodeState {
	n := &NodeState{Name: inv.Node, Labels: labels}
	pos := map[int]int{}
	for _, g := range inv.GPUs {
		pos[g.Index] = len(n.GPUs)
		n.GPUs = append(n.GPUs, GPUState{
			UUID: g.UUID, Index: g.Index, Model: g.Model, Memory: g.MemoryBytes, MaxShares: inv.SharesPerGPU,
			Usable: g.Healthy && g.Shareable(), Gen: parseGen(g.ComputeCapability),
		})
		if g.MIG != nil {
			for _, m := range g.MIG.Instances {
				if n.MIG == nil {
					n.MIG = map[string]int{}
				}
				n.MIG[m.Profile]++
			}
		}
		for _, t := range g.Mdev {
			if n.Mdev == nil {
				n.Mdev = map[string]int{}
			}
			n.Mdev[t.Name] += t.Available
		}
	}
	if len(inv.Links) > 0 {
		n.Dist = make([][]int, len(n.GPUs))
		for i := range n.Dist {
			n.Dist[i] = make([]int, len(n.GPUs))
			for j := range n.Dist[i] {
				if i != j {
					n.Dist[i][j] = api.LinkSystem.Distance()
				}
			}
		}
		for _, l := range inv.Links {
			a, b := pos[l.A], pos[l.B]
			n.Dist[a][b], n.Dist[b][a] = l.Kind.Distance(), l.Kind.Distance()
		}
	}
	n.Prepare()
	return n
}

// parseGen turns "8.0" into 80; unknown is 0.
func parseGen(cc string) int {
	major, minor, _ := strings.Cut(cc, ".")
	a, err := strconv.Atoi(major)
	if err != nil {
		return 0
	}
	b, _ := strconv.Atoi(minor)
	return a*10 + b
}

// GPUIndexByUUID returns the position of a GPU in GPUs, or -1.
func (n *NodeState) GPUIndexByUUID(uuid string) int {
	for i := range n.GPUs {
		if n.GPUs[i].UUID == uuid {
			return i
		}
	}
	return -1
}

// Clone returns a deep copy of the mutable parts (GPUs, usage); the rest is shared read-only.
func (n *NodeState) Clone() *NodeState {
	c := *n
	c.GPUs = append([]GPUState(nil), n.GPUs...)
	c.tracked = false
	return &c
}

// UsageDigest identifies what is in use on a node whose usage is tracked (TrackUsage): the sum of
// a keyed hash of each usage counter (CPU, memory, each GPU's whole holds, shares, compute and
// memory) with its value, kept up to date by Apply, Release and AddUse. Equal usage gives an equal
// digest whatever happened in between (a reservation released and the same placement committed),
// so an evaluation made at one digest holds while the digest does (the extender's memo); different
// usage collides with probability about 2^-64. Scratch states (Clone, the after-states of scoring)
// are not tracked: the hashing would cost every candidate placement.
func (n *NodeState) UsageDigest() uint64 { return n.usage }

// TrackUsage starts keeping the usage digest, from the counters as they are now.
func (n *NodeState) TrackUsage() {
	n.tracked, n.usage = true, 0
	n.count(counterCPU, 0, n.UsedCPU)
	n.count(counterMem, 0, n.UsedMem)
	for i := range n.GPUs {
		g, c := &n.GPUs[i], counterGPU+4*i
		n.count(c, 0, int64(g.wholeApplied))
		n.count(c+1, 0, int64(g.Shares))
		n.count(c+2, 0, int64(g.UsedMilli))
		n.count(c+3, 0, g.UsedMemory)
	}
}

// usageSeed keys the usage hash per process, so no input can be built to collide on purpose.
var usageSeed = rand.Uint64()

// usageTerm is counter i's part of the usage digest at value v (0 for 0, so a fresh state is 0).
func usageTerm(i int, v int64) uint64 {
	if v == 0 {
		return 0
	}
	return mix64(usageSeed ^ mix64(uint64(i)<<32^0x9e3779b97f4a7c15) ^ uint64(v))
}

// count moves counter i (counterCPU, counterMem, counterGPU+4*gpu+field) from old to v in the usage
// digest.
func (n *NodeState) count(i int, old, v int64) {
	if n.tracked && old != v {
		n.usage += usageTerm(i, v) - usageTerm(i, old)
	}
}

// Usage counter ids: CPU, memory, then four per GPU.
const (
	counterCPU = iota
	counterMem
	counterGPU
)

// FreeMilli is the node's free GPU compute (per-mille), counting whole-owned GPUs as used.
func (n *NodeState) FreeMilli() int {
	s := 0
	for i := range n.GPUs {
		s += n.GPUs[i].FreeMilli()
	}
	return s
}

// CapacityMilli is the node's usable GPU compute.
func (n *NodeState) CapacityMilli() int {
	s := 0
	for i := range n.GPUs {
		if n.GPUs[i].Usable {
			s += MilliPerGPU
		}
	}
	return s
}

// Apply commits a placement of r on the node.
func (n *NodeState) Apply(r *Request, p *Placement) { n.apply(r, p, 1) }

// AddUse charges (or with negative values releases) CPU and host memory that pods outside
// placement's own Apply hold on the node (the live extender counts every pod bound there).
func (n *NodeState) AddUse(cpuMilli, memMiB int64) {
	n.count(counterCPU, n.UsedCPU, n.UsedCPU+cpuMilli)
	n.count(counterMem, n.UsedMem, n.UsedMem+memMiB)
	n.UsedCPU += cpuMilli
	n.UsedMem += memMiB
}

// Release undoes Apply.
func (n *NodeState) Release(r *Request, p *Placement) { n.apply(r, p, -1) }

func (n *NodeState) apply(r *Request, p *Placement, sign int) {
	n.AddUse(int64(sign)*r.CPUMilli, int64(sign)*r.MemMiB)
	for _, d := range p.Devices {
		n.applyDevice(d, sign)
	}
}

func (n *NodeState) applyDevice(d Device, sign int) {
	g, c := &n.GPUs[d.GPU], counterGPU+4*d.GPU
	if d.Whole {
		n.count(c, int64(g.wholeApplied), int64(g.wholeApplied+sign))
		g.wholeApplied += sign
		g.Whole = g.wholeApplied > 0
		return
	}
	n.count(c+1, int64(g.Shares), int64(g.Shares+sign))
	n.count(c+2, int64(g.UsedMilli), int64(g.UsedMilli+sign*d.Milli))
	n.count(c+3, g.UsedMemory, g.UsedMemory+int64(sign)*d.Memory)
	g.Shares += sign
	g.UsedMilli += sign * d.Milli
	g.UsedMemory += int64(sign) * d.Memory
}
