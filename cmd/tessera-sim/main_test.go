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

// TestSimSlice replays the first 400 pods of the default trace (when the shared data is present)
// and checks the report format and that BestFit leaves less unallocated than Random.
func TestSimSlice(t *testing.T) {
	const data = "../../../shared/data/openb/"
	if _, err := os.Stat(data + "openb_node_list_gpu_node.csv"); err != nil {
		t.Skip("openb trace not present:", err)
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
		"--policy", "bestfit,random,tessera", "--seeds", "2", "--limit", "400"}, &out, &errb)
	if err != nil {
		t.Fatal(err, errb.String())
	}
	re := regexp.MustCompile(`(?m)^policy=(\w+) unallocated_gpu_pct_at_100=(\d+\.\d\d)$`)
	got := map[string]float64{}
	for _, m := range re.FindAllStringSubmatch(out.String(), -1) {
		got[m[1]], _ = strconv.ParseFloat(m[2], 64)
	}
	if len(got) != 3 {
		t.Fatalf("want 3 machine-readable lines, got:\n%s", out.String())
	}
	if got["bestfit"] >= got["random"] {
		t.Fatalf("bestfit %.2f should leave less unallocated than random %.2f", got["bestfit"], got["random"])
	}
}
