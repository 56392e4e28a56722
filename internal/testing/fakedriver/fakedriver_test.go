package fakedriver

import "testing"

// The fake's figures are its own (not vcuda's table) and ordered as real contexts are: newer
// architectures take more.
func TestContextBytes(t *testing.T) {
	var prev uint64
	for _, major := range []int{7, 8, 9} {
		n, err := ContextBytes(major)
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 || n%(2<<20) != 0 || n <= prev {
			t.Errorf("compute capability %d.x: %d bytes, want whole 2 MiB pages above %d", major, n, prev)
		}
		prev = n
	}
}
