package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/tessera-gpu/tessera/internal/handover"
)

// nodeDuties are what only one agent of a node runs at a time (internal/handover): the NRI plugin
// and, when both agents share the node's network, the /metrics and /healthz listener. During a
// DaemonSet rolling update with maxSurge the new agent claims them as soon as its device plugins
// are registered; the old one then disconnects its NRI plugin, stops its device plugins (the
// kubelet keeps the new agent's endpoints), its memory guard and hold release, and closes its
// listener, and serves on only its DRA plugin until its pod is deleted.
type nodeDuties struct {
	seat   handover.Options
	listen string
	// serve starts /metrics and /healthz on ln.
	serve func(ln net.Listener) *http.Server
	// nri runs the NRI plugin until ctx ends.
	nri func(ctx context.Context) error
	// registered reports whether every device plugin is registered with the kubelet; the seat is
	// claimed once it is, or after registerWait.
	registered   func() bool
	registerWait time.Duration
	// handedOver stops what the agent runs beside the seat's duties once a newer agent has them
	// (the device plugins, the memory guard, the hold release).
	handedOver func()
	log        *slog.Logger
}

// run holds the seat and its duties until ctx ends, or until a newer agent claims them, after
// which it waits for ctx. It returns the NRI plugin's error, or nil.
func (d *nodeDuties) run(ctx context.Context) error {
	// Only a handover needs the wait: with nobody holding the seat (a node's first agent, one
	// restarted after a crash, a node without a kubelet yet) there is nothing to take over from,
	// and waiting would leave /metrics and NRI down for registerWait.
	if handover.Held(d.seat.Dir) {
		d.waitRegistered(ctx)
	}
	seat, err := handover.Take(ctx, d.seat)
	if err != nil {
		return ignoreCanceled(err)
	}
	defer seat.Release()
	ln, err := seat.Listen(ctx, d.listen)
	if errors.Is(err, handover.ErrYielded) {
		seat.Release()
		d.handedOver()
		<-ctx.Done()
		return nil
	}
	if err != nil {
		return ignoreCanceled(err)
	}
	srv := d.serve(ln)
	defer srv.Close()
	nctx, stopNRI := context.WithCancel(ctx)
	defer stopNRI()
	nriDone := make(chan error, 1)
	go func() { nriDone <- d.nri(nctx) }()
	select {
	case <-ctx.Done():
		stopNRI()
		return <-nriDone
	case err := <-nriDone:
		return err
	case <-seat.Yielding():
	}
	stopNRI()
	if err := <-nriDone; err != nil {
		d.log.Warn("NRI plugin stopping for the handover", "err", err)
	}
	d.handedOver()
	// A successor in its own network namespace does not need this port: the old pod keeps
	// answering its probes (its /healthz now says the NRI plugin is not connected).
	if seat.SuccessorSharesNetwork() {
		srv.Close()
	}
	seat.Release()
	d.log.Info("handed the NRI plugin and the metrics port over to a newer agent; serving the DRA plugin until stopped")
	<-ctx.Done()
	return nil
}

// waitRegistered waits, up to registerWait, for the device plugins to be registered, so the kubelet
// has this agent's endpoints before an older agent removes its own at the handover. It looks at
// once, then every registerPoll; the seat is claimed all the same once registerWait has passed.
func (d *nodeDuties) waitRegistered(ctx context.Context) {
	_ = wait.PollUntilContextTimeout(ctx, registerPoll, d.registerWait, true, func(context.Context) (bool, error) {
		return d.registered(), nil
	})
}

// registerPoll is how often waitRegistered looks at the device plugins' registration.
const registerPoll = 100 * time.Millisecond

func ignoreCanceled(err error) error {
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return fmt.Errorf("node duties: %w", err)
}
