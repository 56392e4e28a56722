package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// TestSimSlice replays the first 400 pods of the default trace and checks the report format and that
// BestFit, FGD and tessera leave less unallocated than Random. The trace is part of the test: a
// checkout without ../shared/data fails here rather than passing untested.
func TestSimSlice(t *testing.T) {
	const data = "../../../shared/data/openb/"
	if _, err := os.Stat(data + "openb_node_list_gpu_node.csv"); err != nil {
		t.Fatalf("openb trace missing (the shared data must sit beside the checkout): %v", err)
	}
	// A 200-node slice of the cluster (every 6th node keeps the model mix) keeps the run short.
	full, err := os.ReadFile(data + "openb_node_list_gpu_node.csv")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(full)), "\n")
	slice := []string{lines[0]}
	for i := 1; i < len(lines); i += 6 {
		slice = append(slice, lines[i])
	}
	nodes := filepath.Join(t.TempDir(), "nodes.csv")
	if err := os.WriteFile(nodes, []byte(strings.Join(slice, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var out, errb bytes.Buffer
	err = run(context.Background(), []string{"--nodes", nodes, "--pods", data + "openb_pod_list_default.csv",
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
