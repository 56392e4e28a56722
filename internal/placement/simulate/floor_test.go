package simulate

import (
	"math/rand/v2"
	"testing"
)

// TestPackingFloorKnownAnswers pins the floor on multisets whose best packing is known.
func TestPackingFloorKnownAnswers(t *testing.T) {
	for _, tc := range []struct {
		name  string
		items map[int]int // size -> count
		want  int64
	}{
		{"none", nil, 0},
		{"pairs fill GPUs", map[int]int{500: 4}, 0},
		{"no two fit together", map[int]int{600: 3}, 3*1000 - 1800},
		// 810s leave 190 that only the 160s fill: ten GPUs of 970.
		{"large with small fillers", map[int]int{810: 10, 160: 10}, 10*1000 - 9700},
		// The 160s cannot go beside the 900s (100 left): L2 with K = 160 counts them apart.
		{"fillers too large for the holes", map[int]int{900: 4, 160: 6}, 5*1000 - 4560},
		// One 200 beside three 900s: a fourth GPU, though the sum fits three.
		{"one filler too large", map[int]int{900: 3, 200: 1}, 4*1000 - 2900},
		// The 350s fit only the 600's room: one beside it, the other alone.
		{"room beside large ones counted", map[int]int{700: 2, 600: 1, 350: 2}, 4*1000 - 2700},
		// L2 is a bound, not the optimum: three GPUs are needed (two 400s each), it finds two.
		{"a bound below the optimum", map[int]int{400: 5}, 0},
	} {
		count := make([]int, 1000)
		for s, c := range tc.items {
			count[s] = c
		}
		if got := packingFloor(count); got != tc.want {
			t.Errorf("%s: floor %d, want %d", tc.name, got, tc.want)
		}
	}
}

// TestPackingFloorBelowOptimum: on random small multisets the floor never exceeds the waste of the
// best packing (found by trying every assignment), and matches it almost always (398 of 400).
func TestPackingFloorBelowOptimum(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	exact := 0
	for trial := range 400 {
		items := make([]int, 1+rng.IntN(7))
		count := make([]int, 1000)
		sum := 0
		for i := range items {
			items[i] = 1 + rng.IntN(999)
			count[items[i]]++
			sum += items[i]
		}
		best := optimalBins(items)
		opt := int64(best*1000 - sum)
		got := packingFloor(count)
		if got > opt {
			t.Fatalf("trial %d %v: floor %d above the optimum's waste %d", trial, items, got, opt)
		}
		if off := offlineWaste(count); off < opt || off%1000 != opt%1000 {
			t.Fatalf("trial %d %v: offline packer's waste %d, the optimum's %d: below it, or not whole GPUs apart", trial, items, off, opt)
		}
		if got == opt {
			exact++
		}
	}
	if exact < 380 {
		t.Fatalf("floor equals the optimum on %d of 400 small multisets: too loose to explain anything", exact)
	}
}

// optimalBins is the fewest GPUs that hold items, by trying every assignment.
func optimalBins(items []int) int {
	best := len(items)
	room := make([]int, 0, len(items))
	var place func(i int)
	place = func(i int) {
		if len(room) >= best {
			return
		}
		if i == len(items) {
			best = len(room)
			return
		}
		for b := range room {
			if room[b] >= items[i] {
				room[b] -= items[i]
				place(i + 1)
				room[b] += items[i]
			}
		}
		room = append(room, 1000-items[i])
		place(i + 1)
		room = room[:len(room)-1]
	}
	place(0)
	return best
}

// TestOfflineWasteKnownAnswers: best-fit decreasing on multisets where its packing is known.
func TestOfflineWasteKnownAnswers(t *testing.T) {
	for _, tc := range []struct {
		name  string
		items map[int]int
		want  int64
	}{
		{"none", nil, 0},
		{"pairs fill GPUs", map[int]int{500: 4}, 0},
		// 810s first, then each 160 into a 190 hole: ten GPUs of 970.
		{"fillers into the holes", map[int]int{810: 10, 160: 10}, 10*1000 - 9700},
		// Largest first: the 400 goes beside the 600 (its exact room), the 300 beside the 700.
		{"complements paired", map[int]int{700: 1, 600: 1, 400: 1, 300: 1}, 0},
		{"three 400s need two GPUs", map[int]int{400: 3}, 2*1000 - 1200},
	} {
		count := make([]int, 1000)
		for s, c := range tc.items {
			count[s] = c
		}
		if got := offlineWaste(count); got != tc.want {
			t.Errorf("%s: offline waste %d, want %d", tc.name, got, tc.want)
		}
	}
}
