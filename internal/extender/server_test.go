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

	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
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
