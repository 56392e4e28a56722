package v1

import (
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestContextOverheadMatchesVcuda reads vcuda's table of what a context costs (the C source) and
// checks ContextOverheadBytes charges the same on every compute capability: the extender and DRA
// refuse exactly the shares vcuda could not create a context in.
func TestContextOverheadMatchesVcuda(t *testing.T) {
	src, err := os.ReadFile("../../vcuda/src/hooks_ctx.c")
	if err != nil {
		t.Fatal(err)
	}
	table := regexp.MustCompile(`(?s)\} ctx_table\[\] = \{(.*?)\n\};`).FindSubmatch(src)
	other := regexp.MustCompile(`#define VC_CTX_MIB_OTHER (\d+)\n`).FindSubmatch(src)
	if table == nil || other == nil {
		t.Fatal("vcuda/src/hooks_ctx.c: ctx_table or VC_CTX_MIB_OTHER not found; update this test with the table's new form")
	}
	type row struct{ major, mib int64 }
	var rows []row
	for _, m := range regexp.MustCompile(`\{(\d+), (\d+)\}`).FindAllSubmatch(table[1], -1) {
		a, _ := strconv.ParseInt(string(m[1]), 10, 64)
		b, _ := strconv.ParseInt(string(m[2]), 10, 64)
		rows = append(rows, row{a, b})
	}
	if len(rows) == 0 {
		t.Fatalf("vcuda's ctx_table has no rows: %s", table[1])
	}
	otherMiB, _ := strconv.ParseInt(string(other[1]), 10, 64)
	cMiB := func(major int64) int64 { // table_cost in C
		for _, r := range rows {
			if major >= r.major {
				return r.mib
			}
		}
		return otherMiB
	}
	for major := int64(0); major <= 20; major++ {
		if got, want := ContextOverheadBytes(int(major)), cMiB(major)<<20; got != want {
			t.Errorf("compute capability %d.x: Go charges %d MiB, vcuda %d MiB", major, got>>20, want>>20)
		}
	}
}

func TestComputeCapabilityMajor(t *testing.T) {
	for cc, want := range map[string]int{"9.0": 9, "8.6": 8, "12.0": 12, "7": 7, "": 0, "x.y": 0, "-1.0": 0} {
		if got := ComputeCapabilityMajor(cc); got != want {
			t.Errorf("ComputeCapabilityMajor(%q) = %d, want %d", cc, got, want)
		}
	}
}

// TestContextOverheadFileMatchesVcuda: the file's path, header, age bound and figure bound are the
// ones vcuda's parser applies (vcuda/src/limits.h, limits.c); vcuda's C test
// (TestContextOverhead in vcuda) reads a file in this format.
func TestContextOverheadFileMatchesVcuda(t *testing.T) {
	h, err := os.ReadFile("../../vcuda/src/limits.h")
	if err != nil {
		t.Fatal(err)
	}
	c, err := os.ReadFile("../../vcuda/src/limits.c")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`#define VC_OVERHEAD_PATH "` + ContextOverheadPathInContainer + `"`,
		`#define VC_OVERHEAD_MAX_AGE ` + strconv.Itoa(int(ContextOverheadMaxAge.Seconds())) + "\n",
		`#define VC_OVERHEAD_MAX_BYTES (64ull << 30)`,
	} {
		if !strings.Contains(string(h), want) {
			t.Errorf("vcuda/src/limits.h lacks %q", want)
		}
	}
	if ContextOverheadMaxBytes != 64<<30 {
		t.Errorf("ContextOverheadMaxBytes %d", int64(ContextOverheadMaxBytes))
	}
	if !strings.Contains(string(c), `"expected header \"`+ContextOverheadHeader+`\""`) {
		t.Errorf("vcuda/src/limits.c does not expect the header %q", ContextOverheadHeader)
	}
	got, err := EncodeContextOverheads(time.Unix(1700000000, 0), map[string]int64{testUUID(1): 600 << 20, testUUID(0): 700 << 20})
	if err != nil {
		t.Fatal(err)
	}
	want := "tessera-context-overhead 1\nwritten 1700000000\ngpu " + testUUID(0) + " 734003200\ngpu " + testUUID(1) + " 629145600\n"
	if string(got) != want {
		t.Errorf("encoded %q, want %q", got, want)
	}
	for _, bad := range []map[string]int64{{"GPU-x": 1}, {testUUID(0): 0}, {testUUID(0): 65 << 30}} {
		if _, err := EncodeContextOverheads(time.Unix(1, 0), bad); err == nil {
			t.Errorf("encoded %v", bad)
		}
	}
}
