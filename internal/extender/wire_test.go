package extender

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"

	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestDecodeArgsMatchesStandardDecoding: the name-list decoder (state's strings reused) reads what
// encoding/json reads, escapes, spacing, empty and null lists included.
func TestDecodeArgsMatchesStandardDecoding(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	x.State.UpsertNode(testNode(testInventory("n1", 1, 1, "T4"), nil))
	cases := []string{
		`{"Pod":{"metadata":{"name":"p"}},"NodeNames":["n1","n2"]}`,
		`{"pod":null,"nodenames":[ "n1" , "n\u0032", "n1" ]}`,
		`{"NodeNames":[]}`, `{"NodeNames":null}`, `{}`, `{"NodeNames":[ ]}`,
		`{"Nodes":{"items":[{"metadata":{"name":"n1"}}]}}`,
		`{"NodeNames":["a\"b"]}`,
		// Lists of the same length one after another: remembered lists are told apart by content.
		`{"NodeNames":["n1","n2"]}`, `{"NodeNames":["n2","n1"]}`, `{"NodeNames":["n3","n1"]}`,
		// The node-name array is split off the body (splitNodeNames): brackets, braces and quotes in
		// the pod's strings, the array first, last or twice, odd spacing, names that are not plain.
		`{"Pod":{"metadata":{"name":"p]},\"NodeNames\":[\"x\"]","labels":{"a":"[{"}}},"NodeNames":["n1"]}`,
		` { "NodeNames" : [ "n1" ,"n2" ] , "Pod" : { "metadata" : { "name" : "q" } } } `,
		`{"NodeNames":["n1"],"nodeNames":["n2"]}`, `{"NodeNames":["é"]}`, `{"NodeNames":["\u00e9"]}`,
		`{"Pod":{"spec":{"priority":7,"hostNetwork":true,"nodeName":null}},"NodeNames":["n1"]}`,
	}
	// Twice over: the second round decodes into name lists the first gave back to the pool (longer
	// lists before shorter ones, released lists cleared).
	for _, body := range append(cases, cases...) {
		var want extenderv1.ExtenderArgs
		if err := json.Unmarshal([]byte(body), &want); err != nil {
			t.Fatal(err)
		}
		var got extenderv1.ExtenderArgs
		rec := httptest.NewRecorder()
		release, ok := x.decodeArgs(rec, httptest.NewRequest(http.MethodPost, "/filter", strings.NewReader(body)), &got)
		if !ok {
			t.Fatalf("%s: %s", body, rec.Body.String())
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s: decoded %+v, want %+v", body, got, want)
		}
		release()
	}
	for _, body := range []string{
		`{"NodeNames":["n1",]}`, `{"NodeNames":["n1"]} x`, `{"Pod":{,"NodeNames":["n1"]}`, `{"Pod":{}, "NodeNames":["n1"]`,
		`{"NodeNames":["n1"],}`, "{\"NodeNames\":[\"n\x01\"]}", `{"NodeNames":["n1"] "Pod":{}}`, `{"Pod":tru,"NodeNames":["n1"]}`,
		`{"NodeNames":["n1"]`, `{"NodeNames":["n1"}`,
	} {
		rec := httptest.NewRecorder()
		if _, ok := x.decodeArgs(rec, httptest.NewRequest(http.MethodPost, "/filter", strings.NewReader(body)), &extenderv1.ExtenderArgs{}); ok {
			t.Errorf("invalid JSON %s decoded", body)
		}
		if json.Valid([]byte(body)) {
			t.Errorf("%s is valid JSON: not a case for this list", body)
		}
	}
}

// TestFilterReplyEncoding: the filter reply's own encoder (reason maps written from per-node slices)
// gives what encoding/json reads back as the same result (escapes, control characters, invalid
// UTF-8, repeated reasons, no refused nodes; a nil map reads back empty).
func TestFilterReplyEncoding(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	names := []string{"n1", "n\"2"}
	for _, res := range []*extenderv1.ExtenderFilterResult{
		{NodeNames: &names, FailedNodes: extenderv1.FailedNodesMap{"a": "plain", "b\\c": "quote \" and \\ and \n\t\x01 and é and \xff"},
			FailedAndUnresolvableNodes: extenderv1.FailedNodesMap{}, Error: "e"},
		// Repeated reasons (copied once encoded) beside others, escapes among them, in map order.
		{FailedNodes: extenderv1.FailedNodesMap{"r1": "same \"one\"", "r2": "same \"one\"", "r3": "same \"two\"", "r4": "same \"one\"",
			"r5": "same \"two\"", "r6": "same \"one\"", "r7": "same \"ten\""}},
		{},
	} {
		rec := httptest.NewRecorder()
		x.reply(rec, httptest.NewRequest(http.MethodPost, "/filter", nil), replyOf(res))
		want, _ := json.Marshal(res)
		var got, exp extenderv1.ExtenderFilterResult
		if err := json.Unmarshal(rec.Body.Bytes(), &got); err != nil {
			t.Fatalf("%s: %v", rec.Body.String(), err)
		}
		_ = json.Unmarshal(want, &exp)
		for _, m := range []*extenderv1.FailedNodesMap{&exp.FailedNodes, &exp.FailedAndUnresolvableNodes} {
			if *m == nil {
				*m = extenderv1.FailedNodesMap{}
			}
		}
		if !reflect.DeepEqual(got, exp) {
			t.Errorf("reply %s\ndecodes to %+v\nwant %+v", rec.Body.String(), got, exp)
		}
	}
}

// TestNameListsKeepTheListInUse: as TestResolveCacheKeepsTheListInUse, for the decoded request
// bodies.
func TestNameListsKeepTheListInUse(t *testing.T) {
	var c nameLists
	all := []byte(`["a","b","c"]`)
	c.put(all, []string{"a", "b", "c"})
	for _, one := range []string{"a", "b", "c", "a"} {
		raw := []byte(`["` + one + `"]`)
		if _, ok := c.get(raw, nil); !ok {
			c.put(raw, []string{one})
		}
		if _, ok := c.get(all, nil); !ok {
			t.Fatalf("after [%s] the list of every node was not remembered", one)
		}
	}
}
