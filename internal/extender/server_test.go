package extender

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes/fake"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/telemetry"
)

func TestHTTPServer(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	x.State.UpsertNode(testNode(testInventory("n1", 1, 2, "T4"), nil))
	x.State.UpsertNode(testNode(testInventory("n2", 2, 1, "T4"), nil))
	srv := httptest.NewServer(x.Handler(func() bool { return true }))
	defer srv.Close()
	post := func(path string, in, out any) {
		t.Helper()
		body, _ := json.Marshal(in)
		resp, err := http.Post(srv.URL+path, "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: status %d", path, resp.StatusCode)
		}
		if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
			t.Fatal(err)
		}
	}
	names := []string{"n1", "n2"}
	args := extenderv1.ExtenderArgs{Pod: wholePod("p", 2), NodeNames: &names}
	var fr extenderv1.ExtenderFilterResult
	post("/filter", args, &fr)
	if fr.NodeNames == nil || len(*fr.NodeNames) != 1 || (*fr.NodeNames)[0] != "n1" || fr.FailedAndUnresolvableNodes["n2"] == "" {
		t.Fatalf("filter: %+v", fr)
	}
	var hp extenderv1.HostPriorityList
	post("/prioritize", args, &hp)
	if len(hp) != 2 || hp[0].Host != "n1" || hp[0].Score != 10 || hp[1].Score != 0 {
		t.Fatalf("prioritize: %+v", hp)
	}
	resp, err := http.Get(srv.URL + "/healthz")
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("healthz: %v %v", resp, err)
	}
	resp, _ = http.Post(srv.URL+"/filter", "application/json", bytes.NewReader([]byte("{")))
	if resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("bad JSON answered %d", resp.StatusCode)
	}
}

// TestPickOneReplicaPassesVerbsOn: under pick-one a replica that is not the leader passes filter,
// prioritize and preempt on to the leader (one state decides) and answers what the leader answers;
// where the leader cannot be reached, filter and bind say so in their result, prioritize and
// preempt by HTTP 502. Without pick-one it answers filter itself.
func TestPickOneReplicaPassesVerbsOn(t *testing.T) {
	node := testNode(testInventory("n1", 1, 2, "T4"), nil)
	leader, follower := newTestExtender(t, api.PolicyTessera), newTestExtender(t, api.PolicyTessera)
	leader.State.UpsertNode(node) // the follower's state has no node: its own answers would differ
	leader.PickOne, follower.PickOne = true, true
	leader.Leader, follower.Leader = &atomic.Bool{}, &atomic.Bool{}
	leader.Leader.Store(true)
	synced := func() bool { return true }
	ls := httptest.NewServer(leader.Handler(synced))
	defer ls.Close()
	fs := httptest.NewServer(follower.Handler(synced))
	defer fs.Close()
	reach := true
	follower.LeaderURL = func(context.Context) (string, error) {
		if !reach {
			return "", errors.New("no lease")
		}
		return ls.URL, nil
	}
	post := func(url, path string, in, out any) int {
		t.Helper()
		body, _ := json.Marshal(in)
		resp, err := http.Post(url+path, "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
				t.Fatal(err)
			}
		}
		return resp.StatusCode
	}
	names := []string{"n1"}
	args := extenderv1.ExtenderArgs{Pod: wholePod("p", 1), NodeNames: &names}
	leader.State.markPending(args.Pod, leader.Class)
	var fr extenderv1.ExtenderFilterResult
	if code := post(fs.URL, "/filter", args, &fr); code != http.StatusOK || fr.Error != "" || fr.NodeNames == nil || len(*fr.NodeNames) != 1 {
		t.Fatalf("filter through the follower: %d %+v, want the leader's n1", code, fr)
	}
	var hp extenderv1.HostPriorityList
	if code := post(fs.URL, "/prioritize", args, &hp); code != http.StatusOK || len(hp) != 1 || hp[0].Score != 10 {
		t.Fatalf("prioritize through the follower: %d %+v, want the leader's n1 at 10", code, hp)
	}
	pargs := extenderv1.ExtenderPreemptionArgs{Pod: wholePod("big", 1), NodeNameToMetaVictims: map[string]*extenderv1.MetaVictims{
		"n1": {Pods: []*extenderv1.MetaPod{{UID: "uid-gone"}}}}}
	var pr extenderv1.ExtenderPreemptionResult
	if code := post(fs.URL, "/preempt", pargs, &pr); code != http.StatusOK || pr.NodeNameToMetaVictims["n1"] == nil {
		t.Fatalf("preempt through the follower: %d %+v, want the leader's n1", code, pr)
	}
	reach = false
	fr = extenderv1.ExtenderFilterResult{}
	if code := post(fs.URL, "/filter", args, &fr); code != http.StatusOK || !strings.Contains(fr.Error, "no lease") {
		t.Fatalf("filter with no leader: %d %+v, want the error in the result", code, fr)
	}
	var br extenderv1.ExtenderBindingResult
	if code := post(fs.URL, "/bind", extenderv1.ExtenderBindingArgs{PodName: "p", PodNamespace: "default", Node: "n1"}, &br); code != http.StatusOK || !strings.Contains(br.Error, "no lease") {
		t.Fatalf("bind with no leader: %d %+v, want the error in the result", code, br)
	}
	for path, in := range map[string]any{"/prioritize": args, "/preempt": pargs} {
		if code := post(fs.URL, path, in, new(any)); code != http.StatusBadGateway {
			t.Fatalf("%s with no leader: %d, want 502", path, code)
		}
	}
	follower.PickOne = false
	fr = extenderv1.ExtenderFilterResult{}
	if code := post(fs.URL, "/filter", args, &fr); code != http.StatusOK || fr.Error != "" || len(fr.FailedNodes) != 1 {
		t.Fatalf("filter without pick-one: %d %+v, want the follower's own answer (n1 unknown to it)", code, fr)
	}
}

// TestWarmerWaitsWhileRequestIsRead: a filter or prioritize request counts as in flight (the
// warmer waits, warm.go) from the handler's first read of its body, not only once it is decoded,
// and stops counting once answered.
func TestWarmerWaitsWhileRequestIsRead(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	x.State.UpsertNode(testNode(testInventory("n1", 1, 2, "T4"), nil))
	h := x.Handler(nil)
	for _, path := range []string{"/filter", "/prioritize"} {
		body, wr := io.Pipe()
		done := make(chan int)
		go func() {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, path, body))
			done <- rec.Code
		}()
		// The write returns once the handler has read it: the handler is reading the body.
		if _, err := wr.Write([]byte(`{"pod": `)); err != nil {
			t.Fatal(err)
		}
		if x.calls.Load() == 0 {
			t.Errorf("%s: not in flight while its body is read: the warmer would run on", path)
		}
		_, _ = wr.Write([]byte(`null}`))
		_ = wr.Close()
		<-done
		if n := x.calls.Load(); n != 0 {
			t.Fatalf("%s: %d calls in flight after the reply", path, n)
		}
	}
}

// observer is a ResponseWriter that records what the verbs report through CallObserver.
type observer struct {
	*httptest.ResponseRecorder
	calls           int
	decoded, served time.Time
	result          string
}

func (o *observer) ObserveCall(decoded, served time.Time, result string) {
	o.calls++
	o.decoded, o.served, o.result = decoded, served, result
}

// TestVerbsReportTheirResult: each verb tells a CallObserver its result from the reply it wrote
// (tessera-extender's metrics label calls by it, without reading the reply back): a filter that
// keeps a node is ok, one that refuses every node unschedulable, one without a pod an error, as is
// a bind that failed; the phases' times are in order. A body that does not decode is answered
// with HTTP 400 and not observed.
func TestVerbsReportTheirResult(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	x.State.UpsertNode(testNode(testInventory("n1", 1, 2, "T4"), nil))
	x.Client = fake.NewClientset() // the bind below finds no pod
	h := x.Handler(func() bool { return true })
	call := func(path string, in any) *observer {
		t.Helper()
		body, _ := json.Marshal(in)
		o := &observer{ResponseRecorder: httptest.NewRecorder()}
		before := time.Now()
		h.ServeHTTP(o, httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body)))
		if o.calls == 1 && (o.decoded.Before(before) || o.served.Before(o.decoded) || time.Now().Before(o.served)) {
			t.Errorf("%s: phases out of order: start %v decoded %v served %v", path, before, o.decoded, o.served)
		}
		return o
	}
	n1 := []string{"n1"}
	for _, c := range []struct {
		name, path string
		in         any
		want       string
	}{
		{"fits", "/filter", extenderv1.ExtenderArgs{Pod: wholePod("p", 1), NodeNames: &n1}, telemetry.ResultOK},
		{"refused everywhere", "/filter", extenderv1.ExtenderArgs{Pod: wholePod("big", 4), NodeNames: &n1}, ResultUnschedulable},
		{"no nodes to refuse", "/filter", extenderv1.ExtenderArgs{Pod: wholePod("p", 1), NodeNames: &[]string{}}, telemetry.ResultOK},
		{"no pod", "/filter", extenderv1.ExtenderArgs{NodeNames: &n1}, telemetry.ResultError},
		{"prioritize", "/prioritize", extenderv1.ExtenderArgs{Pod: wholePod("p", 1), NodeNames: &n1}, telemetry.ResultOK},
		{"bind of an unknown pod", "/bind", extenderv1.ExtenderBindingArgs{PodName: "gone", PodNamespace: "default", PodUID: "uid-gone", Node: "n1"}, telemetry.ResultError},
	} {
		if o := call(c.path, c.in); o.calls != 1 || o.result != c.want {
			t.Errorf("%s: observed %d calls, result %q; want one, %q (reply %s)", c.name, o.calls, o.result, c.want, o.Body)
		}
	}
	o := &observer{ResponseRecorder: httptest.NewRecorder()}
	h.ServeHTTP(o, httptest.NewRequest(http.MethodPost, "/filter", strings.NewReader("{")))
	if o.Code != http.StatusBadRequest || o.calls != 0 {
		t.Errorf("bad body: status %d, %d observed calls; want 400 and none", o.Code, o.calls)
	}
}
