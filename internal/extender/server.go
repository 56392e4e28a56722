package extender

import (
	"context"
	"fmt"
	"net/http"
	"time"

	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	"github.com/tessera-gpu/tessera/internal/telemetry"
)

// Handler serves the extender verbs (POST /filter, /prioritize, /bind, /preempt, JSON of
// k8s.io/kube-scheduler/extender/v1) and GET /healthz. ready reports readiness (informers synced):
// until then every verb answers 503, since an answer from a partial state could over-commit.
func (x *Extender) Handler(ready func() bool) http.Handler {
	mux := http.NewServeMux()
	synced := func(w http.ResponseWriter) bool {
		if ready != nil && !ready() {
			http.Error(w, "tessera-extender: informers not synced yet", http.StatusServiceUnavailable)
			return false
		}
		return true
	}
	// Under pick-one the leader holds the choices made so far (Filter's holds): one state decides,
	// and a replica passes filter, prioritize and preempt on to it. Only the leader binds, always.
	mux.HandleFunc("POST /filter", handle(x, synced, verb[extenderv1.ExtenderArgs, extenderv1.ExtenderFilterResult]{
		path: "/filter",
		busy: true,
		serve: func(_ context.Context, args *extenderv1.ExtenderArgs) (any, func(), error) {
			fr := x.filter(args)
			return fr, fr.release, nil
		},
		inBand: func(err error) *extenderv1.ExtenderFilterResult {
			return &extenderv1.ExtenderFilterResult{Error: err.Error()}
		},
	}))
	mux.HandleFunc("POST /prioritize", handle(x, synced, verb[extenderv1.ExtenderArgs, extenderv1.HostPriorityList]{
		path: "/prioritize",
		busy: true,
		serve: func(_ context.Context, args *extenderv1.ExtenderArgs) (any, func(), error) {
			list, err := x.Prioritize(args)
			return list, nil, err
		},
	}))
	mux.HandleFunc("POST /bind", handle(x, synced, verb[extenderv1.ExtenderBindingArgs, extenderv1.ExtenderBindingResult]{
		path:   "/bind",
		always: true,
		serve: func(ctx context.Context, args *extenderv1.ExtenderBindingArgs) (any, func(), error) {
			res := &extenderv1.ExtenderBindingResult{}
			if err := x.Bind(ctx, args); err != nil {
				res.Error = err.Error()
			}
			return res, nil, nil
		},
		inBand: func(err error) *extenderv1.ExtenderBindingResult {
			return &extenderv1.ExtenderBindingResult{Error: err.Error()}
		},
	}))
	mux.HandleFunc("POST /preempt", handle(x, synced, verb[extenderv1.ExtenderPreemptionArgs, extenderv1.ExtenderPreemptionResult]{
		path: "/preempt",
		serve: func(_ context.Context, args *extenderv1.ExtenderPreemptionArgs) (any, func(), error) {
			return x.Preempt(args), nil, nil
		},
	}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		if ready != nil && !ready() {
			http.Error(w, "informers not synced", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}

// verb is what one extender verb does with its arguments A; R is the reply the leader answers
// when the verb is passed on.
type verb[A, R any] struct {
	path string
	// always: a non-leader passes the verb on whether or not the extender is pick-one.
	always bool
	// busy: the warmer waits while the request is in flight, from its first byte read to its
	// reply written (filter, prioritize), not only while Filter or Prioritize runs: decoding and
	// encoding allocate, and a call held up there (the garbage collector's assist) while the
	// warmer ran on was part of the replay's tail.
	busy bool
	// serve answers on this replica: the reply, what to do once it is written (or nil), and an
	// error answered as HTTP 500.
	serve func(ctx context.Context, args *A) (reply any, done func(), err error)
	// inBand is the reply that says the verb could not be passed on (nil: HTTP 502 says it).
	inBand func(err error) *R
}

// handle serves one verb: readiness, decoding (wire.go), passing on to the leader (leader.go) or
// serving here, and the reply.
func handle[A, R any](x *Extender, synced func(http.ResponseWriter) bool, v verb[A, R]) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if !synced(w) {
			return
		}
		if v.busy {
			x.calls.Add(1)
			defer x.calls.Add(-1)
		}
		var args A
		release, ok := x.decodeVerb(w, r, &args)
		if !ok {
			return
		}
		defer release()
		obs, _ := w.(CallObserver)
		decoded := time.Now()
		if (v.always || x.PickOne) && x.passOn(r) {
			res := new(R)
			if err := x.forward(r.Context(), v.path, &args, res); err != nil {
				if v.inBand == nil {
					http.Error(w, err.Error(), http.StatusBadGateway)
					return
				}
				res = v.inBand(err)
			}
			if obs != nil {
				obs.ObserveCall(decoded, time.Now(), replyResult(res))
			}
			x.reply(w, r, res)
			return
		}
		reply, done, err := v.serve(r.Context(), &args)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if done != nil {
			defer done()
		}
		if obs != nil {
			obs.ObserveCall(decoded, time.Now(), replyResult(reply))
		}
		x.reply(w, r, reply)
	}
}

// CallObserver is implemented by a ResponseWriter that wants to know how a verb call went without
// reading its reply back: a filter reply names every refused node (tens to hundreds of KB at
// thousands of nodes), and decoding it again to classify it cost more than encoding it
// (tessera-extender's metrics wrap the handler with one). The verbs call ObserveCall once per
// decoded request, before the reply is written: decoded is when the request was read and decoded,
// served when the reply was ready, result the reply's outcome (telemetry.ResultOK,
// ResultUnschedulable or telemetry.ResultError). A request answered with an HTTP error (bad body, not synced) is not observed.
type CallObserver interface {
	ObserveCall(decoded, served time.Time, result string)
}

// ResultUnschedulable is the result of a filter call that kept no node and refused at least one;
// the others are telemetry.ResultOK and telemetry.ResultError.
const ResultUnschedulable = "unschedulable"

// replyResult is a verb reply's result (CallObserver).
func replyResult(reply any) string {
	switch r := reply.(type) {
	case *filterReply:
		return r.outcome()
	case *extenderv1.ExtenderFilterResult: // the leader's answer, passed back
		switch {
		case r.Error != "":
			return telemetry.ResultError
		case keptAny(r):
		case len(r.FailedNodes)+len(r.FailedAndUnresolvableNodes) > 0:
			return ResultUnschedulable
		}
	case *extenderv1.ExtenderBindingResult:
		if r.Error != "" {
			return telemetry.ResultError
		}
	case *extenderv1.ExtenderPreemptionResult, *extenderv1.HostPriorityList:
	}
	return telemetry.ResultOK
}
