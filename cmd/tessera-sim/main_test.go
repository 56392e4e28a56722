package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// TestSimSlice replays the first 400 pods of the default trace on a 203-node slice of its cluster
// and checks the report format and that BestFit, FGD and tessera leave less unallocated than
// Random. The slice is in testdata/openb (see its README.md), so the test runs on a checkout
// without ../shared; TestSimSliceIsTheTrace checks it against the full trace where that is present.
func TestSimSlice(t *testing.T) {
	nodes, pods := filepath.Join("testdata", "openb", "nodes_every6th.csv"), filepath.Join("testdata", "openb", "pods_default_first400.csv")
	var out, errb bytes.Buffer
	err := run(context.Background(), []string{"--nodes", nodes, "--pods", pods,
		"--policy", "bestfit,random,tessera,fgd", "--seeds", "2", "--limit", "400"}, &out, &errb)
	if err != nil {
		t.Fatal(err, errb.String())
	}
	re := regexp.MustCompile(`(?m)^policy=(\w+) unallocated_gpu_pct_at_100=(\d+\.\d\d)$`)
	got := map[string]float64{}
	for _, m := range re.FindAllStringSubmatch(out.String(), -1) {
		got[m[1]], _ = strconv.ParseFloat(m[2], 64)
	}
	if len(got) != 4 {
		t.Fatalf("want 4 machine-readable lines, got:\n%s", out.String())
	}
	for _, p := range []string{"bestfit", "tessera", "fgd"} {
		if got[p] >= got["random"] {
			t.Fatalf("%s %.2f should leave less unallocated than random %.2f\n%s", p, got[p], got["random"], out.String())
		}
	}
}

// TestSimSliceIsTheTrace: the testdata slice is the full openb trace's, unmodified: its header and
// every 6th node of the node list, its header and first 400 pods of the default pod list. It needs
// ../shared/data beside the checkout and fails without it (as CI has it).
func TestSimSliceIsTheTrace(t *testing.T) {
	const data = "../../../shared/data/openb/"
	if _, err := os.Stat(data + "openb_node_list_gpu_node.csv"); err != nil {
		t.Fatalf("the full openb trace is not beside the checkout (%v): put the shared data at ../shared/data/openb; "+
			"this test proves the committed slice is the trace's, TestSimSlice alone runs without it", err)
	}
	lines := func(path string) []string {
		t.Helper()
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		return strings.Split(strings.TrimSpace(string(b)), "\n")
	}
	fullNodes, fullPods := lines(data+"openb_node_list_gpu_node.csv"), lines(data+"openb_pod_list_default.csv")
	wantNodes := []string{fullNodes[0]}
	for i := 1; i < len(fullNodes); i += 6 {
		wantNodes = append(wantNodes, fullNodes[i])
	}
	if got := lines(filepath.Join("testdata", "openb", "nodes_every6th.csv")); !slices.Equal(got, wantNodes) {
		t.Errorf("testdata node slice (%d lines) is not every 6th node of the trace (%d lines)", len(got), len(wantNodes))
	}
	if got := lines(filepath.Join("testdata", "openb", "pods_default_first400.csv")); !slices.Equal(got, fullPods[:401]) {
		t.Errorf("testdata pod slice (%d lines) is not the trace's header and first 400 pods", len(got))
	}
}
