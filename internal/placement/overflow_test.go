package placement

import (
	"math"
	"testing"
)

// TestSecurityMemoryOverflow: a GPU whose used memory sits near int64's end (or wrapped negative)
// has no room for a share; the check compares what is left and never wraps the sum, both when
// placing (shareRoom) and when re-checking a held placement (Fits).
func TestSecurityMemoryOverflow(t *testing.T) {
	c := ContainerShape{Name: "c", Shares: 1, Memory: 1 << 30, Milli: 100}
	r := &Request{Containers: []ContainerShape{c}}
	p := &Placement{Devices: []Device{{Container: 0, GPU: 0, Memory: c.Memory, Milli: c.Milli}}}
	for _, tc := range []struct {
		used int64
		room bool
	}{
		{39 << 30, true}, {39<<30 + 1, false}, {math.MaxInt64 - 1<<20, false}, {-1 << 40, false},
	} {
		if got := shareRoom(1000, 40<<30, tc.used, &c); got != tc.room {
			t.Errorf("shareRoom with %d of 40 GiB used = %v, want %v", tc.used, got, tc.room)
		}
		n := &NodeState{GPUs: []GPUState{{UUID: "GPU-0", Memory: 40 << 30, UsedMemory: tc.used, Usable: true}}}
		if got := Fits(n, r, p); got != tc.room {
			t.Errorf("Fits with %d of 40 GiB used = %v, want %v", tc.used, got, tc.room)
		}
	}
}
