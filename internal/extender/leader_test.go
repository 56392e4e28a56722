package extender

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"
)

// TestTwoReplicasRoundRobinNeverFailBind: the chart's two replicas behind one Service; binds
// alternate between them (round robin, as a Service without session affinity spreads them). The
// non-leader passes its binds to the leader: none fails, none is bound twice.
func TestTwoReplicasRoundRobinNeverFailBind(t *testing.T) {
	node := testNode(testInventory("n1", 1, 8, "A100"), nil)
	objs := []runtime.Object{node}
	for i := range 8 {
		objs = append(objs, wholePod(fmt.Sprintf("p%d", i), 1))
	}
	cs, _ := fakeAPI(t, objs...)
	leader, follower := newBinder(t, cs, "a", node), newBinder(t, cs, "b", node)
	leader.Leader, follower.Leader = &atomic.Bool{}, &atomic.Bool{}
	leader.Leader.Store(true)
	synced := func() bool { return true }
	ls := httptest.NewServer(leader.Handler(synced))
	defer ls.Close()
	fs := httptest.NewServer(follower.Handler(synced))
	defer fs.Close()
	follower.LeaderURL = func(context.Context) (string, error) { return ls.URL, nil }
	leader.LeaderURL = func(context.Context) (string, error) { return ls.URL, nil }
	for i := range 8 {
		url := []string{ls.URL, fs.URL}[i%2]
		body, _ := json.Marshal(extenderv1.ExtenderBindingArgs{PodName: fmt.Sprintf("p%d", i), PodNamespace: "default", Node: "n1"})
		resp, err := http.Post(url+"/bind", "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		var res extenderv1.ExtenderBindingResult
		err = json.NewDecoder(resp.Body).Decode(&res)
		resp.Body.Close()
		if err != nil || res.Error != "" {
			t.Fatalf("bind %d through %s: %v %q", i, []string{"leader", "follower"}[i%2], err, res.Error)
		}
	}
	list, _ := cs.CoreV1().Pods("default").List(context.Background(), metav1.ListOptions{})
	for _, p := range list.Items {
		if p.Spec.NodeName != "n1" {
			t.Fatalf("%s not bound", p.Name)
		}
	}
	// A bind passed on to a replica that is not the leader either is refused there, not passed again.
	leader.Leader.Store(false)
	body, _ := json.Marshal(extenderv1.ExtenderBindingArgs{PodName: "p0", PodNamespace: "default", Node: "n1"})
	resp, err := http.Post(fs.URL+"/bind", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	var res extenderv1.ExtenderBindingResult
	_ = json.NewDecoder(resp.Body).Decode(&res)
	resp.Body.Close()
	if res.Error == "" {
		t.Fatal("a bind with no leader anywhere succeeded")
	}
}

// TestNoVerbBeforeSync: until the informers have synced, every verb answers 503.
func TestNoVerbBeforeSync(t *testing.T) {
	x := newTestExtender(t, "tessera")
	srv := httptest.NewServer(x.Handler(func() bool { return false }))
	defer srv.Close()
	for _, verb := range []string{"/filter", "/prioritize", "/bind"} {
		resp, err := http.Post(srv.URL+verb, "application/json", bytes.NewReader([]byte("{}")))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable {
			t.Errorf("%s before sync: %d, want 503", verb, resp.StatusCode)
		}
	}
}

func TestLeaderURLOf(t *testing.T) {
	if u, ok := leaderURLOf(LeaderIdentity("tessera-extender-abc", "http://10.0.0.7:8888")); !ok || u != "http://10.0.0.7:8888" {
		t.Fatalf("%q %v", u, ok)
	}
	if _, ok := leaderURLOf("host-123"); ok {
		t.Fatal("an identity without URL gave one")
	}
}
