// Package ledger is the node agent's persisted record of which container holds which GPU, share,
// MIG instance or mdev device. It is the node's last line against over-commit: Reserve refuses any
// entry that would give a GPU to two modes, a whole GPU to two containers, or more memory or
// compute than a GPU has. Every change is written to disk (temp file + rename) before it is
// acknowledged, so an agent restart or crash loses nothing.
package ledger

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"sort"
	"strings"
	"sync"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/fsatomic"
)

// Entry is what one container holds.
type Entry struct {
	ContainerID string `json:"containerID"`
	PodUID      string `json:"podUID"`
	Namespace   string `json:"namespace"`
	Pod         string `json:"pod"`
	Container   string `json:"container"`
	// SandboxID is the pod sandbox's runtime ID: a sandbox the runtime recovered after a restart
	// may report no pod metadata, but always its ID.
	SandboxID string `json:"sandboxID,omitempty"`
	// Devices are whole GPUs or shares.
	Devices []api.DeviceAssignment `json:"devices,omitempty"`
	// MIG and Mdev are the hardware-bound devices by UUID.
	MIG  []string `json:"mig,omitempty"`
	Mdev []string `json:"mdev,omitempty"`
	// Local is set when the agent placed the container itself (no assignment from the extender).
	Local bool `json:"local,omitempty"`
	// Claim is set on the entry of a prepared DRA ResourceClaim (ID ClaimID(uid)): its devices are
	// counted here, once, from NodePrepareResources until NodeUnprepareResources.
	Claim *Claim `json:"claim,omitempty"`
	// Claims are the UIDs of the prepared claims whose devices a container uses; those devices are
	// counted on the claims' entries, not again on the container's.
	Claims []string `json:"claims,omitempty"`
}

// Claim identifies a prepared DRA ResourceClaim and the pods it is reserved for
// (status.reservedFor when the kubelet asked to prepare it).
type Claim struct {
	UID       string   `json:"uid"`
	Namespace string   `json:"namespace"`
	Name      string   `json:"name"`
	PodUIDs   []string `json:"podUIDs"`
}

// ClaimPrefix marks the entries of prepared DRA claims.
const ClaimPrefix = "claim:"

// ClaimID is the ledger ID of a prepared claim's entry.
func ClaimID(uid string) string { return ClaimPrefix + uid }

// IsClaim reports whether an entry ID is a prepared claim's: only NodeUnprepareResources releases it.
func IsClaim(id string) bool { return strings.HasPrefix(id, ClaimPrefix) }

// ClaimByName returns the entry of the prepared claim namespace/name.
func (l *Ledger) ClaimByName(namespace, name string) (Entry, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, e := range l.entries {
		if e.Claim != nil && e.Claim.Namespace == namespace && e.Claim.Name == name {
			return *e, true
		}
	}
	return Entry{}, false
}

// Usage is how a GPU is used right now.
type Usage struct {
	Whole       bool
	Shares      int
	MemoryBytes int64
	Cores       int
}

// file is the on-disk format.
type file struct {
	APIVersion string   `json:"apiVersion"`
	Entries    []*Entry `json:"entries"`
}

// Ledger is safe for concurrent use.
type Ledger struct {
	path     string
	mu       sync.Mutex
	entries  map[string]*Entry
	onChange func()
}

// Open loads the ledger at path (a missing file is an empty ledger). log is told when a corrupt
// ledger is moved aside (nil: discarded).
func Open(path string, log *slog.Logger) (*Ledger, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	l := &Ledger{path: path, entries: map[string]*Entry{}}
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return l, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read ledger: %w", err)
	}
	var f file
	if err := json.Unmarshal(data, &f); err != nil {
		// The running containers carry their entries (api.AnnotationLedgerEntry); Synchronize re-adopts them.
		aside := path + ".corrupt"
		log.Error("ledger is corrupt; starting empty, running containers are re-adopted at the runtime's Synchronize", "path", path, "movedTo", aside, "err", err)
		if err := os.Rename(path, aside); err != nil {
			return nil, fmt.Errorf("move corrupt ledger %s aside: %w", path, err)
		}
		return l, nil
	}
	if f.APIVersion != api.Version {
		return nil, fmt.Errorf("ledger %s has apiVersion %q, this agent reads %q", path, f.APIVersion, api.Version)
	}
	for _, e := range f.Entries {
		l.entries[e.ContainerID] = e
	}
	return l, nil
}

// OnChange registers a callback run (outside the lock) after every committed change.
func (l *Ledger) OnChange(fn func()) {
	l.mu.Lock()
	l.onChange = fn
	l.mu.Unlock()
}

// Get returns a copy of the entry of a container.
func (l *Ledger) Get(containerID string) (Entry, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	e, ok := l.entries[containerID]
	if !ok {
		return Entry{}, false
	}
	return *e, true
}

// Entries returns copies of all entries, ordered by container ID.
func (l *Ledger) Entries() []Entry {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]Entry, 0, len(l.entries))
	for _, e := range l.entries {
		out = append(out, *e)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ContainerID < out[j].ContainerID })
	return out
}

// Usage returns the use of every GPU that is in use, by UUID.
func (l *Ledger) Usage() map[string]Usage {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.usageLocked("")
}

// ClaimUsage is the part of Usage that prepared DRA claims hold: the kubelet does not count it
// against the device plugins' tokens, so the agent must.
func (l *Ledger) ClaimUsage() map[string]Usage {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.usageOf(func(id string) bool { return IsClaim(id) })
}

func (l *Ledger) usageLocked(except string) map[string]Usage {
	return l.usageOf(func(id string) bool { return id != except })
}

// usageOf sums the entries whose ID passes keep.
func (l *Ledger) usageOf(keep func(id string) bool) map[string]Usage {
	u := map[string]Usage{}
	for id, e := range l.entries {
		if !keep(id) {
			continue
		}
		for _, d := range e.Devices {
			g := u[d.UUID]
			if d.Whole {
				g.Whole = true
			} else {
				g.Shares++
				g.MemoryBytes = addCapped(g.MemoryBytes, d.MemoryBytes)
				g.Cores = int(addCapped(int64(g.Cores), int64(d.CoresPercent)))
			}
			u[d.UUID] = g
		}
	}
	return u
}

// addCapped adds a share's amount to a usage total, stopping at math.MaxInt64 instead of wrapping
// negative (after which every share would fit); a negative amount, which only a damaged ledger file
// holds (checkLocked refuses it), counts as none.
func addCapped(total, more int64) int64 {
	if more <= 0 {
		return total
	}
	if total > math.MaxInt64-more {
		return math.MaxInt64
	}
	return total + more
}

// holders maps a MIG or mdev UUID to the container holding it.
func (l *Ledger) holders(except string) map[string]string {
	h := map[string]string{}
	for id, e := range l.entries {
		if id == except {
			continue
		}
		for _, m := range append(append([]string{}, e.MIG...), e.Mdev...) {
			h[m] = id
		}
	}
	return h
}

// Reserve records an entry after checking it against the inventory and every other entry; the same
// container ID may be reserved again (an idempotent retry of CreateContainer) with the same devices.
func (l *Ledger) Reserve(e Entry, inv *api.NodeInventory) error {
	return l.put("", e, inv)
}

// Move replaces the entry under fromID by e in one step, checking e against every other entry: a
// stopped container's devices become its pod's hold, and a restarted container takes its hold back,
// with no moment where another container could take them.
func (l *Ledger) Move(fromID string, e Entry, inv *api.NodeInventory) error {
	return l.put(fromID, e, inv)
}

// put records e, first taking away the entry under fromID ("": none, as no entry has an empty ID),
// and restores everything if the check or the save fails.
func (l *Ledger) put(fromID string, e Entry, inv *api.NodeInventory) error {
	if e.ContainerID == "" {
		return errors.New("ledger: an entry needs a container ID")
	}
	l.mu.Lock()
	prevFrom, hadFrom := l.entries[fromID]
	delete(l.entries, fromID)
	restore := func() {
		if hadFrom {
			l.entries[fromID] = prevFrom
		}
	}
	if err := l.checkLocked(&e, inv); err != nil {
		restore()
		l.mu.Unlock()
		return err
	}
	prev, had := l.entries[e.ContainerID]
	l.entries[e.ContainerID] = &e
	if err := l.saveLocked(); err != nil {
		if had {
			l.entries[e.ContainerID] = prev
		} else {
			delete(l.entries, e.ContainerID)
		}
		restore()
		l.mu.Unlock()
		return err
	}
	fn := l.onChange
	l.mu.Unlock()
	if fn != nil {
		fn()
	}
	return nil
}

// checkLocked refuses over-commit: every rule names the GPU and what holds it.
func (l *Ledger) checkLocked(e *Entry, inv *api.NodeInventory) error {
	usage := l.usageLocked(e.ContainerID)
	for _, d := range e.Devices {
		g := inv.GPUByUUID(d.UUID)
		switch {
		case g == nil:
			return fmt.Errorf("GPU %s is not on node %s", d.UUID, inv.Node)
		case !g.Shareable():
			return fmt.Errorf("GPU %s is in MIG mode or an mdev parent; it cannot be given whole or shared", d.UUID)
		case !g.Healthy:
			return fmt.Errorf("GPU %s is unhealthy", d.UUID)
		}
		u := usage[d.UUID]
		if u.Whole {
			return fmt.Errorf("GPU %s is already held whole by another container", d.UUID)
		}
		if d.Whole {
			if u.Shares > 0 {
				return fmt.Errorf("GPU %s holds %d shares; it cannot also be given whole", d.UUID, u.Shares)
			}
			continue
		}
		if d.MemoryBytes < 0 || d.CoresPercent < 0 {
			return fmt.Errorf("a share of GPU %s cannot have negative memory (%d bytes) or compute (%d%%)", d.UUID, d.MemoryBytes, d.CoresPercent)
		}
		if !api.FitsWithin(u.MemoryBytes, d.MemoryBytes, g.MemoryBytes) {
			return fmt.Errorf("GPU %s has %d bytes of memory and %d are already shared out; %d more would over-commit it", d.UUID, g.MemoryBytes, u.MemoryBytes, d.MemoryBytes)
		}
		if !api.FitsWithin(int64(u.Cores), int64(d.CoresPercent), api.MaxCoresPercent) {
			return fmt.Errorf("GPU %s has %d%% of its compute shared out; %d%% more would over-commit it", d.UUID, u.Cores, d.CoresPercent)
		}
		if u.Shares+1 > inv.SharesPerGPU {
			return fmt.Errorf("GPU %s already holds %d shares, the most it offers", d.UUID, u.Shares)
		}
		usage[d.UUID] = Usage{Shares: u.Shares + 1, MemoryBytes: u.MemoryBytes + d.MemoryBytes, Cores: u.Cores + d.CoresPercent}
	}
	holders := l.holders(e.ContainerID)
	for _, m := range append(append([]string{}, e.MIG...), e.Mdev...) {
		if other, ok := holders[m]; ok {
			return fmt.Errorf("device %s is already held by container %s", m, other)
		}
	}
	return nil
}

// Release forgets a container and returns what it held.
func (l *Ledger) Release(containerID string) (Entry, bool, error) {
	l.mu.Lock()
	e, ok := l.entries[containerID]
	if !ok {
		l.mu.Unlock()
		return Entry{}, false, nil
	}
	delete(l.entries, containerID)
	if err := l.saveLocked(); err != nil {
		l.entries[containerID] = e
		l.mu.Unlock()
		return Entry{}, false, err
	}
	fn := l.onChange
	l.mu.Unlock()
	if fn != nil {
		fn()
	}
	return *e, true, nil
}

// Retain releases every entry whose container is not in live and returns them (prepared claims
// are not containers: they stay).
func (l *Ledger) Retain(live map[string]bool) ([]Entry, error) {
	var gone []Entry
	for _, e := range l.Entries() {
		if live[e.ContainerID] || IsClaim(e.ContainerID) {
			continue
		}
		if _, ok, err := l.Release(e.ContainerID); err != nil {
			return gone, err
		} else if ok {
			gone = append(gone, e)
		}
	}
	return gone, nil
}

// saveLocked writes the ledger atomically: a crashed agent leaves the old or the new file, never
// half. There is no fsync on this hot path (CreateContainer): after a power loss no container is
// running, and the containers' own annotations are what Synchronize rebuilds the ledger from.
func (l *Ledger) saveLocked() error {
	f := file{APIVersion: api.Version, Entries: make([]*Entry, 0, len(l.entries))}
	for _, e := range l.entries {
		f.Entries = append(f.Entries, e)
	}
	sort.Slice(f.Entries, func(i, j int) bool { return f.Entries[i].ContainerID < f.Entries[j].ContainerID })
	data, err := json.MarshalIndent(f, "", "  ")
	if err != nil {
		return err
	}
	if err := fsatomic.WriteFile(l.path, data, 0o600); err != nil {
		return fmt.Errorf("save ledger: %w", err)
	}
	return nil
}
