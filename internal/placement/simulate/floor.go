package simulate

import "github.com/tessera-gpu/tessera/internal/placement"

// packingFloor is a lower bound of the free compute (per-mille) that any placement of these GPU
// shares must leave on the GPUs that hold them: the Martello-Toth L2 lower bound of the number of
// GPUs (bins of placement.MilliPerGPU) they need, times a GPU, less their sum. count[s] is the number
// of shares asking s per-mille (0 < s < MilliPerGPU).
//
// Why it is a floor of the run's "partial" free compute: every GPU holding a share is one of at least
// that many, and its free compute is what its shares leave. CPU, memory and the GPU models only add
// constraints, so they can only raise the true minimum. At the 100% checkpoint the unallocated
// capacity is what failed before it, and the shares' floor is part of it whatever the policy
// (a policy can only lower it by failing shares, which costs their request instead).
//
// L2 (Martello and Toth, 1990): for each K in [0, C/2], the items larger than C-K each need a bin of
// their own that no item of K or more fits beside; those in (C/2, C-K] need one each too; the items
// in [K, C/2] fill the room the second kind leaves and need ceil(rest/C) more bins.
func packingFloor(count []int) int64 {
	const c = placement.MilliPerGPU
	var items, sum int64
	for s := 1; s < c && s < len(count); s++ {
		items += int64(count[s])
		sum += int64(count[s]) * int64(s)
	}
	if items == 0 {
		return 0
	}
	// n[s], v[s]: number and sum of the items of size s..c-1 (suffix sums).
	n := make([]int64, c+1)
	v := make([]int64, c+1)
	for s := c - 1; s >= 1; s-- {
		n[s], v[s] = n[s+1], v[s+1]
		if s < len(count) {
			n[s] += int64(count[s])
			v[s] += int64(count[s]) * int64(s)
		}
	}
	var bins int64
	for k := 1; k <= c/2; k++ {
		big := n[c-k+1]                               // size > c-k
		midN, midV := n[c/2+1]-big, v[c/2+1]-v[c-k+1] // c/2 < size <= c-k
		small := v[k] - v[c/2+1]                      // k <= size <= c/2
		lb := big + midN
		if rest := small - (midN*c - midV); rest > 0 {
			lb += (rest + c - 1) / c
		}
		bins = max(bins, lb)
	}
	bins = max(bins, (sum+c-1)/c) // L1, for K = 0 (the sizes below 1 per-mille do not occur)
	return bins*c - sum
}

// offlineWaste is the free compute best-fit decreasing leaves on the GPUs holding these shares: an
// offline packer that sees every share before placing any (largest first, each onto the GPU with the
// least room that takes it). No online policy is owed this figure; it shows how much of the distance
// from packingFloor an online policy could hope to close.
func offlineWaste(count []int) int64 {
	const c = placement.MilliPerGPU
	rooms := make([]int, c) // rooms[r]: GPUs opened with r per-mille free (r < c)
	var gpus, sum int64
	for s := min(len(count), c) - 1; s >= 1; s-- {
		for range count[s] {
			sum += int64(s)
			r := s
			for r < c && rooms[r] == 0 {
				r++
			}
			if r == c {
				gpus++ // a new GPU
			} else {
				rooms[r]--
			}
			rooms[r-s]++
		}
	}
	return gpus*c - sum
}
