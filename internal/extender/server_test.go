package extender

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
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
