package extender

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"time"

	extenderv1 "k8s.io/kube-scheduler/extender/v1"
)

// maxBodyBytes bounds a request body; a filter call for 5,000 full Node objects stays well below.
const maxBodyBytes = 256 << 20

// Handler serves the extender verbs (POST /filter, /prioritize, /bind, JSON of
// k8s.io/kube-scheduler/extender/v1) and GET /healthz. ready reports readiness (informers synced).
func (x *Extender) Handler(ready func() bool) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /filter", func(w http.ResponseWriter, r *http.Request) {
		var args extenderv1.ExtenderArgs
		if !x.decode(w, r, &args) {
			return
		}
		x.reply(w, r, x.Filter(&args))
	})
	mux.HandleFunc("POST /prioritize", func(w http.ResponseWriter, r *http.Request) {
		var args extenderv1.ExtenderArgs
		if !x.decode(w, r, &args) {
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
		var args extenderv1.ExtenderBindingArgs
		if !x.decode(w, r, &args) {
			return
		}
		res := &extenderv1.ExtenderBindingResult{}
		if err := x.Bind(r.Context(), &args); err != nil {
			res.Error = err.Error()
		}
		x.reply(w, r, res)
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
