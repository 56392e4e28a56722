package ledger

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	api "github.com/tessera-gpu/tessera/api/v1"
)

func uuid(i int) string { return fmt.Sprintf("GPU-%08x-0000-4000-8000-%012x", i, i) }

func testInventory() *api.NodeInventory {
	inv := &api.NodeInventory{APIVersion: api.Version, Node: "n", SharesPerGPU: 3}
	for i := 0; i < 3; i++ {
		inv.GPUs = append(inv.GPUs, api.GPU{UUID: uuid(i), Index: i, Model: "A100", MemoryBytes: 40 << 30, SMCount: 108, PCIBusID: fmt.Sprintf("0000:%02x:00.0", i), Minor: i, Healthy: true})
	}
	inv.GPUs[2].MIG = &api.MIG{}
	return inv
}

func share(i int, gib int64, cores int) api.DeviceAssignment {
	return api.DeviceAssignment{UUID: uuid(i), MemoryBytes: gib << 30, CoresPercent: cores}
}

func TestReserveRules(t *testing.T) {
	inv := testInventory()
	l, err := Open(filepath.Join(t.TempDir(), "ledger.json"), nil)
	if err != nil {
		t.Fatal(err)
	}
	must := func(e Entry) {
		t.Helper()
		if err := l.Reserve(e, inv); err != nil {
			t.Fatal(err)
		}
	}
	must(Entry{ContainerID: "a", Devices: []api.DeviceAssignment{share(0, 30, 60)}})
	must(Entry{ContainerID: "w", Devices: []api.DeviceAssignment{{UUID: uuid(1), Whole: true}}})
	must(Entry{ContainerID: "m", MIG: []string{"MIG-x"}})
	cases := []struct {
		name string
		e    Entry
		want string
	}{
		{"memory over-commit", Entry{ContainerID: "b", Devices: []api.DeviceAssignment{share(0, 11, 0)}}, "already shared out; 11811160064 more would over-commit it"},
		{"compute over-commit", Entry{ContainerID: "b", Devices: []api.DeviceAssignment{share(0, 1, 41)}}, "60% of its compute shared out; 41% more"},
		{"whole on shared", Entry{ContainerID: "b", Devices: []api.DeviceAssignment{{UUID: uuid(0), Whole: true}}}, "holds 1 shares; it cannot also be given whole"},
		{"share on whole", Entry{ContainerID: "b", Devices: []api.DeviceAssignment{share(1, 1, 0)}}, "already held whole"},
		{"whole twice", Entry{ContainerID: "b", Devices: []api.DeviceAssignment{{UUID: uuid(1), Whole: true}}}, "already held whole"},
		{"MIG GPU", Entry{ContainerID: "b", Devices: []api.DeviceAssignment{share(2, 1, 0)}}, "is in MIG mode"},
		{"unknown GPU", Entry{ContainerID: "b", Devices: []api.DeviceAssignment{share(9, 1, 0)}}, "is not on node n"},
		{"MIG twice", Entry{ContainerID: "b", MIG: []string{"MIG-x"}}, "device MIG-x is already held by container m"},
		{"no id", Entry{}, "needs a container ID"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if err := l.Reserve(tc.e, inv); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want %q", err, tc.want)
			}
			if _, ok := l.Get("b"); ok {
				t.Fatal("a refused entry was recorded")
			}
		})
	}
	// Share count limit: 3 shares per GPU in this inventory.
	must(Entry{ContainerID: "s2", Devices: []api.DeviceAssignment{share(0, 1, 0)}})
	must(Entry{ContainerID: "s3", Devices: []api.DeviceAssignment{share(0, 1, 0)}})
	if err := l.Reserve(Entry{ContainerID: "s4", Devices: []api.DeviceAssignment{share(0, 1, 0)}}, inv); err == nil || !strings.Contains(err.Error(), "already holds 3 shares") {
		t.Errorf("share count: %v", err)
	}
	// Re-reserving the same container (a retried CreateContainer) is not counted twice.
	must(Entry{ContainerID: "a", Devices: []api.DeviceAssignment{share(0, 30, 60)}})
	if u := l.Usage()[uuid(0)]; u.Shares != 3 || u.MemoryBytes != 32<<30 || u.Cores != 60 {
		t.Errorf("usage %+v", u)
	}
	// An unhealthy GPU takes nothing new.
	inv.GPUs[0].Healthy = false
	if err := l.Reserve(Entry{ContainerID: "z", Devices: []api.DeviceAssignment{share(0, 1, 0)}}, inv); err == nil || !strings.Contains(err.Error(), "unhealthy") {
		t.Errorf("unhealthy: %v", err)
	}
}

func TestPersistenceAndRetain(t *testing.T) {
	path := filepath.Join(t.TempDir(), "sub", "ledger.json")
	inv := testInventory()
	l, _ := Open(path, nil)
	changes := 0
	l.OnChange(func() { changes++ })
	for _, id := range []string{"a", "b", "c"} {
		if err := l.Reserve(Entry{ContainerID: id, Pod: "p-" + id, Devices: []api.DeviceAssignment{share(0, 1, 10)}}, inv); err != nil {
			t.Fatal(err)
		}
	}
	// A restarted agent reads the same ledger.
	again, err := Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := again.Entries(); len(got) != 3 || got[1].Pod != "p-b" || got[1].Devices[0].MemoryBytes != 1<<30 {
		t.Fatalf("reopened ledger: %+v", got)
	}
	gone, err := again.Retain(map[string]bool{"b": true})
	if err != nil || len(gone) != 2 || gone[0].ContainerID != "a" || gone[1].ContainerID != "c" {
		t.Fatalf("retain: %+v %v", gone, err)
	}
	if third, _ := Open(path, nil); len(third.Entries()) != 1 {
		t.Fatalf("release not persisted: %+v", third.Entries())
	}
	if e, ok, _ := again.Release("b"); !ok || e.Pod != "p-b" {
		t.Errorf("release: %+v %v", e, ok)
	}
	if _, ok, _ := again.Release("b"); ok {
		t.Error("released twice")
	}
	if changes != 3 {
		t.Errorf("OnChange ran %d times, want 3", changes)
	}
	// A corrupt ledger is moved aside and the agent starts empty (Synchronize re-adopts containers).
	os.WriteFile(path, []byte("{not json"), 0o644)
	var logged bytes.Buffer
	if l, err := Open(path, slog.New(slog.NewTextHandler(&logged, nil))); err != nil || len(l.Entries()) != 0 {
		t.Errorf("corrupt ledger: %v", err)
	}
	if !strings.Contains(logged.String(), "level=ERROR msg=\"ledger is corrupt") {
		t.Errorf("corrupt ledger not logged as an error: %q", logged.String())
	}
	if copies := corruptCopies(t, path); len(copies) != 1 || copies[0] != "{not json" {
		t.Errorf("corrupt ledger not kept aside: %q", copies)
	}
}

// corruptCopies returns the contents of the copies of corrupt ledgers kept beside path, oldest first.
func corruptCopies(t *testing.T, path string) []string {
	t.Helper()
	names, err := filepath.Glob(path + ".corrupt-*")
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(names)
	var out []string
	for _, n := range names {
		b, err := os.ReadFile(n)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, string(b))
	}
	return out
}

// A ledger file is the agent's to read at every start: a hostile or corrupt one (a null entry, an
// entry without an ID or listed twice, entries that over-commit a GPU or a MIG instance together)
// must neither panic Open (a crash loop) nor be taken as it is. What loads is kept, the rest is
// named in the log, the original is copied aside, and the ledger on disk is the clean one.
func TestSecurityLedgerHostileFile(t *testing.T) {
	g0, g1 := uuid(0), uuid(1)
	entry := func(id string, devs ...api.DeviceAssignment) string {
		b, _ := json.Marshal(Entry{ContainerID: id, PodUID: "p-" + id, Devices: devs})
		return string(b)
	}
	for _, tc := range []struct {
		name    string
		entries []string
		kept    []string
		why     []string
	}{
		{"null", []string{"null", entry("a", share(0, 1, 10))}, []string{"a"}, []string{"entries[0]: null"}},
		{"no ID", []string{entry(""), entry("a", share(0, 1, 10))}, []string{"a"}, []string{"entries[0]: no containerID"}},
		{"not an entry", []string{`"x"`, `{"containerID": 5}`, entry("a", share(0, 1, 10))}, []string{"a"}, []string{"entries[0]: json", "entries[1]: json"}},
		{"ID twice", []string{entry("a", share(0, 1, 10)), entry("a", api.DeviceAssignment{UUID: g1, Whole: true})}, []string{"a"},
			[]string{"entries[1] (a): the container ID is listed twice"}},
		{"whole twice", []string{entry("a", api.DeviceAssignment{UUID: g0, Whole: true}), entry("b", api.DeviceAssignment{UUID: g0, Whole: true}), entry("c", share(1, 1, 10))},
			[]string{"a", "c"}, []string{"entries[1] (b): GPU " + g0 + " is already held whole"}},
		{"whole and shared", []string{entry("a", share(0, 1, 10)), entry("b", api.DeviceAssignment{UUID: g0, Whole: true})}, []string{"a"},
			[]string{"entries[1] (b): GPU " + g0 + " holds 1 shares"}},
		{"compute over 100%", []string{entry("a", share(0, 1, 60)), entry("b", share(0, 1, 60))}, []string{"a"},
			[]string{"entries[1] (b): GPU " + g0 + " has 60% of its compute shared out"}},
		{"GPU twice in one entry", []string{entry("a", share(0, 1, 10), share(0, 1, 10))}, nil, []string{"entries[0] (a): device " + g0 + " is listed twice"}},
		{"MIG twice", []string{`{"containerID":"a","mig":["MIG-x"]}`, `{"containerID":"claim:b","mig":["MIG-x"]}`}, []string{"a"},
			[]string{"entries[1] (claim:b): device MIG-x is already held by container a"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "ledger.json")
			data := `{"apiVersion":"` + api.Version + `","entries":[` + strings.Join(tc.entries, ",") + `]}`
			if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
				t.Fatal(err)
			}
			var logged bytes.Buffer
			l, err := Open(path, slog.New(slog.NewTextHandler(&logged, nil)))
			if err != nil {
				t.Fatalf("Open: %v", err)
			}
			var kept []string
			for _, e := range l.Entries() {
				kept = append(kept, e.ContainerID)
			}
			if !slices.Equal(kept, tc.kept) {
				t.Errorf("kept %v, want %v", kept, tc.kept)
			}
			for _, w := range append([]string{"level=ERROR", "leftOut"}, tc.why...) {
				if !strings.Contains(logged.String(), w) {
					t.Errorf("log %q does not say %q", logged.String(), w)
				}
			}
			if copies := corruptCopies(t, path); len(copies) != 1 || copies[0] != data {
				t.Errorf("the original file was not copied aside: %q", copies)
			}
			// The ledger on disk is the clean one: the next start loads it with nothing to say.
			logged.Reset()
			again, err := Open(path, slog.New(slog.NewTextHandler(&logged, nil)))
			if err != nil || len(again.Entries()) != len(tc.kept) || logged.Len() != 0 {
				t.Errorf("reopened: %d entries, %v, log %q", len(again.Entries()), err, logged.String())
			}
		})
	}
}

// Each corrupt ledger found is kept under a name of its own, the newest maxCorruptCopies of them.
func TestSecurityLedgerCorruptCopiesKept(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.json")
	var want []string
	for i := range maxCorruptCopies + 2 {
		data := fmt.Sprintf("{not json %d", i)
		if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := Open(path, nil); err != nil {
			t.Fatal(err)
		}
		want = append(want, data)
		if i == 1 {
			if got := corruptCopies(t, path); !slices.Equal(got, want) {
				t.Fatalf("after two corrupt ledgers, copies %q, want both %q", got, want)
			}
		}
	}
	if got := corruptCopies(t, path); !slices.Equal(got, want[2:]) {
		t.Errorf("copies %q, want the newest %d: %q", got, maxCorruptCopies, want[2:])
	}
}

func TestSaveFailureKeepsMemoryAndDiskInStep(t *testing.T) {
	dir := t.TempDir()
	l, _ := Open(filepath.Join(dir, "ledger.json"), nil)
	inv := testInventory()
	if err := l.Reserve(Entry{ContainerID: "a", Devices: []api.DeviceAssignment{share(0, 1, 0)}}, inv); err != nil {
		t.Fatal(err)
	}
	// Make the directory unusable: the next change must fail and leave the ledger as it was.
	l.path = filepath.Join(dir, "ledger.json", "nested") // a path under a regular file
	if err := l.Reserve(Entry{ContainerID: "b", Devices: []api.DeviceAssignment{share(0, 1, 0)}}, inv); err == nil {
		t.Fatal("reserve succeeded although the ledger could not be saved")
	}
	if _, ok := l.Get("b"); ok {
		t.Error("unsaved entry kept in memory")
	}
	if _, _, err := l.Release("a"); err == nil {
		t.Fatal("release succeeded although the ledger could not be saved")
	}
	if _, ok := l.Get("a"); !ok {
		t.Error("unsaved release dropped the entry from memory")
	}
}

func TestPlaceLocally(t *testing.T) {
	inv := testInventory()
	l, _ := Open(filepath.Join(t.TempDir(), "l.json"), nil)
	l.Reserve(Entry{ContainerID: "a", Devices: []api.DeviceAssignment{share(1, 30, 0)}}, inv)
	// Best fit: the 5 GiB share goes to GPU 1 (10 GiB free) rather than the empty GPU 0.
	got, err := l.PlaceLocally(&api.ContainerRequest{Name: "c", Shares: 1, ShareMemoryBytes: 5 << 30, ShareCores: 20}, inv)
	if err != nil || len(got) != 1 || got[0].UUID != uuid(1) || got[0].MemoryBytes != 5<<30 || got[0].CoresPercent != 20 {
		t.Fatalf("share placed %+v %v", got, err)
	}
	// Two shares need two GPUs: 0 and 1 (2 is MIG).
	got, err = l.PlaceLocally(&api.ContainerRequest{Name: "c", Shares: 2, ShareMemoryPercent: 25}, inv)
	if err != nil || len(got) != 2 || got[0].MemoryBytes != 10<<30 {
		t.Fatalf("two shares %+v %v", got, err)
	}
	// A whole GPU only where nothing is shared: GPU 0.
	got, err = l.PlaceLocally(&api.ContainerRequest{Name: "c", WholeGPUs: 1}, inv)
	if err != nil || got[0].UUID != uuid(0) || !got[0].Whole {
		t.Fatalf("whole %+v %v", got, err)
	}
	if _, err := l.PlaceLocally(&api.ContainerRequest{Name: "c", WholeGPUs: 2}, inv); err == nil || !strings.Contains(err.Error(), "needs 2 GPUs but only 1") {
		t.Fatalf("two whole: %v", err)
	}
}

// TestSecurityOverflowingEntries: shares whose memory sums past int64 are refused rather than
// wrapping the GPU's usage negative (after which every later share fitted); entries that reach the
// ledger without its check (a hand-written or damaged file) make the usage stop at math.MaxInt64,
// so nothing more fits there. The entries are built directly, past api.ParsePodRequest's bound.
func TestSecurityOverflowingEntries(t *testing.T) {
	inv := testInventory()
	l, err := Open(filepath.Join(t.TempDir(), "ledger.json"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Reserve(Entry{ContainerID: "a", Devices: []api.DeviceAssignment{share(0, 10, 10)}}, inv); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		d    api.DeviceAssignment
		want string
	}{
		{api.DeviceAssignment{UUID: uuid(0), MemoryBytes: math.MaxInt64 - 5<<30, CoresPercent: 1}, "10737418240 are already shared out; 9223372031486066687 more would over-commit it"},
		{api.DeviceAssignment{UUID: uuid(0), MemoryBytes: 1 << 30, CoresPercent: math.MaxInt - 5}, "10% of its compute shared out"},
		{api.DeviceAssignment{UUID: uuid(0), MemoryBytes: -20 << 30}, "cannot have negative memory"},
	} {
		if err := l.Reserve(Entry{ContainerID: "b", Devices: []api.DeviceAssignment{tc.d}}, inv); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("share %+v: %v, want it refused with %q", tc.d, err, tc.want)
		}
	}
	if u := l.Usage()[uuid(0)]; u.MemoryBytes != 10<<30 || u.Cores != 10 || u.Shares != 1 {
		t.Errorf("usage after the refusals: %+v", u)
	}

	// GPU 1's memory summed past int64 by entries the check never saw: a ledger file is loaded
	// before the agent knows its GPUs, so memory cannot be checked at load (compute can: entries
	// over 100% are left out there, TestSecurityLedgerHostileFile), and the sum must stop at
	// math.MaxInt64 instead of wrapping negative.
	path := filepath.Join(t.TempDir(), "ledger.json")
	mem := api.DeviceAssignment{UUID: uuid(1), MemoryBytes: math.MaxInt64/2 + 1, CoresPercent: 1}
	cores := api.DeviceAssignment{UUID: uuid(0), MemoryBytes: 1 << 30, CoresPercent: math.MaxInt/2 + 1}
	data, err := json.Marshal(file{APIVersion: api.Version, Entries: []*Entry{{ContainerID: "w", Devices: []api.DeviceAssignment{cores}},
		{ContainerID: "x", Devices: []api.DeviceAssignment{mem}}, {ContainerID: "y", Devices: []api.DeviceAssignment{mem}},
		{ContainerID: "z", Devices: []api.DeviceAssignment{cores}}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if l, err = Open(path, nil); err != nil {
		t.Fatal(err)
	}
	if u := l.Usage(); u[uuid(1)].MemoryBytes != math.MaxInt64 || u[uuid(0)].Cores != 0 {
		t.Errorf("usage of entries summing past int64: %+v, want GPU 1's memory to stop at math.MaxInt64 and GPU 0's compute entries left out", u)
	}
	if err := l.Reserve(Entry{ContainerID: "c", Devices: []api.DeviceAssignment{share(1, 1, 1)}}, inv); err == nil || !strings.Contains(err.Error(), "would over-commit it") {
		t.Errorf("a share on the overflowed GPU 1: %v, want it refused", err)
	}
	// A pod bound by nodeName (no extender) asking for more than any GPU here has: refused with why.
	if _, err := l.PlaceLocally(&api.ContainerRequest{Name: "c", Shares: 1, ShareMemoryBytes: api.MaxShareMemoryBytes}, inv); err == nil ||
		!strings.Contains(err.Error(), "asks for 1125899906842624 bytes per share but the largest GPU on node n has 42949672960") {
		t.Errorf("a share larger than every GPU: %v", err)
	}
}

// Move replaces one entry by another in one step: the moved devices are checked against everyone
// else, and a refused move leaves the source as it was (persisted too).
func TestMove(t *testing.T) {
	inv := testInventory()
	path := filepath.Join(t.TempDir(), "ledger.json")
	l, err := Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Reserve(Entry{ContainerID: "c1", PodUID: "u", Container: "main", Devices: []api.DeviceAssignment{{UUID: uuid(0), Whole: true}}}, inv); err != nil {
		t.Fatal(err)
	}
	if err := l.Reserve(Entry{ContainerID: "other", Devices: []api.DeviceAssignment{share(1, 10, 10)}}, inv); err != nil {
		t.Fatal(err)
	}
	hold := Entry{ContainerID: "hold:u/main", PodUID: "u", Container: "main", Devices: []api.DeviceAssignment{{UUID: uuid(0), Whole: true}}}
	if err := l.Move("c1", hold, inv); err != nil {
		t.Fatalf("move to the hold: %v", err)
	}
	if _, ok := l.Get("c1"); ok {
		t.Error("the source entry is still there")
	}
	// Moving onto a GPU another container shares is refused; the hold stays.
	bad := Entry{ContainerID: "c2", PodUID: "u", Container: "main", Devices: []api.DeviceAssignment{{UUID: uuid(1), Whole: true}}}
	if err := l.Move("hold:u/main", bad, inv); err == nil {
		t.Fatal("a move that over-commits was accepted")
	}
	if _, ok := l.Get("hold:u/main"); !ok {
		t.Error("a refused move dropped the source entry")
	}
	again, err := Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := again.Get("hold:u/main"); !ok {
		t.Error("a refused move lost the source entry")
	}
	if _, ok := again.Get("c2"); ok {
		t.Error("a refused move was recorded")
	}
}

// Open cannot know the inventory, so a ledger file whose entries over-commit a GPU's memory or name
// a GPU the node lacks loads whole; Verify, after the first inventory, leaves those out (the later
// of two that over-commit together, with a reason naming both), logs and copies them aside, and
// keeps an entry on an unhealthy GPU, whose container may still run on it.
func TestSecurityLedgerVerifiedAgainstInventory(t *testing.T) {
	inv := testInventory()
	inv.GPUs[1].Healthy = false
	gone := "GPU-ffffffff-0000-4000-8000-ffffffffffff"
	entries := []*Entry{
		{ContainerID: "a", PodUID: "pa", Namespace: "ns", Pod: "pa", Devices: []api.DeviceAssignment{share(0, 30, 10)}},
		{ContainerID: "b", PodUID: "pb", Namespace: "ns", Pod: "pb", Devices: []api.DeviceAssignment{share(0, 30, 10)}},
		{ContainerID: "c", PodUID: "pc", Namespace: "ns", Pod: "pc", Devices: []api.DeviceAssignment{{UUID: gone, Whole: true}}},
		{ContainerID: "d", PodUID: "pd", Namespace: "ns", Pod: "pd", Devices: []api.DeviceAssignment{share(1, 1, 10)}},
	}
	data, err := marshalFile(entries)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "ledger.json")
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	l, err := Open(path, nil)
	if err != nil || len(l.Entries()) != 4 {
		t.Fatalf("Open kept %d entries, %v; want all 4 (the inventory is not known yet)", len(l.Entries()), err)
	}
	changed := 0
	l.OnChange(func() { changed++ })
	var logged bytes.Buffer
	refused, err := l.Verify(inv, slog.New(slog.NewTextHandler(&logged, nil)))
	if err != nil {
		t.Fatal(err)
	}
	var kept []string
	for _, e := range l.Entries() {
		kept = append(kept, e.ContainerID)
	}
	if !slices.Equal(kept, []string{"a", "d"}) {
		t.Errorf("kept %v, want [a d] (the earlier share, and the share on the unhealthy GPU)", kept)
	}
	if len(refused) != 2 || refused[0].Entry.ContainerID != "b" || refused[1].Entry.ContainerID != "c" {
		t.Fatalf("refused %+v, want b and c", refused)
	}
	for _, w := range []string{"GPU " + uuid(0) + " has 42949672960 bytes", "held by a", "before b"} {
		if !strings.Contains(refused[0].Reason, w) {
			t.Errorf("reason %q does not say %q", refused[0].Reason, w)
		}
	}
	if !strings.Contains(refused[1].Reason, "GPU "+gone+" is not on node n") {
		t.Errorf("reason %q does not name the missing GPU", refused[1].Reason)
	}
	for _, w := range []string{"level=ERROR", "container=b", "container=c", "copiedTo="} {
		if !strings.Contains(logged.String(), w) {
			t.Errorf("log %q does not say %q", logged.String(), w)
		}
	}
	if copies := corruptCopies(t, path); len(copies) != 1 || copies[0] != string(data) {
		t.Errorf("the ledger as it was is not kept aside: %q", copies)
	}
	if changed != 1 {
		t.Errorf("OnChange ran %d times, want 1 (holdings are published again)", changed)
	}
	again, err := Open(path, nil)
	if err != nil || len(again.Entries()) != 2 {
		t.Errorf("the ledger on disk holds %d entries (%v), want the 2 kept", len(again.Entries()), err)
	}
	// A verified ledger has nothing more to say, and writes nothing.
	if refused, err := again.Verify(inv, nil); err != nil || refused != nil || len(corruptCopies(t, path)) != 1 {
		t.Errorf("verified again: %v, %v, %d copies", refused, err, len(corruptCopies(t, path)))
	}
}

// A GPU is partitioned into MIG instances (dynamic MIG) or held whole or shared, never both: each
// refuses the other until it is released, and a claim cannot ask for both on one GPU.
func TestPartitionsExcludeWholeAndShares(t *testing.T) {
	inv := testInventory()
	l, err := Open(filepath.Join(t.TempDir(), "ledger.json"), nil)
	if err != nil {
		t.Fatal(err)
	}
	part := Entry{ContainerID: ClaimID("mig"), Partitions: []string{uuid(0)}, MIG: []string{"MIG-1"}}
	if err := l.Reserve(part, inv); err != nil {
		t.Fatal(err)
	}
	for _, d := range []api.DeviceAssignment{{UUID: uuid(0), Whole: true}, share(0, 4, 10)} {
		if err := l.Reserve(Entry{ContainerID: "c", Devices: []api.DeviceAssignment{d}}, inv); err == nil || !strings.Contains(err.Error(), "MIG instances") {
			t.Errorf("%+v on a partitioned GPU: %v, want refused", d, err)
		}
	}
	// A second instance on the same GPU is another partition, not a conflict.
	if err := l.Reserve(Entry{ContainerID: ClaimID("mig2"), Partitions: []string{uuid(0)}, MIG: []string{"MIG-2"}}, inv); err != nil {
		t.Errorf("a second MIG instance on a partitioned GPU: %v", err)
	}
	if err := l.Reserve(Entry{ContainerID: "s", Devices: []api.DeviceAssignment{share(1, 4, 10)}}, inv); err != nil {
		t.Fatal(err)
	}
	if err := l.Reserve(Entry{ContainerID: ClaimID("mig3"), Partitions: []string{uuid(1)}}, inv); err == nil || !strings.Contains(err.Error(), "nothing holds it") {
		t.Errorf("partitioning a shared GPU: %v, want refused", err)
	}
	if err := l.Reserve(Entry{ContainerID: ClaimID("both"), Partitions: []string{uuid(3)}, Devices: []api.DeviceAssignment{{UUID: uuid(3), Whole: true}}}, inv); err == nil {
		t.Error("one claim both partitioned and held GPU 3 whole")
	}
	for _, id := range []string{ClaimID("mig"), ClaimID("mig2")} {
		if _, _, err := l.Release(id); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.Reserve(Entry{ContainerID: "c", Devices: []api.DeviceAssignment{{UUID: uuid(0), Whole: true}}}, inv); err != nil {
		t.Errorf("GPU 0 whole once its MIG instances are released: %v", err)
	}
}

// Two agents of one node (a DaemonSet rolling update with maxSurge) share the ledger file: each
// sees the other's entries, is refused what the other holds, and neither's save drops the other's.
func TestTwoProcessesShareTheLedger(t *testing.T) {
	inv := testInventory()
	path := filepath.Join(t.TempDir(), "ledger.json")
	old, err := Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := old.Reserve(Entry{ContainerID: ClaimID("a"), Claim: &Claim{UID: "a"}, Devices: []api.DeviceAssignment{{UUID: uuid(0), Whole: true}}}, inv); err != nil {
		t.Fatal(err)
	}
	surge, err := Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := old.Reserve(Entry{ContainerID: ClaimID("b"), Claim: &Claim{UID: "b"}, Devices: []api.DeviceAssignment{share(1, 4, 10)}}, inv); err != nil {
		t.Fatal(err)
	}
	if _, ok := surge.Get(ClaimID("b")); !ok {
		t.Error("the new agent does not see a claim the old one prepared after it started")
	}
	if err := surge.Reserve(Entry{ContainerID: "c", Devices: []api.DeviceAssignment{{UUID: uuid(0), Whole: true}}}, inv); err == nil {
		t.Error("the new agent gave away GPU 0, which the old one holds whole")
	}
	if err := surge.Reserve(Entry{ContainerID: ClaimID("d"), Claim: &Claim{UID: "d"}, Devices: []api.DeviceAssignment{share(1, 4, 10)}}, inv); err != nil {
		t.Fatal(err)
	}
	if _, _, err := old.Release(ClaimID("a")); err != nil {
		t.Fatal(err)
	}
	final, err := Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, e := range final.Entries() {
		ids = append(ids, e.ContainerID)
	}
	if want := []string{ClaimID("b"), ClaimID("d")}; strings.Join(ids, ",") != strings.Join(want, ",") {
		t.Errorf("the file holds %v, want %v (each agent's changes kept)", ids, want)
	}
}
