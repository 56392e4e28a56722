package v1

import (
	"strings"
	"testing"
)

func testLimits() *Limits {
	return &Limits{ContainerID: "abc123", RegionPath: RegionDirInContainer + "/region", GPUs: []GPULimit{
		{UUID: testUUID(0), MemoryBytes: 10 << 30, CoresPercent: 30},
		{UUID: testUUID(1), MemoryBytes: 1, CoresPercent: 100},
	}}
}

func TestLimitsRoundTrip(t *testing.T) {
	data, err := EncodeLimits(testLimits())
	if err != nil {
		t.Fatal(err)
	}
	want := "tessera-vcuda-limits 1\ncontainer abc123\nregion /run/tessera/vcuda/region\ngpu " + testUUID(0) + " 10737418240 30\ngpu " + testUUID(1) + " 1 100\n"
	if string(data) != want {
		t.Fatalf("encoded\n%s\nwant\n%s", data, want)
	}
	l, err := DecodeLimits(append([]byte("# written by tessera-node\n\n"), data...))
	if err != nil {
		t.Fatal(err)
	}
	if l.ContainerID != "abc123" || len(l.GPUs) != 2 || l.GPUs[0].CoresPercent != 30 {
		t.Fatalf("decoded %+v", l)
	}
}

func TestDecodeLimitsRejects(t *testing.T) {
	head := LimitsHeader + "\ncontainer c\nregion /r\n"
	g := "gpu " + testUUID(0) + " "
	cases := []struct{ name, doc, want string }{
		{"empty", "", "missing \"tessera-vcuda-limits 1\" header"},
		{"wrong version", "tessera-vcuda-limits 2\n", "line 1: first line must be"},
		{"unknown keyword", head + "color red\n", `line 4: unknown keyword "color"`},
		{"missing field", head + g + "10\n", "line 4: gpu takes 3 fields, got 2"},
		{"extra field", head + g + "10 10 10\n", "line 4: gpu takes 3 fields, got 4"},
		{"twice", head + "region /s\n", "line 4: region given twice"},
		{"not a number", head + g + "10G 10\n", `memory cap "10G" is not a byte count`},
		{"cores 0", head + g + "10 0\n", "gpu[0].cores: Invalid value: must be between 1 and 100, got 0"},
		{"cores 101", head + g + "10 101\n", "gpu[0].cores: Invalid value: must be between 1 and 100, got 101"},
		{"memory 0", head + g + "0 10\n", "gpu[0].memory: Invalid value: must be at least 1 byte"},
		{"duplicate gpu", head + g + "1 1\n" + g + "1 1\n", "gpu[1].uuid: Invalid value: duplicated GPU"},
		{"no gpu", head, "gpu: Invalid value: must list 1 to 64 GPUs, got 0"},
		{"double space", head + "gpu  " + testUUID(0) + " 1 1\n", "line 4: empty field"},
		{"carriage return", head + g + "1 1\r\n", "line 4: non-ASCII or control character"},
		{"plus sign", head + g + "+1 1\n", `memory cap "+1" is not a byte count`},
		{"duplicate in other case", head + g + "1 1\n" + strings.ToLower(g) + "1 1\n", "gpu[1].uuid: Invalid value: duplicated GPU"},
		{"vertical tab", head + "\v\n", "line 4: non-ASCII or control character"},
		{"trailing tab", head + g + "1 1\t\n", "line 4: empty field"},
		{"relative region", LimitsHeader + "\ncontainer c\nregion r\n" + g + "1 1\n", "region: Invalid value: must be an absolute path"},
		{"no container", LimitsHeader + "\nregion /r\n" + g + "1 1\n", "container: Invalid value: must be a non-empty id"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := DecodeLimits([]byte(tc.doc)); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want it to contain %q", err, tc.want)
			}
		})
	}
}

func FuzzDecodeLimits(f *testing.F) {
	good, _ := EncodeLimits(testLimits())
	f.Add(good)
	f.Add([]byte(LimitsHeader + "\ngpu x 1 1\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		l, err := DecodeLimits(data)
		if err != nil {
			return
		}
		again, err := EncodeLimits(l)
		if err != nil {
			t.Fatalf("decoded limits do not re-encode: %v", err)
		}
		if l2, err := DecodeLimits(again); err != nil || len(l2.GPUs) != len(l.GPUs) {
			t.Fatalf("re-encoded limits differ: %v", err)
		}
	})
}
