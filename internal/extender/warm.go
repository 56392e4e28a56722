package extender

import (
	"context"
	"runtime"
	"time"

	"github.com/tessera-gpu/tessera/internal/placement"
)

// The evaluation warmer keeps the memo (placement.Evaluator) current off the request path. Without it the
// next pod of a shape re-evaluates, inside its Filter call, every node that changed since the
// shape's last pod: for a shape last seen k pods ago, the ~2k nodes the binds and deletions in
// between touched; and after a shape-snapshot rebuild the first pod of every shape evaluates every
// node. Those calls were the tail of the latency distribution (issue 14). The warmer re-evaluates
// each changed node for the request shapes the memo holds, most recently used first, and after a
// rebuild fills the new snapshot's tables for the shapes used before it; it runs on one goroutine,
// so a Filter call always has the other cores, and holds the State's read lock for small batches
// only, so informer updates are not held up.

// DefaultWarmShapes is how many of the most recently used request shapes the warmer fills afresh
// for a new shape snapshot: a whole table costs about 5-7 ms of CPU at 5,000 nodes on the openb mix
// (four times that where shapes ask many GPU memory and compute sizes), so refilling every shape the
// memo held (up to ~240) would cost a second or more per snapshot; the rest get tables again when
// their next pod comes. Keeping tables current as nodes change is cheap (1-2.5 us per changed node
// and shape, a few changed nodes per pod) and covers every table the memo holds: the rare shapes
// are the ones whose next pod would otherwise meet thousands of changed nodes.
const DefaultWarmShapes = 32

// DefaultKeptShapes is how many of the most recently used request shapes the warmer keeps tables
// for across a new shape snapshot: DefaultWarmShapes of them filled before it serves, the rest
// right after, between calls. A shape past the staged ones otherwise lost its table at every
// snapshot and its next pod's call bounded every node (~2 ms at 4,852 nodes; live, ~290 of 1,500
// calls a run: 93 shapes, 177 snapshots while the cluster fills). The openb default trace has 126
// request shapes, a few dozen of them common; the warmer's cost is one table per shape kept and
// snapshot (about 1 ms at 4,852 nodes where nodes repeat, twinKey).
const DefaultKeptShapes = 96

func (x *Extender) warmShapes() int {
	if x.WarmShapes > 0 {
		return x.WarmShapes
	}
	return DefaultWarmShapes
}

func (x *Extender) keptShapes() int {
	if x.KeptShapes > 0 {
		return x.KeptShapes
	}
	return max(DefaultKeptShapes, x.warmShapes())
}

// warmBatch is how many node evaluations the warmer makes per hold of the State's read lock (about
// 0.1 ms): a writer (an informer event) or a filter call waits at most that long for it.
const warmBatch = 32

// warmYield is how often the warmer looks again whether the filter or prioritize calls in flight
// have finished.
const warmYield = 100 * time.Microsecond

// warmDelay is how long the warmer lets changes gather before a pass: one pod changes its node
// several times within microseconds (Filter's hold, then the bind's commit replacing it), and a node
// warmed between those would be warmed again; it also keeps the warmer off the cores while the
// Filter call that made the hold is still writing its reply.
const warmDelay = 5 * time.Millisecond

// warmRecheck is how often the warmer looks for a new shape snapshot when no node changes (pods
// that arrive and wait move the shape counts without touching a node).
const warmRecheck = time.Second

// RunWarmer keeps the evaluation memo warm until ctx ends (see the comment at the top of warm.go).
// While it runs, a rebuilt shape snapshot is staged: the warmer fills its tables, then promotes it.
func (x *Extender) RunWarmer(ctx context.Context) {
	wake := x.State.subscribeChanges()
	x.State.Shapes().StageSnapshots(true)
	defer x.State.Shapes().StageSnapshots(false)
	t := time.NewTicker(warmRecheck)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-wake:
			select {
			case <-ctx.Done():
				return
			case <-time.After(warmDelay):
			}
		case <-t.C:
		}
		x.warmOnce(ctx)
	}
}

// warmOnce brings the memo's tables up to date: a staged snapshot's tables for the shapes used most
// (warmShapes) are filled for every node and the snapshot promoted; then, when the snapshot is new,
// whole tables for the other shapes kept (keptShapes, most recently used first: those past the
// staged ones, or all where none were staged: staging off, or stageLimit passed); then every table
// of the serving snapshot for the nodes changed since the last pass.
func (x *Extender) warmOnce(ctx context.Context) {
	if x.Engine == nil {
		return
	}
	shapes := x.State.Shapes()
	if arrived := x.State.changes.takeArrivals(); len(arrived) > 0 {
		// First: a pod of a shape without a table waits for its Filter call.
		sc := shapes.ScoreContext()
		if fresh := x.eval.Expect(x.Engine, sc, x.State.nodeSlots(), arrived); len(fresh) > 0 {
			all := x.State.usableEntries()
			for _, wt := range fresh {
				if !x.warmNodes(ctx, sc, wt, all) {
					return
				}
			}
		}
	}
	if next := shapes.StagedScoreContext(); next != nil {
		if staged := x.eval.StagedTables(next, x.State.nodeSlots(), x.warmShapes()); len(staged) > 0 {
			all := x.State.usableEntries()
			for _, wt := range staged {
				if s := shapes.StagedScoreContext(); s == nil || s.Snapshot != next.Snapshot {
					break // a newer snapshot replaced it (the counts moved on): fill that one next pass
				}
				if !x.warmNodes(ctx, next, wt, all) {
					return
				}
			}
		}
		shapes.Promote(next.Snapshot)
	}
	sc := shapes.ScoreContext() // rebuilds (or promotes) the snapshot when due
	changed := x.State.takeChanges()
	tables, fresh := x.eval.WarmTables(sc, x.State.nodeSlots(), x.keptShapes())
	if len(fresh) > 0 {
		all := x.State.usableEntries()
		for _, wt := range fresh {
			if shapes.StagedScoreContext() != nil {
				// A newer snapshot waits: its staging goes first (the next pass). The tables left
				// unfilled are still the memo's and are refilled under it.
				return
			}
			if !x.warmNodes(ctx, sc, wt, all) {
				return
			}
		}
	}
	if len(changed) == 0 {
		return
	}
	for _, wt := range tables {
		if !x.warmNodes(ctx, sc, wt, changed) {
			return
		}
	}
}

// warmNodes evaluates wt's request on the entries whose outcome is not remembered, in batches
// under the State's read lock; false when ctx ended. Where pick-one Filter bounds the request, it
// bounds them instead (what that Filter reads first; the node bound data it computes serves every
// shape, so a shape never seen after a new snapshot finds it too).
func (x *Extender) warmNodes(ctx context.Context, sc *placement.ScoreContext, wt placement.WarmTable, entries []*nodeEntry) bool {
	bound := x.bounds(wt.Request)
	for start := 0; start < len(entries); start += warmBatch {
		// Filter and prioritize go first: the warmer waits while one is in flight, so it takes the
		// cores only between calls (a call waits at most for the batch under way).
		for x.calls.Load() > 0 {
			if ctx.Err() != nil {
				return false
			}
			time.Sleep(warmYield)
		}
		if ctx.Err() != nil {
			return false
		}
		x.State.viewEntries(entries[start:min(start+warmBatch, len(entries))], func(slot int, n *placement.NodeState) {
			x.eval.Warm(x.Engine, sc, wt, slot, n, bound)
		})
		runtime.Gosched() // let a waiting Filter call's goroutines run first
	}
	return true
}
