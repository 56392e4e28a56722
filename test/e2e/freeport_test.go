package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// TestFreePortNeverRepeats: freePort does not hand out a port twice in a process (the kernel would,
// within a few hundred picks, and a port handed out may be bound only later), and hands out none
// from the kernel's ephemeral range, which outbound connections take from.
func TestFreePortNeverRepeats(t *testing.T) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		t.Fatal(err)
	}
	var elo, ehi int
	if _, err := fmt.Sscan(string(b), &elo, &ehi); err != nil {
		t.Fatalf("ip_local_port_range %q: %v", b, err)
	}
	seen := map[int]bool{}
	for range 2000 {
		p := freePort(t)
		if seen[p] {
			t.Fatalf("port %d handed out twice", p)
		}
		if p >= elo && p <= ehi {
			t.Fatalf("port %d is in the ephemeral range %d-%d", p, elo, ehi)
		}
		seen[p] = true
	}
}

// TestPickPortSkipsPortsOtherProcessesHold: a port another test process has locked in the register
// (here: another open file description of it) is never handed out, and is again once that
// process is gone (its description closed).
func TestPickPortSkipsPortsOtherProcessesHold(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ports.lock") // not the machine's register: others use that
	open := func() *os.File {
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o666)
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	mine, other := open(), open()
	defer mine.Close()
	lo, _ := portRange()
	lo += 5000 // away from the ports this package's other tests hand out first
	hi := lo + 10
	free := lo + 7
	for p := lo; p < hi; p++ {
		if p == free {
			continue
		}
		if ok, err := lockPort(other, p); !ok || err != nil {
			t.Fatalf("the other process could not lock %d: %v %v", p, ok, err)
		}
	}
	var used sync.Map
	got, err := pickPort(mine, lo, hi, &used)
	if err != nil || got != free {
		t.Fatalf("picked %d (%v), want %d: the only port the other process does not hold", got, err, free)
	}
	if p, err := pickPort(mine, lo, hi, &used); err == nil {
		t.Fatalf("picked %d though every port is handed out or held", p)
	}
	other.Close()
	if p, err := pickPort(mine, lo, hi, &used); err != nil || p == free {
		t.Fatalf("after the other process went: picked %d (%v), want a port it had held", p, err)
	}
}
