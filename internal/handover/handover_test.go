package handover

import (
	"bufio"
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"
)

// waitTimeout bounds every wait for something that must happen; it is no timing assertion.
const waitTimeout = 20 * time.Second

func options(dir, name string, busy *atomic.Int64) Options {
	o := Options{Dir: dir, Name: name, Interval: 5 * time.Millisecond}
	if busy != nil {
		o.busy = func() { busy.Add(1) }
	}
	return o
}

func waitClosed(t *testing.T, what string, ch <-chan struct{}) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(waitTimeout):
		t.Fatalf("%s did not happen within %v", what, waitTimeout)
	}
}

// waitCount waits until n has grown by at least more from its value now: evidence that the
// waiting side looked again and was still refused.
func waitCount(t *testing.T, what string, n *atomic.Int64, more int64) {
	t.Helper()
	want := n.Load() + more
	deadline := time.Now().Add(waitTimeout)
	for n.Load() < want {
		if time.Now().After(deadline) {
			t.Fatalf("%s: %d attempts, want at least %d", what, n.Load(), want)
		}
		time.Sleep(time.Millisecond)
	}
}

type taken struct {
	seat *Seat
	err  error
}

func takeAsync(ctx context.Context, o Options) <-chan taken {
	out := make(chan taken, 1)
	go func() {
		s, err := Take(ctx, o)
		out <- taken{s, err}
	}()
	return out
}

// TestNewAgentTakesOverOnlyOnceTheOldLetsGo: the old agent holds the seat; a new agent's claim
// makes it yield, but the new one holds the seat only after the old one released it, never both
// at once (the flock); the old one's duties run until then.
func TestNewAgentTakesOverOnlyOnceTheOldLetsGo(t *testing.T) {
	dir := t.TempDir()
	old, err := Take(context.Background(), options(dir, "old", nil))
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-old.Yielding():
		t.Fatal("the only agent is asked to yield")
	default:
	}
	var busy atomic.Int64
	newc := takeAsync(context.Background(), options(dir, "new", &busy))
	waitClosed(t, "the old agent seeing the new one's claim", old.Yielding())
	waitCount(t, "the new agent trying the seat while the old holds it", &busy, 3)
	select {
	case r := <-newc:
		t.Fatalf("the new agent took the seat while the old one still held it (err %v)", r.err)
	default:
	}
	old.Release()
	var r taken
	select {
	case r = <-newc:
	case <-time.After(waitTimeout):
		t.Fatal("the new agent did not take the released seat")
	}
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.seat.Release()
	select {
	case <-r.seat.Yielding():
		t.Fatal("the newest agent is asked to yield")
	default:
	}
	if !old.SuccessorSharesNetwork() {
		t.Error("two agents of one process: successor in another network namespace")
	}
	old.Release() // idempotent
}

// TestWaitingEndsWithContext: an agent that never gets the seat stops waiting when told to.
func TestWaitingEndsWithContext(t *testing.T) {
	dir := t.TempDir()
	holder, err := Take(context.Background(), options(dir, "holder", nil))
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Release()
	var busy atomic.Int64
	ctx, cancel := context.WithCancel(context.Background())
	c := takeAsync(ctx, options(dir, "waiter", &busy))
	waitCount(t, "the waiter trying the seat", &busy, 2)
	cancel()
	select {
	case r := <-c:
		if !errors.Is(r.err, context.Canceled) {
			t.Fatalf("Take after cancel: %v, want context.Canceled", r.err)
		}
	case <-time.After(waitTimeout):
		t.Fatal("Take did not return after its context ended")
	}
}

// TestKilledHolderFreesTheSeat: an agent killed with SIGKILL (no Release) holds the seat no
// longer: the kernel drops its flock, so the next agent takes over. The holder is another process,
// as on a node.
func TestKilledHolderFreesTheSeat(t *testing.T) {
	if dir := os.Getenv("TESSERA_HANDOVER_HOLD"); dir != "" {
		s, err := Take(context.Background(), Options{Dir: dir, Name: "child", Interval: 5 * time.Millisecond})
		if err != nil {
			os.Exit(2)
		}
		_ = s
		os.Stdout.WriteString("held\n")
		select {} // holds until killed, never releasing, ignoring claims
	}
	dir := t.TempDir()
	child := exec.Command(os.Args[0], "-test.run=^TestKilledHolderFreesTheSeat$")
	child.Env = append(os.Environ(), "TESSERA_HANDOVER_HOLD="+dir)
	out, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	defer child.Process.Kill()
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "held\n" {
		t.Fatalf("child: %q, %v", line, err)
	}
	var busy atomic.Int64
	c := takeAsync(context.Background(), options(dir, "next", &busy))
	waitCount(t, "the next agent trying the seat the child holds", &busy, 3)
	select {
	case r := <-c:
		t.Fatalf("took the seat a live process holds (err %v)", r.err)
	default:
	}
	if err := child.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	child.Wait()
	select {
	case r := <-c:
		if r.err != nil {
			t.Fatal(r.err)
		}
		r.seat.Release()
	case <-time.After(waitTimeout):
		t.Fatal("the seat of a killed holder was not taken")
	}
}

// TestListenWaitsForThePort: the holder of the seat waits for a metrics port another process
// holds (an agent of a release before the handover), and gets it once that one is gone; a claim
// by a newer agent ends the wait.
func TestListenWaitsForThePort(t *testing.T) {
	dir := t.TempDir()
	var busy atomic.Int64
	s, err := Take(context.Background(), options(dir, "new", &busy))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Release()
	other, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := other.Addr().String()
	got := make(chan error, 1)
	var ln net.Listener
	go func() {
		var err error
		ln, err = s.Listen(context.Background(), addr)
		got <- err
	}()
	waitCount(t, "Listen retrying the port in use", &busy, 3)
	select {
	case err := <-got:
		t.Fatalf("Listen returned while the port was in use: %v", err)
	default:
	}
	other.Close()
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
		ln.Close()
	case <-time.After(waitTimeout):
		t.Fatal("Listen did not take the freed port")
	}

	// Still waiting when a newer agent claims the seat: give up the wait.
	other, err = net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	go func() {
		_, err := s.Listen(context.Background(), addr)
		got <- err
	}()
	waitCount(t, "Listen retrying the port in use", &busy, 2)
	if err := writeClaim(filepath.Join(dir, claimName), Claim{ID: "newer", NetNS: netNS()}); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-got:
		if !errors.Is(err, ErrYielded) {
			t.Fatalf("Listen after a newer claim: %v, want ErrYielded", err)
		}
	case <-time.After(waitTimeout):
		t.Fatal("Listen kept waiting after a newer claim")
	}
}

// TestSuccessorInAnotherNetwork: a successor in its own network namespace (no hostNetwork) does
// not need this agent's metrics port, so the old agent may keep answering its own probes.
func TestSuccessorInAnotherNetwork(t *testing.T) {
	dir := t.TempDir()
	s, err := Take(context.Background(), options(dir, "old", nil))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Release()
	if s.SuccessorSharesNetwork() {
		t.Error("no successor yet, but one sharing the network reported")
	}
	if err := writeClaim(filepath.Join(dir, claimName), Claim{ID: "pod-net", NetNS: "net:[1]"}); err != nil {
		t.Fatal(err)
	}
	waitClosed(t, "yielding to the pod-network successor", s.Yielding())
	if s.SuccessorSharesNetwork() {
		t.Errorf("successor in net:[1], this agent in %q: reported sharing the network", netNS())
	}
}

// TestSeatKeptWhileClaimUnreadable pins the holder's watch of the claim on a synctest bubble's
// clock: a claim file gone (a hand-cleaned run directory) or without a claimant keeps the seat and
// the watch goes on looking; the next claim by another agent makes the holder yield within one
// interval; Release ends the watch (the bubble fails if it outlives it).
func TestSeatKeptWhileClaimUnreadable(t *testing.T) { synctest.Test(t, seatKeptWhileClaimUnreadable) }

func seatKeptWhileClaimUnreadable(t *testing.T) {
	dir := t.TempDir()
	o := options(dir, "holder", nil)
	s, err := Take(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Release()
	claim := filepath.Join(dir, claimName)
	holding := func(when string) {
		t.Helper()
		time.Sleep(10 * o.Interval)
		synctest.Wait()
		select {
		case <-s.Yielding():
			t.Fatalf("%s: the holder yielded", when)
		default:
		}
	}
	holding("own claim")
	if err := os.Remove(claim); err != nil {
		t.Fatal(err)
	}
	holding("claim file gone")
	if err := os.WriteFile(claim, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	holding("claim file empty")
	if err := writeClaim(claim, Claim{ID: "successor/1/x"}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(o.Interval * 3 / 2) // past the next look, not at its instant
	synctest.Wait()
	select {
	case <-s.Yielding():
	default:
		t.Fatal("an interval after another agent's claim the holder has not yielded")
	}
	if s.successor.ID != "successor/1/x" {
		t.Errorf("successor %q, want the claimant successor/1/x", s.successor.ID)
	}
}

// TestTakeSchedule pins Take's wait for a held seat on a synctest bubble's clock: the lock is
// tried at once, then once an interval and no more often; a released seat is taken at the next
// try; the context's end ends the wait at once with its error.
func TestTakeSchedule(t *testing.T) { synctest.Test(t, takeSchedule) }

func takeSchedule(t *testing.T) {
	dir := t.TempDir()
	o := options(dir, "holder", nil)
	holder, err := Take(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Release()
	var busy atomic.Int64 // synctest.Wait orders nothing for the race detector
	tries := func(when string, want int64) {
		t.Helper()
		synctest.Wait()
		if n := busy.Load(); n != want {
			t.Fatalf("%s: %d tries of the held seat, want %d", when, n, want)
		}
	}
	c := takeAsync(context.Background(), options(dir, "waiter", &busy))
	tries("at once", 1)
	time.Sleep(o.Interval / 2)
	tries("half an interval later", 1)
	time.Sleep(o.Interval)
	tries("an interval and a half later", 2)
	time.Sleep(3 * o.Interval)
	tries("four and a half intervals later", 5)
	holder.Release()
	synctest.Wait()
	select {
	case r := <-c:
		t.Fatalf("seat taken before the next try (err %v)", r.err)
	default:
	}
	time.Sleep(o.Interval)
	synctest.Wait()
	select {
	case r := <-c:
		if r.err != nil {
			t.Fatal(r.err)
		}
		defer r.seat.Release()
	default:
		t.Fatal("a released seat not taken at the next try")
	}
	tries("after taking the seat", 5)

	busy.Store(0)
	ctx, cancel := context.WithCancel(context.Background())
	c = takeAsync(ctx, options(dir, "late", &busy))
	time.Sleep(o.Interval * 3 / 2)
	tries("the late agent waiting", 2)
	cancel()
	synctest.Wait()
	select {
	case r := <-c:
		if !errors.Is(r.err, context.Canceled) {
			t.Fatalf("Take after its context ended: %v, want context.Canceled", r.err)
		}
	default:
		t.Fatal("Take still waiting after its context ended")
	}
	tries("after the context ended", 2)
}

// TestListenSchedule pins Listen's wait for a port in use on a synctest bubble's clock: it tries at
// once, then once an interval; a newer agent's claim ends the wait with ErrYielded the moment the
// holder sees it, not at Listen's next try; the context's end ends it with its error; an error other
// than the port in use is returned at once, without retrying.
func TestListenSchedule(t *testing.T) { synctest.Test(t, listenSchedule) }

func listenSchedule(t *testing.T) {
	dir := t.TempDir()
	var busy atomic.Int64
	o := options(dir, "holder", &busy)
	s, err := Take(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Release()
	other, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	addr := other.Addr().String()
	tries := func(when string, want int64) {
		t.Helper()
		synctest.Wait()
		if n := busy.Load(); n != want {
			t.Fatalf("%s: %d tries of the port in use, want %d", when, n, want)
		}
	}
	listen := func(ctx context.Context, addr string) <-chan error {
		got := make(chan error, 1)
		go func() {
			ln, err := s.Listen(ctx, addr)
			if ln != nil {
				ln.Close()
			}
			got <- err
		}()
		return got
	}
	returned := func(when string, got <-chan error) (error, bool) {
		t.Helper()
		synctest.Wait()
		select {
		case err := <-got:
			return err, true
		default:
			return nil, false
		}
	}

	// An error other than the port in use: returned from the first try.
	if err, ok := returned("a bad address", listen(context.Background(), "127.0.0.1:bad")); !ok || err == nil || errors.Is(err, ErrYielded) {
		t.Fatalf("Listen on a bad address: returned %v with %v, want its error at once", ok, err)
	}
	tries("a bad address", 0)

	// The context's end.
	ctx, cancel := context.WithCancel(context.Background())
	got := listen(ctx, addr)
	tries("at once", 1)
	time.Sleep(o.Interval * 3 / 2)
	tries("an interval and a half later", 2)
	cancel()
	if err, ok := returned("cancelled", got); !ok || !errors.Is(err, context.Canceled) {
		t.Fatalf("Listen after its context ended: returned %v with %v, want context.Canceled", ok, err)
	}

	// A newer claim, seen by the holder's watch (it looks at whole intervals since Take: 2) before
	// Listen's next try (Listen starts at 1¾ intervals, so it tries again at 2¾).
	busy.Store(0)
	time.Sleep(o.Interval / 4)
	got = listen(context.Background(), addr)
	tries("at once", 1)
	if err := writeClaim(filepath.Join(dir, claimName), Claim{ID: "newer", NetNS: netNS()}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(o.Interval * 3 / 4) // to 2½ intervals: past the watch's look, before Listen's try
	synctest.Wait()
	select {
	case <-s.Yielding():
	default:
		t.Fatal("the holder did not see the newer claim")
	}
	if err, ok := returned("claimed", got); !ok || !errors.Is(err, ErrYielded) {
		t.Fatalf("Listen once the seat was claimed: returned %v with %v, want ErrYielded at once", ok, err)
	}
	tries("after the claim", 1)
}
