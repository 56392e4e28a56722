package e2e

import "testing"

// TestFreePortNeverRepeats: freePort does not hand out a port twice in a process (the kernel would,
// within a few hundred picks, and a port handed out may be bound only later).
func TestFreePortNeverRepeats(t *testing.T) {
	seen := map[int]bool{}
	for range 2000 {
		p := freePort(t)
		if seen[p] {
			t.Fatalf("port %d handed out twice", p)
		}
		seen[p] = true
	}
}
