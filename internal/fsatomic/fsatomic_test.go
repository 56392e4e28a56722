package fsatomic

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
)

// TestWriteFileReplaces: the new content replaces the old with exactly the asked mode, and no
// temporary file stays behind.
func TestWriteFileReplaces(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "sub", "state.json")
	if err := WriteFile(path, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(path, []byte("new"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(path); err != nil || string(got) != "new" {
		t.Fatalf("content %q, %v; want %q", got, err, "new")
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o644 {
		t.Fatalf("mode %v, %v; want 0644", fi.Mode().Perm(), err)
	}
	onlyFile(t, filepath.Dir(path), "state.json")
}

// TestFailedWriteKeepsOld is the crash-safety promise: a write that fails half-way (after some
// bytes went out) leaves the old content in place and nothing else in the directory.
func TestFailedWriteKeepsOld(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "ledger.json")
	if err := WriteFile(path, []byte("old content"), 0o600); err != nil {
		t.Fatal(err)
	}
	boom := errors.New("disk full")
	err := Write(path, 0o600, func(w io.Writer) error {
		if _, err := w.Write([]byte("torn")); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("Write: %v, want %v", err, boom)
	}
	if got, err := os.ReadFile(path); err != nil || string(got) != "old content" {
		t.Fatalf("after a failed write: %q, %v; want the old content", got, err)
	}
	onlyFile(t, dir, "ledger.json")
}

// TestSymlinkReplaces: the link is swapped for one to the new target, and a link already there is
// replaced rather than refused.
func TestSymlinkReplaces(t *testing.T) {
	dir := t.TempDir()
	link := filepath.Join(dir, "hook")
	for _, target := range []string{"a", "b"} {
		if err := Symlink(target, link); err != nil {
			t.Fatal(err)
		}
		if got, err := os.Readlink(link); err != nil || got != target {
			t.Fatalf("link -> %q, %v; want %q", got, err, target)
		}
	}
	onlyFile(t, dir, "hook")
}

func onlyFile(t *testing.T, dir, name string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 1 || ents[0].Name() != name {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Fatalf("%s holds %v, want only %s", dir, names, name)
	}
}
