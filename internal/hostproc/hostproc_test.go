package hostproc

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// TestStartTime: field 22 of a stat line, counted after the last ')' of the command name, which a
// process chooses (prctl PR_SET_NAME) and may fill with ") 1 2 3".
func TestStartTime(t *testing.T) {
	tail := "S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20 21\n"
	for line, want := range map[string]uint64{
		"42 (sleep) " + tail: 987654,
		"42 (a) b) 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21) " + tail: 987654,
		"42 (with space) " + tail: 987654,
	} {
		if got, err := StartTime([]byte(line)); err != nil || got != want {
			t.Errorf("%q: %d %v, want %d", line, got, err, want)
		}
	}
	for _, bad := range []string{"", "42 sleep S 1 2", "42 (x) S 1 2 3", "42 (x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 -5 20", "42 (x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 99999999999999999999999 20"} {
		if _, err := StartTime([]byte(bad)); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
	// This process's own stat parses, and agrees with itself.
	stat, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		t.Fatal(err)
	}
	if st, err := StartTime(stat); err != nil || st == 0 {
		t.Fatalf("own stat: %d %v", st, err)
	}
}

func FuzzStartTime(f *testing.F) {
	f.Add([]byte("42 (sleep) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20 21\n"))
	f.Add([]byte("42 (a) b) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21) 1\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		_, _ = StartTime(data) // never a panic: the command name is the process's to choose
	})
}

// TestIdentityOf: this process's identity read from the real /proc is its own PID namespace, its
// own pid and start time; a fake /proc whose ns link or NSpid line is not the kernel's form is an
// error, never a guess.
func TestIdentityOf(t *testing.T) {
	pid := uint32(os.Getpid())
	id, err := IdentityOf("/proc", pid)
	if err != nil {
		t.Fatal(err)
	}
	link, err := os.Readlink("/proc/self/ns/pid")
	if err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf("pid:[%d]", id.PIDNS); link != want || id.NSPID != uint64(pid) || id.Start == 0 {
		t.Fatalf("identity %+v; ns link %s, pid %d", id, link, pid)
	}
	root := t.TempDir()
	dir := filepath.Join(root, "7")
	os.MkdirAll(filepath.Join(dir, "ns"), 0o755)
	stat, _ := os.ReadFile("/proc/self/stat")
	os.WriteFile(filepath.Join(dir, "stat"), stat, 0o644)
	for _, c := range []struct{ link, status string }{
		{"net:[4026531840]", "NSpid:\t7\t1\n"},
		{"pid:[]", "NSpid:\t7\t1\n"},
		{"pid:[x]", "NSpid:\t7\t1\n"},
		{"pid:[4026532001]", "Name:\tsleep\n"},
		{"pid:[4026532001]", "NSpid:\n"},
		{"pid:[4026532001]", "NSpid:\t7\t99999999999\n"},
	} {
		os.Remove(filepath.Join(dir, "ns", "pid"))
		os.Symlink(c.link, filepath.Join(dir, "ns", "pid"))
		os.WriteFile(filepath.Join(dir, "status"), []byte(c.status), 0o644)
		if id, err := IdentityOf(root, 7); err == nil {
			t.Errorf("link %q, status %q: identity %+v", c.link, c.status, id)
		}
	}
	os.Remove(filepath.Join(dir, "ns", "pid"))
	os.Symlink("pid:[4026532001]", filepath.Join(dir, "ns", "pid"))
	os.WriteFile(filepath.Join(dir, "status"), []byte("Name:\tsleep\nNSpid:\t7\t1\n"), 0o644)
	if id, err := IdentityOf(root, 7); err != nil || id.PIDNS != 4026532001 || id.NSPID != 1 {
		t.Errorf("identity %+v, %v; want namespace 4026532001, pid 1", id, err)
	}
}
