package placement

import (
	"fmt"
	"slices"
	"sort"
	"strings"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// Device is one GPU given to one container of a request.
type Device struct {
	// Container indexes Request.Containers; GPU indexes NodeState.GPUs.
	Container int
	GPU       int
	Whole     bool
	// Memory (bytes) and Milli (per-mille compute) of a share.
	Memory int64
	Milli  int
}

// Placement is one feasible choice of GPUs for a request on a node.
type Placement struct {
	Devices []Device
}

// Unfit is why a request cannot be placed on a node; the message is shown to users as is.
type Unfit struct {
	// Unresolvable is set when no preemption on this node could help (static mismatch).
	Unresolvable bool
	Msg          string
}

func (u *Unfit) Error() string { return u.Msg }

func unfit(unresolvable bool, format string, args ...any) *Unfit {
	return &Unfit{Unresolvable: unresolvable, Msg: fmt.Sprintf(format, args...)}
}

// Unexplained unfits: callers that only need fit or not (scoring, the simulator) skip formatting
// a message for every node that does not fit.
var (
	unfitQuiet             = &Unfit{Msg: "does not fit"}
	unfitQuietUnresolvable = &Unfit{Unresolvable: true, Msg: "does not fit"}
)

// arena hands out placement memory that is reused from one node to the next (the hot loops of
// filter, prioritize and the simulator evaluate thousands of nodes per pod). A nil arena allocates.
// What it hands out is valid until reset.
type arena struct {
	devs  []Device
	cands []Placement
}

func (a *arena) reset() {
	if a != nil {
		a.devs, a.cands = a.devs[:0], a.cands[:0]
	}
}

// devices returns k zeroed devices.
func (a *arena) devices(k int) []Device {
	if a == nil {
		return make([]Device, k)
	}
	if len(a.devs)+k > cap(a.devs) {
		a.devs = make([]Device, 0, max(256, 2*k)) // earlier slices keep the old array
	}
	a.devs = a.devs[:len(a.devs)+k]
	out := a.devs[len(a.devs)-k : len(a.devs) : len(a.devs)]
	clear(out)
	return out
}

// placements returns an empty slice to append candidates to.
func (a *arena) placements() []Placement {
	if a == nil {
		return nil
	}
	return a.cands[:0]
}

// keep records the candidates slice so that its array is reused.
func (a *arena) keep(c []Placement) []Placement {
	if a != nil && cap(c) > cap(a.cands) {
		a.cands = c[:0]
	}
	return c
}

// Candidates returns the distinct feasible placements of r on n (GPUs in the same state are
// interchangeable, so only one of them is offered), or why there is none. It is the single
// placement core behind filter, prioritize, bind and the simulator.
func Candidates(n *NodeState, r *Request) ([]Placement, *Unfit) { return candidates(nil, n, r, true) }

// candidates is Candidates with placement memory from a (nil: allocated); without explain, an
// Unfit carries no message.
func candidates(a *arena, n *NodeState, r *Request, explain bool) ([]Placement, *Unfit) {
	if u := checkStatic(n, r, explain); u != nil {
		return nil, u
	}
	if n.CPUMilli > 0 && n.UsedCPU+r.CPUMilli > n.CPUMilli {
		if !explain {
			return nil, unfitQuiet
		}
		return nil, unfit(false, "insufficient CPU: %dm free, %dm requested", n.CPUMilli-n.UsedCPU, r.CPUMilli)
	}
	if n.MemMiB > 0 && n.UsedMem+r.MemMiB > n.MemMiB {
		if !explain {
			return nil, unfitQuiet
		}
		return nil, unfit(false, "insufficient memory: %dMi free, %dMi requested", n.MemMiB-n.UsedMem, r.MemMiB)
	}
	if !r.WantsGPU() {
		return a.keep(append(a.placements(), Placement{})), nil
	}
	if len(r.Containers) == 1 {
		c := &r.Containers[0]
		switch {
		case c.Whole == 0 && c.Shares == 1:
			return singleShare(a, n, r, c, explain)
		case c.Whole == 0:
			return multiShare(a, n, r, c, explain)
		case c.Shares == 0:
			var buf [16]int
			free := freeWholeInto(buf[:0], n, r)
			if len(free) < c.Whole {
				return nil, wholeUnfit(n, r, c.Whole, len(free), explain)
			}
			devs := a.devices(c.Whole)
			for k, g := range closestSet(n, free, c.Whole) {
				devs[k] = Device{Container: 0, GPU: g, Whole: true}
			}
			return a.keep(append(a.placements(), Placement{Devices: devs})), nil
		}
	}
	return greedy(n, r, explain)
}

// checkStatic rejects what no amount of freeing on this node would fix.
func checkStatic(n *NodeState, r *Request, explain bool) *Unfit {
	var usable int
	var maxMem int64
	if n.prepared && !r.modelRestricted() {
		usable, maxMem = n.static.usable, n.static.maxMem
	} else {
		usable, maxMem = usableGPUs(n, r)
	}
	need := 0
	for _, c := range r.Containers {
		need = max(need, c.Whole+c.Shares)
		for p, k := range c.MIG {
			if n.MIG[p] < k {
				if !explain {
					return unfitQuietUnresolvable
				}
				return unfit(true, "container %q asks for %d %s, node has %d such MIG instances", c.Name, k, api.MIGResource(p), n.MIG[p])
			}
		}
		for t, k := range c.Mdev {
			if n.Mdev[t] < k {
				if !explain {
					return unfitQuietUnresolvable
				}
				return unfit(true, "container %q asks for %d %s, node can create %d", c.Name, k, api.MdevResource(t), n.Mdev[t])
			}
		}
		if c.Shares > 0 && c.MemoryPercent == 0 && maxMem > 0 && c.Memory > maxMem {
			if !explain {
				return unfitQuietUnresolvable
			}
			return unfit(true, "container %q asks for %d MiB per share, the largest usable GPU here has %d MiB", c.Name, c.Memory>>20, maxMem>>20)
		}
		if c.Shares > 0 {
			if u := contextUnfit(n, r, &c, explain); u != nil {
				return u
			}
		}
	}
	if need == 0 {
		return nil
	}
	if !explain && (r.modelRestricted() && usable == 0 || need > usable) {
		return unfitQuietUnresolvable
	}
	if r.modelRestricted() && usable == 0 {
		models := map[string]bool{}
		for i := range n.GPUs {
			if n.GPUs[i].Usable {
				models[n.GPUs[i].Model] = true
			}
		}
		return unfit(true, "pod is restricted to GPU models %s, node has %s", r.modelConstraint(), strings.Join(sortedKeys(models), ","))
	}
	if need > usable {
		return unfit(true, "a container needs %d distinct GPUs, node has %d usable (healthy, without MIG, allowed model)", need, usable)
	}
	return nil
}

// usableGPUs counts the usable GPUs of allowed models and their largest memory.
func usableGPUs(n *NodeState, r *Request) (int, int64) {
	usable, maxMem := 0, int64(0)
	for i := range n.GPUs {
		g := &n.GPUs[i]
		if g.Usable && r.modelAllowed(g.Model) {
			usable++
			maxMem = max(maxMem, g.Memory)
		}
	}
	return usable, maxMem
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	if len(out) == 0 {
		return []string{"none"}
	}
	return out
}

// shareFits reports whether one share of c fits on g: room for it and a share slot left.
func shareFits(g *GPUState, r *Request, c *ContainerShape) bool {
	return shareRoomOn(g, r, c) && g.shareSlotFree()
}

// shareRoomOn is shareFits without the share-slot limit: fragmentation's per-GPU test, whose masks
// are memoised by a GPU state that does not hold the share count (a measure, not a fit: placement
// itself always asks shareFits).
func shareRoomOn(g *GPUState, r *Request, c *ContainerShape) bool {
	return g.Usable && !g.Whole && r.modelAllowed(g.Model) && shareRoom(g.FreeMilli(), g.Memory, g.UsedMemory, c) &&
		holdsContext(g, c.shareMemoryOn(g.Memory))
}

// slotsLeft is how many more shares g takes by count; -1 without a limit.
func slotsLeft(g *GPUState) int {
	if g.MaxShares == 0 {
		return -1
	}
	return max(g.MaxShares-g.Shares, 0)
}

// holdsContext reports whether a share of memory bytes on g can hold one CUDA context: vcuda fails
// every context creation under a cap below api.ContextOverheadBytes, so a smaller share is useless.
// GPUs of unknown size (the simulator's, whose shares take no memory) are not checked.
func holdsContext(g *GPUState, memory int64) bool {
	return g.Memory == 0 || memory >= api.ContextOverheadBytes(g.Gen/10)
}

// contextUnfit refuses a share container whose share is, on every usable GPU of an allowed model,
// too small to hold a CUDA context (holdsContext): no freeing on this node would help.
func contextUnfit(n *NodeState, r *Request, c *ContainerShape, explain bool) *Unfit {
	var need, got int64 // the least overhead among those GPUs, and the share there
	for i := range n.GPUs {
		g := &n.GPUs[i]
		if !g.Usable || !r.modelAllowed(g.Model) {
			continue
		}
		m := c.shareMemoryOn(g.Memory)
		if holdsContext(g, m) {
			return nil
		}
		if o := api.ContextOverheadBytes(g.Gen / 10); need == 0 || o < need {
			need, got = o, m
		}
	}
	if need == 0 {
		return nil
	}
	if !explain {
		return unfitQuietUnresolvable
	}
	what := fmt.Sprintf("%d MiB per share", got>>20)
	if c.MemoryPercent > 0 {
		what = fmt.Sprintf("%d%% of a GPU's memory per share (%d MiB here)", c.MemoryPercent, got>>20)
	}
	return unfit(true, "container %q asks for %s, below the %d MiB a CUDA context takes on this node's GPUs (vcuda could not create one); ask for at least %dMi of %s",
		c.Name, what, need>>20, need>>20, api.ResourceShareMemory)
}

// shareRoom reports whether a GPU with free compute and memory of which used is taken has room for
// one share of c (what shareFits asks beyond the GPU's mode and model). Memory is compared by what
// is left, never by a sum that could wrap past int64.
func shareRoom(free int, memory, used int64, c *ContainerShape) bool {
	return free >= c.Milli && (memory == 0 || api.FitsWithin(used, c.shareMemoryOn(memory), memory))
}

// interchangeable reports whether two GPUs are the same for placement: same model and size, same
// usage, same mode (the integer fields first: they usually differ, the model string rarely does).
func interchangeable(a, b *GPUState) bool {
	return a.UsedMilli == b.UsedMilli && a.UsedMemory == b.UsedMemory && (a.Shares > 0) == (b.Shares > 0) &&
		slotsLeft(a) == slotsLeft(b) && a.Memory == b.Memory && a.Gen == b.Gen && sameModel(a, b)
}

// sameModel compares the models by number where both GPUs have one (NodeState.Prepare), else by name.
func sameModel(a, b *GPUState) bool {
	if a.modelID != 0 && b.modelID != 0 {
		return a.modelID == b.modelID
	}
	return a.Model == b.Model
}

func singleShare(a *arena, n *NodeState, r *Request, c *ContainerShape, explain bool) ([]Placement, *Unfit) {
	out := a.placements()
	var seenBuf [16]int // GPUs offered so far
	seen := seenBuf[:0]
next:
	for i := range n.GPUs {
		g := &n.GPUs[i]
		if !shareFits(g, r, c) {
			continue
		}
		for _, j := range seen {
			if interchangeable(g, &n.GPUs[j]) {
				continue next
			}
		}
		seen = append(seen, i)
		d := a.devices(1)
		d[0] = Device{Container: 0, GPU: i, Memory: c.shareMemoryOn(g.Memory), Milli: c.Milli}
		out = append(out, Placement{Devices: d})
	}
	if len(out) == 0 {
		return nil, shareUnfit(n, r, c, 0, explain)
	}
	return a.keep(out), nil
}

// multiShare places one container's shares on distinct GPUs without a scratch copy (shares of one
// container never meet on a GPU, so each GPU's fit is independent of the others): once onto the
// fullest fitting GPUs and once onto the emptiest, exactly as greedy does.
func multiShare(a *arena, n *NodeState, r *Request, c *ContainerShape, explain bool) ([]Placement, *Unfit) {
	var fitBuf, sortBuf [16]int
	fit := fitBuf[:0]
	for i := range n.GPUs {
		if shareFits(&n.GPUs[i], r, c) {
			fit = append(fit, i)
		}
	}
	if len(fit) < c.Shares {
		return nil, shareUnfit(n, r, c, len(fit), explain)
	}
	pick := func(fullestFirst bool) []Device {
		order := append(sortBuf[:0], fit...)
		// Stable insertion sort by free compute (a node has few GPUs).
		for i := 1; i < len(order); i++ {
			for j := i; j > 0; j-- {
				a, b := n.GPUs[order[j]].FreeMilli(), n.GPUs[order[j-1]].FreeMilli()
				if fullestFirst && a >= b || !fullestFirst && a <= b {
					break
				}
				order[j], order[j-1] = order[j-1], order[j]
			}
		}
		out := a.devices(c.Shares)
		for k, i := range order[:c.Shares] {
			out[k] = Device{Container: 0, GPU: i, Memory: c.shareMemoryOn(n.GPUs[i].Memory), Milli: c.Milli}
		}
		return out
	}
	packed := pick(true)
	out := append(a.placements(), Placement{Devices: packed})
	if spread := pick(false); !slices.Equal(spread, packed) {
		out = append(out, Placement{Devices: spread})
	}
	return a.keep(out), nil
}

// shareUnfit explains why shares do not fit although the node may look sufficient in total.
func shareUnfit(n *NodeState, r *Request, c *ContainerShape, got int, explain bool) *Unfit {
	if !explain {
		return unfitQuiet
	}
	var freeMem int64
	freeMilli, locked, full, limit := 0, 0, 0, 0
	for i := range n.GPUs {
		g := &n.GPUs[i]
		if !g.Usable || !r.modelAllowed(g.Model) {
			continue
		}
		if g.Whole {
			locked++
			continue
		}
		if !g.shareSlotFree() {
			full, limit = full+1, g.MaxShares
		}
		freeMem += g.Memory - g.UsedMemory
		freeMilli += g.FreeMilli()
	}
	what := fmt.Sprintf("%d%% compute", c.Milli/10)
	if c.Memory > 0 {
		what = fmt.Sprintf("%d MiB and %s", c.Memory>>20, what)
	} else if c.MemoryPercent > 0 {
		what = fmt.Sprintf("%d%% memory and %s", c.MemoryPercent, what)
	}
	slots := ""
	if full > 0 {
		slots = fmt.Sprintf("; %d GPUs hold the most shares the node offers per GPU (%d)", full, limit)
	}
	return unfit(false, "container %q needs %d shares of %s on different GPUs; only %d GPUs can take one (free in total: %d MiB, %d%% compute; %d GPUs held whole%s)",
		c.Name, c.Shares, what, got, freeMem>>20, freeMilli/10, locked, slots)
}

func freeWhole(n *NodeState, r *Request) []int { return freeWholeInto(nil, n, r) }

func freeWholeInto(out []int, n *NodeState, r *Request) []int {
	for i := range n.GPUs {
		if n.GPUs[i].FreeWhole() && r.modelAllowed(n.GPUs[i].Model) {
			out = append(out, i)
		}
	}
	return out
}

func wholeUnfit(n *NodeState, r *Request, want, free int, explain bool) *Unfit {
	if !explain {
		return unfitQuiet
	}
	shared, owned := 0, 0
	for i := range n.GPUs {
		g := &n.GPUs[i]
		if !g.Usable || !r.modelAllowed(g.Model) {
			continue
		}
		if g.Whole {
			owned++
		} else if g.Shares > 0 {
			shared++
		}
	}
	return unfit(false, "needs %d whole GPUs; %d are free, %d are locked to shares, %d are held whole", want, free, shared, owned)
}

func wholeDevices(container int, gpus []int) []Device {
	out := make([]Device, len(gpus))
	for i, g := range gpus {
		out[i] = Device{Container: container, GPU: g, Whole: true}
	}
	return out
}

// closestSet picks k of the free GPUs with the smallest total pairwise topology distance
// (NVLink before PCIe switch before host bridge ...), greedily from every starting GPU.
func closestSet(n *NodeState, free []int, k int) []int {
	if n.Dist == nil || k <= 1 || k == len(free) {
		return free[:k] // callers copy
	}
	if len(free) > 64 {
		return closestSetSlow(n, free, k)
	}
	var setBuf, bestBuf [64]int
	bestCost := -1
	var best []int
	for _, start := range free {
		set := append(setBuf[:0], start)
		var in uint64 // positions in free already in set
		for i, g := range free {
			if g == start {
				in |= 1 << i
			}
		}
		cost := 0
		for len(set) < k {
			pick, pickPos, pickCost := -1, -1, 0
			for i, g := range free {
				if in&(1<<i) != 0 {
					continue
				}
				c := 0
				for _, s := range set {
					c += n.Dist[g][s]
				}
				if pick < 0 || c < pickCost {
					pick, pickPos, pickCost = g, i, c
				}
			}
			set = append(set, pick)
			in |= 1 << pickPos
			cost += pickCost
		}
		if bestCost < 0 || cost < bestCost {
			best, bestCost = append(bestBuf[:0], set...), cost
		}
	}
	out := slices.Clone(best)
	slices.Sort(out)
	return out
}

// closestSetSlow is closestSet for nodes with more than 64 free GPUs.
func closestSetSlow(n *NodeState, free []int, k int) []int {
	var best []int
	bestCost := -1
	for _, start := range free {
		set := []int{start}
		cost := 0
		for len(set) < k {
			pick, pickCost := -1, 0
			for _, g := range free {
				if slices.Contains(set, g) {
					continue
				}
				c := 0
				for _, s := range set {
					c += n.Dist[g][s]
				}
				if pick < 0 || c < pickCost {
					pick, pickCost = g, c
				}
			}
			set = append(set, pick)
			cost += pickCost
		}
		if bestCost < 0 || cost < bestCost {
			best, bestCost = set, cost
		}
	}
	sort.Ints(best)
	return best
}

// TopologyCost is the total pairwise distance of the GPUs a container got (0 for one GPU or no topology).
func TopologyCost(n *NodeState, p *Placement) int {
	if n.Dist == nil {
		return 0
	}
	cost := 0
	for i, a := range p.Devices {
		for _, b := range p.Devices[i+1:] {
			if a.Container == b.Container {
				cost += n.Dist[a.GPU][b.GPU]
			}
		}
	}
	return cost
}

// greedy places multi-share and multi-container requests container by container on a scratch copy,
// once packing shares onto the fullest GPUs that fit and once onto the emptiest; policies choose.
func greedy(n *NodeState, r *Request, explain bool) ([]Placement, *Unfit) {
	var out []Placement
	var firstErr *Unfit
	for _, packed := range []bool{true, false} {
		p, u := greedyOnce(n, r, packed, explain)
		if u != nil {
			if firstErr == nil {
				firstErr = u
			}
			continue
		}
		if len(out) == 0 || !slices.Equal(out[0].Devices, p.Devices) {
			out = append(out, p)
		}
	}
	if len(out) == 0 {
		return nil, firstErr
	}
	return out, nil
}

func greedyOnce(n *NodeState, r *Request, packed, explain bool) (Placement, *Unfit) {
	scratch := n.Clone()
	var p Placement
	for ci := range r.Containers {
		c := &r.Containers[ci]
		if c.Whole > 0 {
			free := freeWhole(scratch, r)
			if len(free) < c.Whole {
				return p, wholeUnfit(scratch, r, c.Whole, len(free), explain)
			}
			for _, d := range wholeDevices(ci, closestSet(scratch, free, c.Whole)) {
				scratch.applyDevice(d, 1)
				p.Devices = append(p.Devices, d)
			}
		}
		if c.Shares == 0 {
			continue
		}
		var fit []int
		for i := range scratch.GPUs {
			if shareFits(&scratch.GPUs[i], r, c) {
				fit = append(fit, i)
			}
		}
		if len(fit) < c.Shares {
			return p, shareUnfit(scratch, r, c, len(fit), explain)
		}
		sort.SliceStable(fit, func(a, b int) bool {
			fa, fb := scratch.GPUs[fit[a]].FreeMilli(), scratch.GPUs[fit[b]].FreeMilli()
			if packed {
				return fa < fb
			}
			return fa > fb
		})
		for _, i := range fit[:c.Shares] {
			d := Device{Container: ci, GPU: i, Memory: c.shareMemoryOn(scratch.GPUs[i].Memory), Milli: c.Milli}
			scratch.applyDevice(d, 1)
			p.Devices = append(p.Devices, d)
		}
	}
	return p, nil
}

// Fits reports whether the given placement of r is still feasible on n as n is now: every device on
// a usable GPU of an allowed model, whole GPUs free, shares with room, each device once, the
// request's CPU and memory within the node's (where tracked). It checks a choice made earlier (a
// Filter's hold) against fresher state, without choosing again.
func Fits(n *NodeState, r *Request, p *Placement) bool {
	if n.CPUMilli > 0 && n.UsedCPU+r.CPUMilli > n.CPUMilli || n.MemMiB > 0 && n.UsedMem+r.MemMiB > n.MemMiB {
		return false
	}
	want := 0
	for _, c := range r.Containers {
		want += c.Whole + c.Shares
	}
	if len(p.Devices) != want {
		return false
	}
	for i, d := range p.Devices {
		if d.GPU < 0 || d.GPU >= len(n.GPUs) || d.Container < 0 || d.Container >= len(r.Containers) {
			return false
		}
		for _, o := range p.Devices[:i] {
			if o.GPU == d.GPU && (o.Whole || d.Whole || o.Container == d.Container) {
				return false
			}
		}
		g := &n.GPUs[d.GPU]
		if d.Whole {
			if !g.FreeWhole() || !r.modelAllowed(g.Model) {
				return false
			}
			continue
		}
		// Shares of several containers on one GPU add up.
		milli, mem, count := d.Milli, d.Memory, 1
		for _, o := range p.Devices[:i] {
			if o.GPU == d.GPU {
				milli, mem, count = milli+o.Milli, mem+o.Memory, count+1
			}
		}
		if g.MaxShares > 0 && g.Shares+count > g.MaxShares {
			return false
		}
		if !g.Usable || g.Whole || !r.modelAllowed(g.Model) || g.FreeMilli() < milli || g.Memory > 0 && !api.FitsWithin(g.UsedMemory, mem, g.Memory) ||
			!holdsContext(g, d.Memory) {
			return false
		}
	}
	return true
}
