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
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

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
	// Partitions are the GPUs (UUIDs) the entry holds MIG instances on that the DRA driver creates
	// for it (dynamic MIG), from before the instances exist until after they are destroyed: while
	// any entry partitions a GPU, no entry gets it whole or shared, and the other way round.
	Partitions []string `json:"partitions,omitempty"`
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
	// AdminAccess lists the GPUs and MIG instances (UUIDs) the claim reaches with admin access
	// (monitoring): the container gets their device nodes, but nothing is charged or capped, so
	// they are not in the entry's Devices or MIG.
	AdminAccess []string `json:"adminAccess,omitempty"`
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
	l.syncLocked()
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
	// seen is the file as this process last read or wrote it. During a DaemonSet rolling update
	// with maxSurge two agents of one node share the file: each change is made under an flock of
	// path.lock on the file as it is on disk (syncLocked), so neither loses the other's.
	seen os.FileInfo
}

// maxCorruptCopies is how many copies of ledger files found corrupt or hostile are kept beside the
// ledger (the newest; each has a name of its own, so one never overwrites another).
const maxCorruptCopies = 8

// Open loads the ledger at path (a missing file is an empty ledger). A file that is not JSON, or
// holds entries that are corrupt (null, no container ID, an ID twice) or over-commit together with
// the entries before them, never stops the agent and is never lost: what loads is kept, a copy of
// the file is kept aside (keepAside) and log is told what was left out and why (nil: discarded).
// The running containers carry their entries (api.AnnotationLedgerEntry); Synchronize re-adopts
// them.
func Open(path string, log *slog.Logger) (*Ledger, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	l := &Ledger{path: path, entries: map[string]*Entry{}}
	l.seen, _ = os.Stat(path)
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return l, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read ledger: %w", err)
	}
	var f struct {
		APIVersion string            `json:"apiVersion"`
		Entries    []json.RawMessage `json:"entries"`
	}
	var refused []string
	if err := json.Unmarshal(data, &f); err != nil {
		refused = []string{err.Error()}
	} else if f.APIVersion != api.Version {
		return nil, fmt.Errorf("ledger %s has apiVersion %q, this agent reads %q", path, f.APIVersion, api.Version)
	} else {
		refused = l.load(f.Entries)
	}
	if len(refused) == 0 {
		return l, nil
	}
	aside, err := keepAside(path, data)
	if err != nil {
		return nil, err
	}
	log.Error("ledger is corrupt or over-commits; what loads is kept, the rest is left out (running containers are re-adopted at the runtime's Synchronize)",
		"path", path, "copiedTo", aside, "kept", len(l.entries), "leftOut", refused)
	if err := l.saveLocked(); err != nil {
		return nil, err
	}
	return l, nil
}

// load admits a ledger file's entries in the order saved (by container ID): each must decode to an
// entry with an ID of its own and must not over-commit with those admitted before it (the rules of
// Reserve that need no inventory). It returns what it refused, each naming the entry and why.
func (l *Ledger) load(raw []json.RawMessage) []string {
	var refused []string
	for i, r := range raw {
		var e *Entry
		err := json.Unmarshal(r, &e)
		switch {
		case err != nil:
			refused = append(refused, fmt.Sprintf("entries[%d]: %v", i, err))
		case e == nil:
			refused = append(refused, fmt.Sprintf("entries[%d]: null", i))
		case e.ContainerID == "":
			refused = append(refused, fmt.Sprintf("entries[%d]: no containerID", i))
		case l.entries[e.ContainerID] != nil:
			refused = append(refused, fmt.Sprintf("entries[%d] (%s): the container ID is listed twice", i, e.ContainerID))
		default:
			if err := l.checkLocked(e, nil, false); err != nil {
				refused = append(refused, fmt.Sprintf("entries[%d] (%s): %v", i, e.ContainerID, err))
				continue
			}
			l.entries[e.ContainerID] = e
		}
	}
	return refused
}

// keepAside writes a copy of a ledger file found corrupt or hostile beside it as
// <path>.corrupt-<UTC time>, a name no earlier copy has, and removes the oldest copies past
// maxCorruptCopies.
func keepAside(path string, data []byte) (string, error) {
	prefix := filepath.Base(path) + ".corrupt-"
	stamp := prefix + time.Now().UTC().Format("20060102T150405.000000000Z")
	aside := filepath.Join(filepath.Dir(path), stamp)
	for n := 1; ; n++ {
		if _, err := os.Lstat(aside); errors.Is(err, os.ErrNotExist) {
			break
		}
		aside = filepath.Join(filepath.Dir(path), fmt.Sprintf("%s-%d", stamp, n))
	}
	if err := fsatomic.WriteFile(aside, data, 0o600); err != nil {
		return "", fmt.Errorf("keep a copy of the corrupt ledger %s: %w", path, err)
	}
	dir, err := os.ReadDir(filepath.Dir(path))
	if err != nil {
		return aside, nil
	}
	var copies []string
	for _, d := range dir {
		if strings.HasPrefix(d.Name(), prefix) {
			copies = append(copies, d.Name())
		}
	}
	sort.Strings(copies) // by time
	for _, old := range copies[:max(0, len(copies)-maxCorruptCopies)] {
		_ = os.Remove(filepath.Join(filepath.Dir(path), old))
	}
	return aside, nil
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
	l.syncLocked()
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
	l.syncLocked()
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
	l.syncLocked()
	return l.usageLocked("")
}

// ClaimUsage is the part of Usage that prepared DRA claims hold: the kubelet does not count it
// against the device plugins' tokens, so the agent must.
func (l *Ledger) ClaimUsage() map[string]Usage {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.syncLocked()
	return l.usageOf(func(id string) bool { return IsClaim(id) })
}

// ClaimHeld is the set of MIG instances and mdev devices prepared DRA claims hold: as with
// ClaimUsage, the kubelet does not count them against the device plugins' devices, so the agent must.
func (l *Ledger) ClaimHeld() map[string]bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.syncLocked()
	held := map[string]bool{}
	for uuid, id := range l.holders("") {
		if IsClaim(id) {
			held[uuid] = true
		}
	}
	return held
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
	unlockFile := l.flock()
	defer unlockFile()
	l.syncLocked()
	prevFrom, hadFrom := l.entries[fromID]
	delete(l.entries, fromID)
	restore := func() {
		if hadFrom {
			l.entries[fromID] = prevFrom
		}
	}
	if err := l.checkLocked(&e, inv, false); err != nil {
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

// checkLocked refuses over-commit: every rule names the GPU and what holds it. With no inventory
// (a ledger file being loaded) the rules that need one (the GPU is here, usable, healthy, has the
// memory, offers the shares) are left out. held (Verify: an entry saved earlier, whose container
// may be running) leaves out the rules of what may change under a running container (the GPU
// became unhealthy, or is now in MIG mode or an mdev parent), keeping only the impossible.
func (l *Ledger) checkLocked(e *Entry, inv *api.NodeInventory, held bool) error {
	if err := e.listsTwice(); err != nil {
		return err
	}
	usage := l.usageLocked(e.ContainerID)
	for _, d := range e.Devices {
		var g *api.GPU
		if inv != nil {
			g = inv.GPUByUUID(d.UUID)
			switch {
			case g == nil:
				return fmt.Errorf("GPU %s is not on node %s", d.UUID, inv.Node)
			case held:
			case !g.Shareable():
				return fmt.Errorf("GPU %s is in MIG mode or an mdev parent; it cannot be given whole or shared", d.UUID)
			case !g.Healthy:
				return fmt.Errorf("GPU %s is unhealthy", d.UUID)
			}
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
		if g != nil && !api.FitsWithin(u.MemoryBytes, d.MemoryBytes, g.MemoryBytes) {
			return fmt.Errorf("GPU %s has %d bytes of memory and %d are already shared out; %d more would over-commit it", d.UUID, g.MemoryBytes, u.MemoryBytes, d.MemoryBytes)
		}
		if !api.FitsWithin(int64(u.Cores), int64(d.CoresPercent), api.MaxCoresPercent) {
			return fmt.Errorf("GPU %s has %d%% of its compute shared out; %d%% more would over-commit it", d.UUID, u.Cores, d.CoresPercent)
		}
		if inv != nil && u.Shares+1 > inv.SharesPerGPU {
			return fmt.Errorf("GPU %s already holds %d shares, the most it offers", d.UUID, u.Shares)
		}
		usage[d.UUID] = Usage{Shares: u.Shares + 1, MemoryBytes: addCapped(u.MemoryBytes, d.MemoryBytes), Cores: u.Cores + d.CoresPercent}
	}
	if err := l.checkPartitionsLocked(e, usage); err != nil {
		return err
	}
	holders := l.holders(e.ContainerID)
	for _, m := range append(append([]string{}, e.MIG...), e.Mdev...) {
		if other, ok := holders[m]; ok {
			return fmt.Errorf("device %s is already held by container %s", m, other)
		}
	}
	return nil
}

// checkPartitionsLocked keeps a GPU in one mode: MIG instances (Partitions) or whole/shared
// (Devices), never both, whoever holds them; usage is every other entry's, with e's own shares added.
func (l *Ledger) checkPartitionsLocked(e *Entry, usage map[string]Usage) error {
	partitioned := map[string]string{}
	for id, o := range l.entries {
		if id == e.ContainerID {
			continue
		}
		for _, g := range o.Partitions {
			partitioned[g] = id
		}
	}
	for _, d := range e.Devices {
		if other, ok := partitioned[d.UUID]; ok {
			return fmt.Errorf("GPU %s holds MIG instances Tessera created for %s; it can be given whole or shared only once they are released", d.UUID, other)
		}
		if slices.Contains(e.Partitions, d.UUID) {
			return fmt.Errorf("GPU %s cannot be both partitioned into MIG instances and given whole or shared to %s", d.UUID, e.ContainerID)
		}
	}
	for _, g := range e.Partitions {
		if u := usage[g]; u.Whole || u.Shares > 0 {
			return fmt.Errorf("GPU %s is held whole or in shares; MIG instances can be created on it only when nothing holds it", g)
		}
	}
	return nil
}

// Refused is an entry Verify left out, and why.
type Refused struct {
	Entry  Entry
	Reason string
}

// Verify checks the loaded entries against the node's inventory, which Open cannot know: each GPU
// an entry names is on this node, and its shares fit the GPU's memory and the shares per GPU. It
// admits the entries in the order of the file (by container ID, as Open loads them), so of two
// entries that over-commit a GPU together the one admitted first is kept and the later one is left
// out; the reason names both. An entry on a GPU that is unhealthy, in MIG mode or an mdev parent is
// kept: its container may still be running on it, and dropping the entry would hand the GPU to
// another pod. What is left out is logged with its container and reason, the file as it was is kept
// aside (keepAside), and the ledger is saved without it. Its container keeps running: Synchronize
// cannot re-adopt it (the same rules refuse it) and reports it as an unrealised GPU container
// (metric and Event telling to delete the pod).
func (l *Ledger) Verify(inv *api.NodeInventory, log *slog.Logger) ([]Refused, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	l.mu.Lock()
	before := l.entries
	ordered := make([]*Entry, 0, len(before))
	for _, e := range before {
		ordered = append(ordered, e)
	}
	sort.Slice(ordered, func(i, j int) bool { return ordered[i].ContainerID < ordered[j].ContainerID })
	l.entries = make(map[string]*Entry, len(before))
	var refused []Refused
	for _, e := range ordered {
		if err := l.checkLocked(e, inv, true); err != nil {
			refused = append(refused, Refused{Entry: *e, Reason: fmt.Sprintf("%v%s", err, l.sharersLocked(e))})
			continue
		}
		l.entries[e.ContainerID] = e
	}
	if len(refused) == 0 {
		l.entries = before
		l.mu.Unlock()
		return nil, nil
	}
	data, err := marshalFile(ordered)
	if err == nil {
		var aside string
		if aside, err = keepAside(l.path, data); err == nil {
			for _, r := range refused {
				log.Error("ledger entry left out: it is impossible on this node's GPUs (its container keeps running and is reported unrealised at Synchronize)",
					"container", r.Entry.ContainerID, "pod", r.Entry.Namespace+"/"+r.Entry.Pod, "name", r.Entry.Container,
					"reason", r.Reason, "copiedTo", aside)
			}
			err = l.saveLocked()
		}
	}
	if err != nil {
		l.entries = before
		l.mu.Unlock()
		return nil, err
	}
	fn := l.onChange
	l.mu.Unlock()
	if fn != nil {
		fn()
	}
	return refused, nil
}

// sharersLocked names the admitted entries that hold a GPU e names, for Verify's reasons.
func (l *Ledger) sharersLocked(e *Entry) string {
	gpus := map[string]bool{}
	for _, d := range e.Devices {
		gpus[d.UUID] = true
	}
	var ids []string
	for id, o := range l.entries {
		for _, d := range o.Devices {
			if gpus[d.UUID] {
				ids = append(ids, id)
				break
			}
		}
	}
	if len(ids) == 0 {
		return ""
	}
	sort.Strings(ids)
	return fmt.Sprintf(" (the GPU is held by %s, which the file lists before %s)", strings.Join(ids, ", "), e.ContainerID)
}

// listsTwice refuses an entry that names one device twice: a holder gets a GPU, MIG instance or
// mdev device once, as the holdings annotation the extender reads requires.
func (e *Entry) listsTwice() error {
	seen := map[string]bool{}
	for _, id := range e.deviceIDs() {
		if seen[id] {
			return fmt.Errorf("device %s is listed twice in the entry of %s; one holder gets a device once", id, e.ContainerID)
		}
		seen[id] = true
	}
	return nil
}

// deviceIDs are the UUIDs of everything the entry holds.
func (e *Entry) deviceIDs() []string {
	ids := make([]string, 0, len(e.Devices)+len(e.MIG)+len(e.Mdev))
	for _, d := range e.Devices {
		ids = append(ids, d.UUID)
	}
	return append(append(ids, e.MIG...), e.Mdev...)
}

// Release forgets a container and returns what it held.
func (l *Ledger) Release(containerID string) (Entry, bool, error) {
	l.mu.Lock()
	unlockFile := l.flock()
	defer unlockFile()
	l.syncLocked()
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
	entries := make([]*Entry, 0, len(l.entries))
	for _, e := range l.entries {
		entries = append(entries, e)
	}
	sort.Slice(entries, func(i, j int) bool { return entries[i].ContainerID < entries[j].ContainerID })
	data, err := marshalFile(entries)
	if err != nil {
		return err
	}
	if err := fsatomic.WriteFile(l.path, data, 0o600); err != nil {
		return fmt.Errorf("save ledger: %w", err)
	}
	l.seen, _ = os.Stat(l.path)
	return nil
}

// syncLocked reloads the entries when another process (the other agent of a rolling update)
// replaced the file since this one last read or wrote it; a file that cannot be read or parsed
// leaves the entries as they are (Open has admitted this ledger's content before).
func (l *Ledger) syncLocked() {
	st, err := os.Stat(l.path)
	if err != nil || (l.seen != nil && os.SameFile(st, l.seen) && st.ModTime().Equal(l.seen.ModTime()) && st.Size() == l.seen.Size()) {
		return
	}
	data, err := os.ReadFile(l.path)
	if err != nil {
		return
	}
	var f struct {
		APIVersion string            `json:"apiVersion"`
		Entries    []json.RawMessage `json:"entries"`
	}
	if err := json.Unmarshal(data, &f); err != nil || f.APIVersion != api.Version {
		return
	}
	fresh := &Ledger{entries: map[string]*Entry{}}
	fresh.load(f.Entries)
	l.entries, l.seen = fresh.entries, st
}

// flock takes the cross-process lock of changes (path.lock) and returns its release; a lock that
// cannot be taken (no such directory yet) leaves the change to the in-process mutex alone.
func (l *Ledger) flock() func() {
	f, err := os.OpenFile(l.path+".lock", os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return func() {}
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		return func() {}
	}
	return func() { f.Close() } // closing releases the lock
}

// marshalFile is the file holding entries, in the order given.
func marshalFile(entries []*Entry) ([]byte, error) {
	return json.MarshalIndent(file{APIVersion: api.Version, Entries: entries}, "", "  ")
}
