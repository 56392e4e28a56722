package dra

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/tessera-gpu/tessera/internal/fsatomic"
	"github.com/tessera-gpu/tessera/internal/gpu"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// Dynamic MIG: each MIG-capable GPU Tessera may carve is published as a partitionable device
// (KEP-4815): the GPU itself (whole or shares) and every MIG profile at every placement, all
// consuming the GPU's shared counters (one per memory slice, plus its compute slices), so the
// scheduler's allocator never gives out two that overlap or a MIG instance beside the whole GPU.
// Prepare creates the allocated instance, unprepare destroys it; the journal records what Tessera
// created, so that start-up cleanup destroys that and nothing else.

// Partitioner is what dynamic MIG needs of NVML (gpu.Partitioner).
type Partitioner interface {
	Placements(uuid string) ([]gpu.MIGPlacement, uint32, error)
	Create(uuid string, p gpu.MIGPlacement) (gpu.MIGCreated, error)
	Destroy(uuid string, gi, ci int) error
	Instances(uuid string) ([]gpu.Instance, error)
}

// DynamicMIG turns dynamic MIG on (WithDynamicMIG).
type DynamicMIG struct {
	Partitioner Partitioner
	// MIGCapable says whether a GPU supports MIG (gpu.Node.MIGCapable).
	MIGCapable func(uuid string) bool
	// Refresh rediscovers the node after an instance came or went (the agent's Refresh): the new
	// instance's CDI spec, the device plugins' MIG resources and the whole GPU coming back.
	Refresh func(ctx context.Context) error
	// JournalPath is the file of the instances Tessera created (under the agent's state dir).
	JournalPath string
}

// Partitionable is a GPU dynamic MIG carves: its placements, its memory and compute slices, and
// which of its partition devices exist now (device name -> MIG UUID).
type Partitionable struct {
	Placements    []gpu.MIGPlacement
	MemorySlices  uint32
	ComputeSlices uint32
	Instances     map[string]string
}

// migRecord is one instance Tessera creates, written before the create (GPUInstance -1) and
// completed after it.
type migRecord struct {
	Claim           string `json:"claim"`
	Device          string `json:"device"`
	Parent          string `json:"parent"`
	Profile         string `json:"profile"`
	ProfileID       uint32 `json:"profileID"`
	Start           uint32 `json:"start"`
	GPUInstance     int    `json:"gpuInstance"`
	ComputeInstance int    `json:"computeInstance"`
	UUID            string `json:"uuid,omitempty"`
}

type dynamicMIG struct {
	DynamicMIG
	mu      sync.Mutex // serialises prepare and unprepare (creates, destroys, the journal)
	records []migRecord
	// placements are read once per GPU (they are fixed for a model).
	placements map[string]Partitionable
}

const journalVersion = "tessera.dev/v1"

type journalFile struct {
	APIVersion string      `json:"apiVersion"`
	Records    []migRecord `json:"records"`
}

// WithDynamicMIG turns dynamic MIG on. A journal that cannot be read stops it: without it Tessera
// would not know which instances are its own.
func (d *Driver) WithDynamicMIG(m DynamicMIG) (*Driver, error) {
	dm := &dynamicMIG{DynamicMIG: m, placements: map[string]Partitionable{}}
	if err := dm.loadLocked(); err != nil {
		return nil, err
	}
	d.mig = dm
	return d, nil
}

// loadLocked reads the journal: at start-up, and at every prepare and unprepare, since during a
// rolling update the other agent of the node may have changed it (the kubeletplugin helper
// serialises the calls of both through a file lock).
func (m *dynamicMIG) loadLocked() error {
	raw, err := os.ReadFile(m.JournalPath)
	switch {
	case errors.Is(err, os.ErrNotExist):
		m.records = nil
		return nil
	case err != nil:
		return fmt.Errorf("read the dynamic MIG journal: %w", err)
	}
	var f journalFile
	if err := json.Unmarshal(raw, &f); err != nil || f.APIVersion != journalVersion {
		return fmt.Errorf("the dynamic MIG journal %s is damaged (%v): it lists the MIG instances Tessera created; compare it with `nvidia-smi mig -lgi`, destroy what Tessera left, and remove the file", m.JournalPath, err)
	}
	m.records = f.Records
	return nil
}

func (m *dynamicMIG) saveLocked() error {
	raw, err := json.MarshalIndent(journalFile{APIVersion: journalVersion, Records: m.records}, "", "  ")
	if err != nil {
		return err
	}
	if err := fsatomic.WriteFile(m.JournalPath, raw, 0o600); err != nil {
		return fmt.Errorf("save the dynamic MIG journal: %w", err)
	}
	return nil
}

// PartitionDeviceName is the device of a MIG profile at a placement on GPU index (a DNS label:
// "1g.10gb+me" at slice 3 of GPU 0 is gpu-0-mig-1g-10gb-me-3).
func PartitionDeviceName(index int, p gpu.MIGPlacement) string {
	return "gpu-" + strconv.Itoa(index) + "-mig-" + strings.NewReplacer(".", "-", "+", "-").Replace(p.Profile) + "-" + strconv.Itoa(int(p.Start))
}

// partitionable is the node's GPUs dynamic MIG carves: MIG-capable, not an mdev parent, and
// holding no MIG instance Tessera did not create (an operator's MIG layout is left as it is).
func (d *Driver) partitionable() map[string]Partitionable {
	if d.mig == nil {
		return nil
	}
	m := d.mig
	inv := d.agent.Inventory()
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.loadLocked(); err != nil {
		d.log.Error("dynamic MIG journal", "err", err)
	}
	out := map[string]Partitionable{}
	for i := range inv.GPUs {
		g := &inv.GPUs[i]
		if len(g.Mdev) > 0 || !m.MIGCapable(g.UUID) {
			continue
		}
		own := map[string]string{}
		for _, r := range m.records {
			if r.Parent == g.UUID && r.UUID != "" {
				own[r.UUID] = r.Device
			}
		}
		foreign := false
		if g.MIG != nil {
			for _, in := range g.MIG.Instances {
				foreign = foreign || own[in.UUID] == ""
			}
		}
		if foreign {
			continue
		}
		p, ok := m.placements[g.UUID]
		if !ok {
			places, slices, err := m.Partitioner.Placements(g.UUID)
			if err != nil || len(places) == 0 {
				d.log.Warn("GPU left out of dynamic MIG: its MIG placements cannot be read", "gpu", g.UUID, "err", err)
				continue
			}
			p = Partitionable{Placements: places, MemorySlices: slices}
			for _, pl := range places {
				p.ComputeSlices = max(p.ComputeSlices, pl.ComputeSlices)
			}
			m.placements[g.UUID] = p
		}
		p.Instances = map[string]string{}
		for uuid, dev := range own {
			p.Instances[dev] = uuid
		}
		out[g.UUID] = p
	}
	return out
}

// placementOf finds the GPU and placement a partition device names.
func placementOf(dyn map[string]Partitionable, indexOf map[string]int, device string) (string, gpu.MIGPlacement, bool) {
	for uuid, p := range dyn {
		for _, pl := range p.Placements {
			if PartitionDeviceName(indexOf[uuid], pl) == device {
				return uuid, pl, true
			}
		}
	}
	return "", gpu.MIGPlacement{}, false
}

// pendingMIG is a partition device of a claim being prepared.
type pendingMIG struct {
	result    int // index into the prepared devices
	parent    string
	placement gpu.MIGPlacement
	device    string
}

// createPartitions creates the claim's MIG instances (or finds them, when a retried prepare
// already made them) once the ledger holds their GPUs, and returns their UUIDs in order. On any
// failure it destroys what this call created, so a claim never keeps part of its instances.
func (d *Driver) createPartitions(ctx context.Context, claim string, pending []pendingMIG) ([]string, error) {
	m := d.mig
	uuids := make([]string, len(pending))
	var created []migRecord
	rollback := func(err error) ([]string, error) {
		for _, r := range slices.Backward(created) {
			if derr := m.Partitioner.Destroy(r.Parent, r.GPUInstance, r.ComputeInstance); derr != nil {
				d.log.Error("cannot roll back a MIG instance of a failed prepare; it stays in the journal for the next start", "claim", claim, "gpu", r.Parent, "instance", r.UUID, "err", derr)
				continue
			}
			m.drop(r.Claim, r.Device)
		}
		if serr := m.saveLocked(); serr != nil {
			err = fmt.Errorf("%w (and %v)", err, serr)
		}
		if len(created) > 0 && m.Refresh != nil {
			if rerr := m.Refresh(ctx); rerr != nil {
				d.log.Error("rediscover after rolling back MIG instances", "err", rerr)
			}
		}
		return nil, err
	}
	for i, p := range pending {
		if r, ok := m.find(claim, p.device); ok && r.UUID != "" {
			uuids[i] = r.UUID
			continue
		}
		m.drop(claim, p.device) // an intent a crash left: start-up cleanup destroyed its instance
		m.records = append(m.records, migRecord{Claim: claim, Device: p.device, Parent: p.parent, Profile: p.placement.Profile,
			ProfileID: p.placement.ProfileID, Start: p.placement.Start, GPUInstance: -1})
		if err := m.saveLocked(); err != nil {
			m.drop(claim, p.device)
			return rollback(err)
		}
		c, err := m.Partitioner.Create(p.parent, p.placement)
		if err != nil {
			m.drop(claim, p.device)
			return rollback(fmt.Errorf("create MIG %s at memory slice %d of GPU %s: %w", p.placement.Profile, p.placement.Start, p.parent, err))
		}
		r := m.set(claim, p.device, c)
		created = append(created, r)
		if err := m.saveLocked(); err != nil {
			return rollback(err)
		}
		uuids[i] = c.UUID
	}
	if len(created) > 0 && m.Refresh != nil {
		if err := m.Refresh(ctx); err != nil {
			return rollback(fmt.Errorf("rediscover the new MIG instances: %w", err))
		}
	}
	return uuids, nil
}

// destroyPartitions destroys the claim's MIG instances; one still in use (NVML: IN_USE) fails the
// unprepare, which the kubelet retries, and keeps the claim's ledger entry.
func (d *Driver) destroyPartitions(ctx context.Context, claim string) error {
	m := d.mig
	var errs []error
	gone := 0
	for _, r := range slices.Clone(m.records) {
		if r.Claim != claim {
			continue
		}
		if err := m.destroy(r); err != nil {
			errs = append(errs, err)
			continue
		}
		m.drop(r.Claim, r.Device)
		gone++
	}
	if gone > 0 {
		if err := m.saveLocked(); err != nil {
			errs = append(errs, err)
		}
		if m.Refresh != nil {
			if err := m.Refresh(ctx); err != nil {
				errs = append(errs, fmt.Errorf("rediscover after destroying MIG instances: %w", err))
			}
		}
	}
	return errors.Join(errs...)
}

// destroy removes a recorded instance; one recorded before its create finished (no GPU instance
// ID) is found by its profile and placement.
func (m *dynamicMIG) destroy(r migRecord) error {
	ins, err := m.Partitioner.Instances(r.Parent)
	if err != nil {
		return err
	}
	gi, ci := r.GPUInstance, r.ComputeInstance
	if gi < 0 {
		i := slices.IndexFunc(ins, func(in gpu.Instance) bool { return in.ProfileID == r.ProfileID && in.Start == r.Start })
		if i < 0 {
			return nil // the create never happened
		}
		gi, ci = ins[i].GPUInstance, 0
		if len(ins[i].ComputeInstances) > 0 {
			ci = ins[i].ComputeInstances[0]
		}
	} else {
		// GPU instance IDs are reused: after a reboot the ID may be someone else's instance.
		i := slices.IndexFunc(ins, func(in gpu.Instance) bool { return in.GPUInstance == gi })
		if i < 0 || ins[i].UUIDs[ci] != r.UUID {
			return nil // ours is gone
		}
	}
	if err := m.Partitioner.Destroy(r.Parent, gi, ci); err != nil {
		return fmt.Errorf("destroy MIG %s (GPU instance %d) of GPU %s: %w", r.Profile, gi, r.Parent, err)
	}
	return nil
}

// cleanup runs at start-up: it destroys the instances the journal says Tessera created for claims
// the ledger no longer holds (a crash between a create and its ledger entry, or between an
// unprepare's destroy and its journal) and keeps those of prepared claims. Instances the journal
// does not list are someone else's and are never touched; no GPU is ever reset.
func (d *Driver) cleanupMIG(ctx context.Context, l *ledger.Ledger) {
	m := d.mig
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.loadLocked(); err != nil {
		d.log.Error("dynamic MIG start-up cleanup skipped", "err", err)
		return
	}
	gone := 0
	for _, r := range slices.Clone(m.records) {
		if _, held := l.Get(ledger.ClaimID(r.Claim)); held && r.UUID != "" {
			continue
		}
		if err := m.destroy(r); err != nil {
			d.log.Error("cannot destroy a MIG instance Tessera created for a claim that is gone; it stays in the journal for the next start", "claim", r.Claim, "gpu", r.Parent, "profile", r.Profile, "err", err)
			continue
		}
		d.log.Info("destroyed a MIG instance Tessera created for a claim that is gone", "claim", r.Claim, "gpu", r.Parent, "profile", r.Profile, "uuid", r.UUID)
		m.drop(r.Claim, r.Device)
		gone++
	}
	if gone == 0 {
		return
	}
	if err := m.saveLocked(); err != nil {
		d.log.Error("dynamic MIG journal", "err", err)
	}
	if m.Refresh != nil {
		if err := m.Refresh(ctx); err != nil {
			d.log.Error("rediscover after start-up MIG cleanup", "err", err)
		}
	}
}

func (m *dynamicMIG) find(claim, device string) (migRecord, bool) {
	i := slices.IndexFunc(m.records, func(r migRecord) bool { return r.Claim == claim && r.Device == device })
	if i < 0 {
		return migRecord{}, false
	}
	return m.records[i], true
}

func (m *dynamicMIG) drop(claim, device string) {
	m.records = slices.DeleteFunc(m.records, func(r migRecord) bool { return r.Claim == claim && r.Device == device })
}

func (m *dynamicMIG) set(claim, device string, c gpu.MIGCreated) migRecord {
	for i := range m.records {
		if r := &m.records[i]; r.Claim == claim && r.Device == device {
			r.GPUInstance, r.ComputeInstance, r.UUID = c.GPUInstance, c.ComputeInstance, c.UUID
			return *r
		}
	}
	return migRecord{}
}
