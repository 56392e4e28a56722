package extender

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	extenderv1 "k8s.io/kube-scheduler/extender/v1"
)

// maxBodyBytes bounds a request body; a filter call for 5,000 full Node objects stays well below.
const maxBodyBytes = 256 << 20

// forwardedHeader marks a bind a non-leader passed on, so that it is never passed on twice.
const forwardedHeader = "X-Tessera-Forwarded-Bind"

// Handler serves the extender verbs (POST /filter, /prioritize, /bind, JSON of
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
	mux.HandleFunc("POST /filter", func(w http.ResponseWriter, r *http.Request) {
		if !synced(w) {
			return
		}
		var args extenderv1.ExtenderArgs
		if !x.decode(w, r, &args) {
			return
		}
		if x.PickOne && x.passOn(r) {
			// The leader holds the choices made so far (Filter's holds): one state decides.
			var res extenderv1.ExtenderFilterResult
			if err := x.forward(r.Context(), "/filter", &args, &res); err != nil {
				res = extenderv1.ExtenderFilterResult{Error: err.Error()}
			}
			x.reply(w, r, &res)
			return
		}
		x.reply(w, r, x.Filter(&args))
	})
	mux.HandleFunc("POST /prioritize", func(w http.ResponseWriter, r *http.Request) {
		if !synced(w) {
			return
		}
		var args extenderv1.ExtenderArgs
		if !x.decode(w, r, &args) {
			return
		}
		if x.PickOne && x.passOn(r) {
			var list extenderv1.HostPriorityList
			if err := x.forward(r.Context(), "/prioritize", &args, &list); err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			x.reply(w, r, &list)
			return
		}
		list, err := x.Prioritize(&args)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		x.reply(w, r, list)
	})
	mux.HandleFunc("POST /bind", func(w http.ResponseWriter, r *http.Request) {
		if !synced(w) {
			return
		}
		var args extenderv1.ExtenderBindingArgs
		if !x.decode(w, r, &args) {
			return
		}
		res := &extenderv1.ExtenderBindingResult{}
		if x.passOn(r) {
			// Only the leader binds; a replica the Service routed the bind to passes it on.
			if err := x.forward(r.Context(), "/bind", &args, res); err != nil {
				res.Error = err.Error()
			}
		} else if err := x.Bind(r.Context(), &args); err != nil {
			res.Error = err.Error()
		}
		x.reply(w, r, res)
	})
	mux.HandleFunc("POST /preempt", func(w http.ResponseWriter, r *http.Request) {
		if !synced(w) {
			return
		}
		var args extenderv1.ExtenderPreemptionArgs
		if !x.decode(w, r, &args) {
			return
		}
		if x.PickOne && x.passOn(r) {
			var res extenderv1.ExtenderPreemptionResult
			if err := x.forward(r.Context(), "/preempt", &args, &res); err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			x.reply(w, r, &res)
			return
		}
		x.reply(w, r, x.Preempt(&args))
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		if ready != nil && !ready() {
			http.Error(w, "informers not synced", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}

// passOn reports whether this replica passes the request on to the leader: it is not the leader,
// knows how to reach it, and the request was not passed on already.
func (x *Extender) passOn(r *http.Request) bool {
	return x.Leader != nil && !x.Leader.Load() && r.Header.Get(forwardedHeader) == "" && x.LeaderURL != nil
}

// forward posts a verb's arguments to the leader and decodes its answer into out.
func (x *Extender) forward(ctx context.Context, path string, args, out any) error {
	url, err := x.LeaderURL(ctx)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrNotLeader, err)
	}
	body, _ := json.Marshal(args)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(url, "/")+path, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("pass %s on to the leader at %s: %w", path, url, err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(forwardedHeader, "1")
	client := x.Forward
	if client == nil {
		client = http.DefaultClient
	}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("pass %s on to the leader at %s: %w", path, url, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxBodyBytes))
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("HTTP %d: %s", resp.StatusCode, strings.TrimSpace(string(raw)))
	}
	if err == nil {
		err = json.Unmarshal(raw, out)
	}
	if err != nil {
		return fmt.Errorf("pass %s on to the leader at %s: %w", path, url, err)
	}
	return nil
}

func (x *Extender) decode(w http.ResponseWriter, r *http.Request, v any) bool {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBodyBytes))
	if err == nil {
		err = json.Unmarshal(body, v)
	}
	if err != nil {
		x.log().Warn("bad extender request", "path", r.URL.Path, "err", err)
		http.Error(w, "invalid extender request: "+err.Error(), http.StatusBadRequest)
		return false
	}
	return true
}

func (x *Extender) reply(w http.ResponseWriter, r *http.Request, v any) {
	start := time.Now()
	w.Header().Set("Content-Type", "application/json")
	if err := json.NewEncoder(w).Encode(v); err != nil {
		x.log().Warn("write extender response", "path", r.URL.Path, "err", err)
	}
	x.log().Debug("served", "path", r.URL.Path, "encode", time.Since(start))
}
