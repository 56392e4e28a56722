package extender

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"testing"

	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
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
		// Backslash runs before a quote: an even run ends the string, an odd one escapes the quote.
		`{"Pod":{"metadata":{"name":"a\\","labels":{"k":"\\\"],\"NodeNames\":[\"x\"]","\\\\":"\\"}}},"NodeNames":["n1"]}`,
		`{"Pod":{"metadata":{"name":"\"NodeNames\":[\"x\"],\\\\\\"}},"NodeNames":["n1","n2"]}`,
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

// TestDecodedNamesAreResolvedOnce: a filter request's node names, in an order never sent before (as
// kube-scheduler's parallel Filter sends them), are looked up once, by the decoder: the verb's view
// finds the list resolved (no second lookup per name) and resolves each name to its own node (an
// unknown name to none). A node created or deleted between the decoding and the view makes the
// decoder's lookups stale: the view resolves the list again and sees the change.
func TestDecodedNamesAreResolvedOnce(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	slotOf := map[string]int{}
	for i, name := range []string{"n0", "n1", "n2", "n3", "n4"} {
		x.State.UpsertNode(testNode(testInventory(name, i, 1, "T4"), nil))
	}
	x.State.viewIndexed([]string{"n0", "n1", "n2", "n3", "n4"}, 1, func(_, i, slot int, _ *placement.NodeState, _ string) {
		slotOf[fmt.Sprintf("n%d", i)] = slot
	})
	decode := func(names ...string) []string { return decodeNames(t, x, names) }
	view := func(names []string) map[string]int {
		got := map[string]int{}
		x.State.viewIndexed(names, 1, func(_, i, slot int, _ *placement.NodeState, _ string) { got[names[i]] = slot })
		return got
	}
	misses := func() int {
		x.State.resolved.mu.Lock()
		defer x.State.resolved.mu.Unlock()
		return x.State.resolved.misses
	}
	for _, order := range [][]string{{"n3", "n0", "nX", "n4", "n1", "n2"}, {"n1", "nX", "n2", "n0", "n4", "n3"}, {"n2", "n4", "n0", "nX", "n3", "n1"}} {
		before := misses()
		got := view(decode(order...))
		if misses() != before {
			t.Fatalf("%v: the view looked the decoded names up again", order)
		}
		for _, name := range order {
			want, known := slotOf[name]
			if !known {
				want = -1
			}
			if got[name] != want {
				t.Fatalf("%v: %s resolved to slot %d, want %d", order, name, got[name], want)
			}
		}
	}
	names := decode("n2", "nX", "n0")
	x.State.DeleteNode("n2")
	x.State.UpsertNode(testNode(testInventory("nX", 9, 1, "T4"), nil))
	got := view(names)
	if got["n2"] != -1 || got["nX"] < 0 || got["n0"] != slotOf["n0"] {
		t.Fatalf("nodes changed after decoding: view resolved %v, want n2 gone, nX known, n0 at %d", got, slotOf["n0"])
	}
}

// TestSplitNodeNamesSkipsEscapedQuotes: the fast path (not the standard decoder's fallback) splits
// bodies whose other strings hold quotes after backslash runs, and finds the real array: a quote
// after an even run of backslashes ends a string, after an odd run it is part of it.
func TestSplitNodeNamesSkipsEscapedQuotes(t *testing.T) {
	for _, c := range []struct{ body, names string }{
		{`{"Pod":{"metadata":{"name":"a\\","labels":{"k":"\\\"],\"NodeNames\":[\"x\"]","\\\\":"\\"}}},"NodeNames":["n1"]}`, `["n1"]`},
		{`{"Pod":{"metadata":{"name":"\"NodeNames\":[\"x\"],\\\\\\"}},"NodeNames":["n1","n2"]}`, `["n1","n2"]`},
		{`{"NodeNames":["n\\\"1","n2\\\\"],"Pod":{"metadata":{"name":"\\\\\\\""}}}`, `["n\\\"1","n2\\\\"]`},
		{`{"Pod":{"metadata":{"name":"\\"}},"NodeNames":["n1"]}`, `["n1"]`},
	} {
		_, names, ok := splitNodeNames([]byte(c.body), nil)
		if !ok || string(names) != c.names {
			t.Errorf("%s: split %v, array %s, want %s", c.body, ok, names, c.names)
		}
	}
}

// decodeNames decodes a filter request naming names as the filter handler does; the decoder's
// buffers go back when the test ends.
func decodeNames(t *testing.T, x *Extender, names []string) []string {
	t.Helper()
	body := `{"Pod":{"metadata":{"name":"p"}},"NodeNames":["` + strings.Join(names, `","`) + `"]}`
	var args extenderv1.ExtenderArgs
	rec := httptest.NewRecorder()
	release, ok := x.decodeArgs(rec, httptest.NewRequest(http.MethodPost, "/filter", strings.NewReader(body)), &args)
	if !ok {
		t.Fatalf("decode: %s", rec.Body.String())
	}
	t.Cleanup(release)
	return *args.NodeNames
}

// TestDecodedNamesFollowTheLastList: a list in the last list's order from another start (a
// rotation: kube-scheduler's Filter walks its nodes from a rotating start) is decoded with one map
// lookup, and one in chunks of that order with one per chunk (its parallel Filter); every name
// resolves to its own node whatever the order, unknown names included; a list remembered before a
// node was deleted and another created predicts nothing.
func TestDecodedNamesFollowTheLastList(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	var base []string
	for i := range 200 {
		name := fmt.Sprintf("n%03d", i)
		x.State.UpsertNode(testNode(testInventory(name, i, 1, "T4"), nil))
		base = append(base, name)
	}
	decode := func(names []string) []string { return decodeNames(t, x, names) }
	// check decodes names and compares each one's node with a lookup by name; it returns the
	// decoder's map lookups.
	check := func(what string, names []string) int64 {
		t.Helper()
		before := x.State.nameLookups.Load()
		got := decode(names)
		lookups := x.State.nameLookups.Load() - before
		if !slices.Equal(got, names) {
			t.Fatalf("%s: decoded %v", what, got)
		}
		x.State.viewIndexed(got, 1, func(_, i, slot int, n *placement.NodeState, _ string) {
			var want *placement.NodeState
			x.State.View([]string{names[i]}, func(_ string, m *placement.NodeState, _ string) { want = m })
			if n != want {
				t.Fatalf("%s: %s resolved to another node's state (slot %d)", what, names[i], slot)
			}
		})
		return lookups
	}
	rotate := func(names []string, k int) []string { return append(slices.Clone(names[k:]), names[:k]...) }
	if n := check("first list", base); n != int64(len(base)) {
		t.Fatalf("first list: %d lookups, want %d (nothing to predict from)", n, len(base))
	}
	if n := check("rotation", rotate(base, 77)); n != 1 {
		t.Fatalf("rotation: %d lookups, want 1", n)
	}
	var chunked []string
	for _, c := range []int{3, 0, 4, 1, 2} { // five chunks of 40 of another rotation, out of order
		chunked = append(chunked, rotate(base, 13)[c*40:(c+1)*40]...)
	}
	if n := check("chunks", chunked); n > 5 {
		t.Fatalf("chunks: %d lookups, want at most one per chunk (5)", n)
	}
	if n := check("rotation after chunks", rotate(base, 50)); n > 6 {
		t.Fatalf("rotation after chunks: %d lookups, want at most one per chunk of the last list and one more", n)
	}
	withUnknown := slices.Insert(rotate(base, 150), 20, "unknown-1", "unknown-2")
	if n := check("unknown names", withUnknown); n > 4 {
		t.Fatalf("unknown names: %d lookups, want at most 4", n)
	}
	shuffled := slices.Clone(base)
	rand.New(rand.NewPCG(3, 4)).Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
	check("shuffled", shuffled)
	check("after the shuffle", rotate(base, 5))
	// A node deleted and another created (its slot reused) after the last list: nothing is
	// predicted from a list of the old generation.
	x.State.DeleteNode("n010")
	x.State.UpsertNode(testNode(testInventory("n200", 200, 1, "T4"), nil))
	next := append(rotate(base, 9), "n200")
	if n := check("new generation", next); n != int64(len(next)) {
		t.Fatalf("new generation: %d lookups, want %d (the last list's entries may be gone)", n, len(next))
	}
}
