package v1

import (
	"reflect"
	"strings"
	"testing"
)

// The contract's golden example (docs of the file; vcuda's reader tests the same bytes).
const computeMeasuredGolden = "tessera-compute-measured 1\n" +
	"written 123456789000\n" +
	"gpu GPU-8f3c1a2e-0b4d-4e6f-9a1b-2c3d4e5f6a7b pid 42 start 98765 busy 1500000 at 123400000000\n"

func TestComputeMeasuredGolden(t *testing.T) {
	want := &ComputeMeasured{Written: 123456789000, Lines: []ComputeMeasuredLine{
		{UUID: "GPU-8f3c1a2e-0b4d-4e6f-9a1b-2c3d4e5f6a7b", PID: 42, Start: 98765, Busy: 1500000, At: 123400000000}}}
	got, err := ParseComputeMeasured([]byte(computeMeasuredGolden))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("parsed %+v, want %+v", got, want)
	}
	data, err := EncodeComputeMeasured(want)
	if err != nil {
		t.Fatal(err)
	}
	if string(data) != computeMeasuredGolden {
		t.Errorf("encoded %q, want the golden bytes %q", data, computeMeasuredGolden)
	}
	// No process yet: the header and written line alone are a valid file.
	empty, err := EncodeComputeMeasured(&ComputeMeasured{Written: 7})
	if err != nil || string(empty) != "tessera-compute-measured 1\nwritten 7\n" {
		t.Fatalf("empty file %q (%v)", empty, err)
	}
	if m, err := ParseComputeMeasured(empty); err != nil || m.Written != 7 || len(m.Lines) != 0 {
		t.Errorf("empty file parsed as %+v (%v)", m, err)
	}
}

// TestComputeMeasuredRefuses: the parser is strict; each error names the line and the problem.
func TestComputeMeasuredRefuses(t *testing.T) {
	const head = "tessera-compute-measured 1\nwritten 5\n"
	const uuid = "GPU-8f3c1a2e-0b4d-4e6f-9a1b-2c3d4e5f6a7b"
	line := func(s string) string { return head + s + "\n" }
	for name, c := range map[string]struct{ data, want string }{
		"empty":                {"", "empty"},
		"no final newline":     {strings.TrimSuffix(computeMeasuredGolden, "\n"), "newline"},
		"wrong header":         {"tessera-compute-measured 2\nwritten 5\n", `line 1: want the header`},
		"CRLF header":          {"tessera-compute-measured 1\r\nwritten 5\n", "line 1"},
		"no written":           {"tessera-compute-measured 1\n", "line 2: missing"},
		"written twice fields": {"tessera-compute-measured 1\nwritten 5 6\n", "line 2"},
		"written leading zero": {"tessera-compute-measured 1\nwritten 05\n", "line 2: written"},
		"written signed":       {"tessera-compute-measured 1\nwritten +5\n", "line 2: written"},
		"blank line":           {head + "\n", "line 3"},
		"comment":              {line("# hi"), "line 3"},
		"double space":         {line("gpu " + uuid + "  pid 1 start 2 busy 3 at 4"), "line 3"},
		"trailing space":       {line("gpu " + uuid + " pid 1 start 2 busy 3 at 4 "), "line 3"},
		"tab":                  {line("gpu " + uuid + " pid\t1 start 2 busy 3 at 4"), "line 3"},
		"wrong keyword":        {line("gpu " + uuid + " pid 1 begin 2 busy 3 at 4"), `line 3: field 5 is "begin"`},
		"uppercase uuid":       {line("gpu GPU-8F3C1A2E-0B4D-4E6F-9A1B-2C3D4E5F6A7B pid 1 start 2 busy 3 at 4"), "line 3: \"GPU-8F3C"},
		"not a uuid":           {line("gpu MIG-8f3c1a2e-0b4d-4e6f-9a1b-2c3d4e5f6a7b pid 1 start 2 busy 3 at 4"), "canonical GPU UUID"},
		"negative busy":        {line("gpu " + uuid + " pid 1 start 2 busy -3 at 4"), "line 3: busy"},
		"leading zero at":      {line("gpu " + uuid + " pid 1 start 2 busy 3 at 04"), "line 3: at"},
		"overflow":             {line("gpu " + uuid + " pid 1 start 2 busy 18446744073709551616 at 4"), "line 3: busy: \"18446744073709551616\" is out of range"},
		"pid zero":             {line("gpu " + uuid + " pid 0 start 2 busy 3 at 4"), "line 3: pid 0"},
		"second line bad":      {line("gpu " + uuid + " pid 1 start 2 busy 3 at 4\ngpu " + uuid + " pid x start 2 busy 3 at 4"), "line 4: pid"},
		"too large":            {head + strings.Repeat("x", ComputeMeasuredMaxBytes), "byte limit"},
		"short gpu line":       {line("gpu " + uuid + " pid 1"), "line 3: want"},
	} {
		t.Run(name, func(t *testing.T) {
			m, err := ParseComputeMeasured([]byte(c.data))
			if err == nil {
				t.Fatalf("accepted as %+v", m)
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %q does not say %q", err, c.want)
			}
		})
	}
	// The byte bound is reached before the line bound (the shortest gpu line is 71 bytes): a
	// file of exactly 256 KiB is accepted, a byte more is not; more than 4096 lines are never
	// encoded.
	exact := []byte(head)
	for len(exact)+71 <= ComputeMeasuredMaxBytes {
		exact = append(exact, "gpu "+uuid+" pid 1 start 2 busy 3 at 4\n"...)
	}
	// The last line's numbers grow by the remainder, spread over its four numbers (each at most
	// 20 digits).
	extra := ComputeMeasuredMaxBytes - len(exact)
	exact = exact[:len(exact)-71]
	num := func() string {
		n := min(extra, 19)
		extra -= n
		return "1" + strings.Repeat("0", n)
	}
	exact = append(exact, "gpu "+uuid+" pid "+num()+" start "+num()+" busy "+num()+" at "+num()+"\n"...)
	if len(exact) != ComputeMeasuredMaxBytes {
		t.Fatalf("test file is %d bytes", len(exact))
	}
	if _, err := ParseComputeMeasured(exact); err != nil {
		t.Fatalf("a file of exactly 256 KiB: %v", err)
	}
	if _, err := ParseComputeMeasured(append(exact, '\n')); err == nil || !strings.Contains(err.Error(), "byte limit") {
		t.Fatalf("256 KiB + 1: %v", err)
	}
	many := &ComputeMeasured{Lines: make([]ComputeMeasuredLine, ComputeMeasuredMaxLines+1)}
	if _, err := EncodeComputeMeasured(many); err == nil || !strings.Contains(err.Error(), "at most 4096") {
		t.Errorf("4097 lines encoded: %v", err)
	}
	for _, bad := range []ComputeMeasuredLine{{UUID: strings.ToUpper(uuid[:4]) + strings.ToUpper(uuid[4:]), PID: 1}, {UUID: uuid, PID: 0}} {
		if _, err := EncodeComputeMeasured(&ComputeMeasured{Lines: []ComputeMeasuredLine{bad}}); err == nil {
			t.Errorf("encoded %+v", bad)
		}
	}
}
