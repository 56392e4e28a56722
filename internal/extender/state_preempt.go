package extender

import (
	"cmp"
	"math"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/types"

	"github.com/tessera-gpu/tessera/internal/placement"
)

// The State's answer to the preemption verb (preempt.go): which of a node's pods free a GPU.

// maxVictimSearch bounds the pods whose subsets victimsFreeing tries (2^n fit checks of a node);
// past it, it adds pods greedily, lowest priority first.
const maxVictimSearch = 12

// victimsFreeing reports whether req fits the node once victims are gone (named nil), or else once
// some set of the victims and the node's other GPU pods of priority below the preemptor's are gone
// (named: the fewest budget violations by violations, then the fewest pods, then the lowest summed
// priority; past maxVictimSearch candidates, greedily by priority alone).
func (s *State) victimsFreeing(node string, victims []types.UID, req *placement.Request, below int32, violations func([]types.UID) int) (named []types.UID, ok bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.fitsWithoutLocked(node, victims, req) {
		return nil, true
	}
	// The candidates: the scheduler's victims (chosen by it below the preemptor's priority) and the
	// node's other GPU pods below it, lowest priority first, then by name.
	type cand struct {
		uid      types.UID
		priority int32
		key      string
	}
	var cands []cand
	seen := map[types.UID]bool{}
	for _, uid := range victims {
		if seen[uid] {
			continue
		}
		seen[uid] = true
		// A victim without a GPU (it frees CPU or memory) has no entry of its own: the scheduler
		// chose it below the preemptor, so it costs as the dearest pod that may go.
		c := cand{uid, below - 1, string(uid)}
		if p := s.pods[uid]; p != nil {
			c.priority, c.key = p.priority, p.key
		}
		cands = append(cands, c)
	}
	for uid, p := range s.podsOn[node] {
		if !seen[uid] && p.applied && !p.reserved && p.priority < below {
			cands = append(cands, cand{uid, p.priority, p.key})
		}
	}
	slices.SortFunc(cands, func(a, b cand) int {
		if a.priority != b.priority {
			return cmp.Compare(a.priority, b.priority)
		}
		return strings.Compare(a.key, b.key)
	})
	chosen := make([]bool, len(cands))
	set := func() []types.UID { // the chosen candidates
		var out []types.UID
		for i := range cands {
			if chosen[i] {
				out = append(out, cands[i].uid)
			}
		}
		return out
	}
	if len(cands) > maxVictimSearch {
		// The shortest prefix that frees a GPU, then its pods given back, highest priority first,
		// where the rest still frees one (as the scheduler reprieves).
		for i := range cands {
			chosen[i] = true
			if !s.fitsWithoutLocked(node, set(), req) {
				continue
			}
			for j := i; j >= 0; j-- {
				chosen[j] = false
				if !s.fitsWithoutLocked(node, set(), req) {
					chosen[j] = true
				}
			}
			return set(), true
		}
		return nil, false
	}
	choose := func(mask uint64) (n int, sum int64) {
		for i := range cands {
			if chosen[i] = mask>>i&1 == 1; chosen[i] {
				n, sum = n+1, sum+int64(cands[i].priority)
			}
		}
		return n, sum
	}
	best, bestV, bestN, bestSum := uint64(0), math.MaxInt, len(cands)+1, int64(0)
	for mask := uint64(1); mask < 1<<len(cands); mask++ {
		n, sum := choose(mask)
		uids := set()
		v := violations(uids)
		if cmp.Or(cmp.Compare(v, bestV), cmp.Compare(n, bestN), cmp.Compare(sum, bestSum)) >= 0 || !s.fitsWithoutLocked(node, uids, req) {
			continue
		}
		best, bestV, bestN, bestSum = mask, v, n, sum
	}
	if best == 0 {
		return nil, false
	}
	choose(best)
	return set(), true
}

// fitsWithoutLocked reports whether req fits the node once the given pods' GPUs, CPU and memory are
// freed.
func (s *State) fitsWithoutLocked(node string, victims []types.UID, req *placement.Request) bool {
	e := s.nodes[node]
	if e == nil || e.inv == nil {
		return false
	}
	n := e.state.Clone()
	for _, uid := range victims {
		if p := s.pods[uid]; p != nil && p.node == node && p.applied {
			n.Release(&placement.Request{}, &p.placement)
		}
		if u := s.uses[uid]; u != nil && u.node == node && u.applied {
			n.AddUse(-u.cpu, -u.mem)
		}
	}
	_, unfit := placement.Candidates(n, req)
	return unfit == nil
}
