package vcuda

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// refLimits parses a limits file the way the spec in README.md reads, written
// independently of the C parser: the fuzz target below checks they agree on
// every input (accept or reject, the failing line, and every parsed value).
func refLimits(text []byte) (string, error) {
	var (
		uuidRe            = regexp.MustCompile(`^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$`)
		header, cont, reg bool
		container, region string
		gpus              []string
		seen              = map[string]bool{}
		lines             = strings.Split(string(text), "\n")
		lineno            int
	)
	if len(text) > 0 && text[len(text)-1] == '\n' {
		lines = lines[:len(lines)-1]
	}
	if len(text) == 0 {
		lines = nil
	}
	digits := func(s string, max uint64) (uint64, bool) {
		if s == "" {
			return 0, false
		}
		for _, c := range s {
			if c < '0' || c > '9' {
				return 0, false
			}
		}
		v, err := strconv.ParseUint(s, 10, 64)
		return v, err == nil && v >= 1 && v <= max
	}
	for _, line := range lines {
		lineno++
		if len(line) >= 8192 {
			return "", fmt.Errorf("%d", lineno)
		}
		for i := 0; i < len(line); i++ {
			if c := line[i]; c > 0x7e || (c < 0x20 && c != '\t') {
				return "", fmt.Errorf("%d", lineno)
			}
		}
		if strings.Trim(line, " \t") == "" || line[0] == '#' {
			continue
		}
		f := strings.Split(strings.ReplaceAll(line, "\t", " "), " ")
		for _, x := range f {
			if x == "" {
				return "", fmt.Errorf("%d", lineno)
			}
		}
		if !header {
			if len(f) != 2 || f[0] != "tessera-vcuda-limits" || f[1] != "1" {
				return "", fmt.Errorf("%d", lineno)
			}
			header = true
			continue
		}
		switch f[0] {
		case "container":
			if len(f) != 2 || cont || len(f[1]) >= 256 {
				return "", fmt.Errorf("%d", lineno)
			}
			cont, container = true, f[1]
		case "region":
			if len(f) != 2 || reg || f[1][0] != '/' || len(f[1]) >= 4096 {
				return "", fmt.Errorf("%d", lineno)
			}
			reg, region = true, f[1]
		case "gpu":
			if len(f) != 4 || !uuidRe.MatchString(f[1]) {
				return "", fmt.Errorf("%d", lineno)
			}
			capb, ok1 := digits(f[2], 1<<63-1)
			cores, ok2 := digits(f[3], 100)
			u := "GPU-" + strings.ToLower(f[1][4:])
			if !ok1 || !ok2 || len(gpus) == 64 || seen[u] {
				return "", fmt.Errorf("%d", lineno)
			}
			seen[u] = true
			gpus = append(gpus, fmt.Sprintf("%s %d %d", u, capb, cores))
		default:
			return "", fmt.Errorf("%d", lineno)
		}
	}
	if !header || !cont || !reg || len(gpus) == 0 {
		return "", fmt.Errorf("%d", lineno)
	}
	return "OK " + container + "\t" + region + "\t" + strings.Join(gpus, "\t"), nil
}

// The C parser, in a helper process kept for the whole fuzz worker.
type limitsHelper struct {
	mu  sync.Mutex
	in  io.WriteCloser
	out *bufio.Reader
	cmd *exec.Cmd
}

var (
	helperOnce sync.Once
	helperBin  string
	helperErr  error
	helperDir  string // removed by TestMain
	helpersMu  sync.Mutex
	helpers    = map[string]*limitsHelper{} // by mode
)

// startHelper builds just the helper (each fuzz worker is its own process and
// builds its own copy, quickly) and starts it on the limits file.
func startHelper(tb testing.TB) *limitsHelper { return startHelperMode(tb, "") }

// startHelperMode starts the helper on one file kind: "" the limits file,
// "measured" the node agent's measured compute file.
func startHelperMode(tb testing.TB, mode string) *limitsHelper {
	helperOnce.Do(func() {
		for _, tool := range []string{"make", "gcc"} {
			if _, err := exec.LookPath(tool); err != nil {
				helperErr = fmt.Errorf("%s not found (the limits fuzzer needs gcc and make): %v", tool, err)
				return
			}
		}
		dir, err := os.MkdirTemp("", "vcuda-limits-helper-")
		if err != nil {
			helperErr = err
			return
		}
		helperDir = dir
		helperBin = filepath.Join(dir, "limits_helper")
		if out, err := exec.Command("make", "-s", "BUILD="+dir, helperBin).CombinedOutput(); err != nil {
			helperErr = fmt.Errorf("make limits_helper: %v\n%s", err, out)
		}
	})
	if helperErr != nil {
		tb.Fatal(helperErr)
	}
	helpersMu.Lock()
	defer helpersMu.Unlock()
	if h := helpers[mode]; h != nil {
		return h
	}
	var args []string
	if mode != "" {
		args = append(args, mode)
	}
	cmd := exec.Command(helperBin, args...)
	cmd.WaitDelay = 5 * time.Second
	in, err := cmd.StdinPipe()
	if err != nil {
		tb.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		tb.Fatalf("start %s: %v", helperBin, err)
	}
	h := &limitsHelper{in: in, out: bufio.NewReaderSize(out, 1<<20), cmd: cmd}
	helpers[mode] = h
	return h
}

func (h *limitsHelper) parse(tb testing.TB, data []byte) string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var n [4]byte
	binary.LittleEndian.PutUint32(n[:], uint32(len(data)))
	if _, err := h.in.Write(append(n[:], data...)); err != nil {
		tb.Fatalf("C parser died (crash or sanitizer report) on %q: %v", data, err)
	}
	line, err := h.out.ReadString('\n')
	if err != nil {
		tb.Fatalf("C parser died (crash or sanitizer report) on %q: %v", data, err)
	}
	return strings.TrimSuffix(line, "\n")
}

// FuzzLimitsParser: the C parser (under ASan/UBSan where available) never
// crashes and agrees with the reference reading of the spec.
func FuzzLimitsParser(f *testing.F) {
	u0 := "GPU-fa4e0000-0000-4000-8000-000000000000"
	for _, s := range []string{
		"tessera-vcuda-limits 1\ncontainer c\nregion /r\ngpu " + u0 + " 1024 50\n",
		"# c\n\ntessera-vcuda-limits 1\ncontainer\tc\nregion /r\ngpu " + strings.ToUpper(u0) + " 9223372036854775807 100",
		"tessera-vcuda-limits 1\ncontainer c\nregion /r\ngpu " + u0 + " 0 50\n",
		"tessera-vcuda-limits 1\ncontainer c\nregion /r\ngpu " + u0 + " 1 1\ngpu " + u0 + " 1 1\n",
		"tessera-vcuda-limits 1 \n",
		"tessera-vcuda-limits 1\r\ncontainer c\n",
		"",
		"\n\n#\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 1<<16 {
			return
		}
		got := startHelper(t).parse(t, data)
		want, err := refLimits(data)
		if err != nil {
			if !strings.HasPrefix(got, "ERR "+err.Error()+"\t") {
				t.Fatalf("input %q: C says %q, reference rejects at line %s", data, got, err)
			}
			return
		}
		if got != want {
			t.Fatalf("input %q:\n C:         %q\n reference: %q", data, got, want)
		}
	})
}

// The measured file's process and GPUs the helper asks about (test/limits_helper.c).
const (
	measuredPID   = 42
	measuredStart = 98765
	measuredU0    = "GPU-8f3c1a2e-0b4d-4e6f-9a1b-2c3d4e5f6a7b"
	measuredU1    = "GPU-8f3c1a2e-0b4d-4e6f-9a1b-2c3d4e5f6a7c"
)

// refMeasured reads the node agent's measured compute file as the contract
// (session 19; src/limits.h) writes it, independently of the C parser:
// "OK <written> <found busy at> <found busy at>" for measuredPID and
// measuredStart on measuredU0 and measuredU1, or the failing line.
func refMeasured(text []byte) (string, error) {
	fail := func(line int) (string, error) { return "", fmt.Errorf("%d", line) }
	if len(text) > 256<<10 {
		return fail(0)
	}
	if len(text) > 0 && text[len(text)-1] != '\n' {
		return fail(strings.Count(string(text), "\n") + 1)
	}
	uuidRe := regexp.MustCompile(`^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)
	num := func(s string) (uint64, bool) {
		if s == "" || (s[0] == '0' && len(s) > 1) || strings.Trim(s, "0123456789") != "" {
			return 0, false
		}
		v, err := strconv.ParseUint(s, 10, 64)
		return v, err == nil
	}
	var written uint64
	type line struct {
		found    bool
		busy, at uint64
	}
	var got [2]line
	lines := strings.Split(string(text), "\n")
	lines = lines[:len(lines)-1] // the text ends in "\n" (or is empty)
	gpus := 0
	for i, l := range lines {
		n := i + 1
		if len(l) >= 256 {
			return fail(n)
		}
		for j := 0; j < len(l); j++ {
			if c := l[j]; c < 0x20 || c > 0x7e {
				return fail(n)
			}
		}
		f := strings.Split(l, " ")
		if len(f) > 10 {
			return fail(n)
		}
		for _, x := range f {
			if x == "" {
				return fail(n)
			}
		}
		switch n {
		case 1:
			if len(f) != 2 || f[0] != "tessera-compute-measured" || f[1] != "1" {
				return fail(n)
			}
			continue
		case 2:
			if len(f) != 2 || f[0] != "written" {
				return fail(n)
			}
			v, ok := num(f[1])
			if !ok {
				return fail(n)
			}
			written = v
			continue
		}
		if len(f) != 10 || f[0] != "gpu" || f[2] != "pid" || f[4] != "start" || f[6] != "busy" || f[8] != "at" || !uuidRe.MatchString(f[1]) {
			return fail(n)
		}
		pid, ok1 := num(f[3])
		start, ok2 := num(f[5])
		busy, ok3 := num(f[7])
		at, ok4 := num(f[9])
		if !ok1 || !ok2 || !ok3 || !ok4 {
			return fail(n)
		}
		if gpus++; gpus > 4096 {
			return fail(n)
		}
		if pid != measuredPID || start != measuredStart {
			continue
		}
		for k, u := range []string{measuredU0, measuredU1} {
			if f[1] != u {
				continue
			}
			if got[k].found {
				return fail(n)
			}
			got[k] = line{true, busy, at}
		}
	}
	if len(lines) < 2 {
		return fail(len(lines))
	}
	out := fmt.Sprintf("OK %d", written)
	for _, g := range got {
		found := 0
		if g.found {
			found = 1
		}
		out += fmt.Sprintf(" %d %d %d", found, g.busy, g.at)
	}
	return out, nil
}

// FuzzMeasuredParser: the C parser of the node agent's measured compute file
// (under ASan/UBSan where available) never crashes and agrees with the
// reference reading of the contract.
func FuzzMeasuredParser(f *testing.F) {
	for _, s := range []string{
		"tessera-compute-measured 1\nwritten 123456789000\ngpu " + measuredU0 + " pid 42 start 98765 busy 1500000 at 123400000000\n",
		"tessera-compute-measured 1\nwritten 0\ngpu " + measuredU1 + " pid 42 start 98765 busy 0 at 18446744073709551615\ngpu " + measuredU0 + " pid 42 start 1 busy 5 at 5\n",
		"tessera-compute-measured 1\nwritten 1\ngpu " + measuredU0 + " pid 42 start 98765 busy 1 at 1\ngpu " + measuredU0 + " pid 42 start 98765 busy 2 at 2\n",
		"tessera-compute-measured 1\nwritten 01\n",
		"tessera-compute-measured 1\nwritten 1",
		"tessera-compute-measured 1\nwritten 1\ngpu " + strings.ToUpper(measuredU0) + " pid 42 start 98765 busy 1 at 1\n",
		"tessera-compute-measured 1\n",
		"tessera-compute-measured 1\n00\n",
		"",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 300<<10 {
			return
		}
		got := startHelperMode(t, "measured").parse(t, data)
		want, err := refMeasured(data)
		if err != nil {
			if !strings.HasPrefix(got, "ERR line "+err.Error()+":") {
				t.Fatalf("input %q: C says %q, reference rejects at line %s", data, got, err)
			}
			return
		}
		if got != want {
			t.Fatalf("input %q:\n C:         %q\n reference: %q", data, got, want)
		}
	})
}

// regionImage is a well-formed region image laid out as src/region.h writes
// it, with one GPU record in use.
func regionImage() []byte {
	img := make([]byte, 4096+64*256+1024*576)
	le := binary.LittleEndian
	le.PutUint64(img[0:], RegionMagic)
	le.PutUint32(img[8:], RegionVersion)
	le.PutUint32(img[12:], 4096)
	le.PutUint64(img[16:], uint64(len(img)))
	le.PutUint32(img[24:], 1)
	le.PutUint32(img[28:], 1024)
	le.PutUint32(img[32:], 4096)
	le.PutUint32(img[36:], 256)
	le.PutUint32(img[40:], 4096+64*256)
	le.PutUint32(img[44:], 576)
	copy(img[4096:], "GPU-fa4e0000-0000-4000-8000-000000000000")
	return img
}

// regionWithContexts is regionImage with two GPU records and one live slot (pid 42) whose
// context record holds: GPU 0, 2 contexts charged 1400 MiB (of 1464 MiB used); GPU 1 twice; a GPU
// record not in use; a saturated count; a charge over what the slot holds on GPU 2... (see
// TestRegionSlotContexts for what each must read as).
func regionWithContexts() []byte {
	img := regionImage()
	le := binary.LittleEndian
	le.PutUint32(img[24:], 3)
	copy(img[4096+256:], "GPU-fa4e0000-0000-4000-8000-000000000001")
	copy(img[4096+512:], "GPU-fa4e0000-0000-4000-8000-000000000002")
	slot := img[4096+64*256:]
	le.PutUint32(slot[0:], 42)
	le.PutUint32(slot[4:], 2)
	le.PutUint64(slot[8:], 777)
	le.PutUint64(slot[24:], 4026531836)
	le.PutUint64(slot[64:], 1464<<20)
	le.PutUint64(slot[72:], 600<<20)
	le.PutUint64(slot[80:], 10<<20)
	word := func(g, n, pages uint32) uint32 { return (g + 1) | n<<7 | pages<<13 }
	for i, w := range []uint32{
		word(0, 2, 700),  // GPU 0: two contexts, 1400 MiB
		word(1, 1, 256),  // GPU 1 named twice: neither entry counts
		word(1, 1, 256),  //
		word(9, 1, 256),  // GPU record 9 is not in use
		word(2, 63, 1),   // too many contexts to count
		word(2, 1, 2000), // 4000 MiB charged, 10 MiB held
		0x7f,             // GPU record 126, no contexts
	} {
		le.PutUint32(slot[32+4*i:], w)
	}
	return img
}

// TestRegionSlotContexts: the context records of a slot are read as written, and every entry a
// container could write to skew the agent's measurement (a GPU twice, a record not in use, a count
// that was not counted, a charge over the slot's use) is no record.
func TestRegionSlotContexts(t *testing.T) {
	r, err := ParseRegion(regionWithContexts())
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Processes) != 1 {
		t.Fatalf("processes %+v", r.Processes)
	}
	p := r.Processes[0]
	want := []RegionContexts{{GPU: 0, Count: 2, Charged: 1400 << 20}}
	if !slices.Equal(p.Contexts, want) || p.PID != 42 || !p.Live || p.StartTime != 777 || p.PIDNS != 4026531836 {
		t.Fatalf("slot %+v, want contexts %+v", p, want)
	}
}

type craftedRegion struct {
	name string
	img  []byte
}

// craftedRegions are images a container can write into its own region to
// make a reader index past a record (issue 28: a GPU record shorter than the
// 232 bytes read of it, ending at the end of the file, panicked ParseRegion
// and blanked the agent's /metrics). Each must be refused with an error.
func craftedRegions() []craftedRegion {
	le := binary.LittleEndian
	var out []craftedRegion
	put := func(name string, edit func(img []byte) []byte) {
		img := edit(regionImage())
		out = append(out, craftedRegion{name, img[:len(img):len(img)]}) // no capacity to read past the end into
	}
	put("short gpu record at the end", func(img []byte) []byte {
		img = img[:4096+224]
		le.PutUint64(img[16:], uint64(len(img)))
		le.PutUint32(img[28:], 0)
		le.PutUint32(img[36:], 224)
		le.PutUint32(img[40:], 4096)
		return img
	})
	put("short slot at the end", func(img []byte) []byte {
		img = img[:4096+256+64]
		le.PutUint64(img[16:], uint64(len(img)))
		le.PutUint32(img[28:], 1)
		le.PutUint32(img[40:], 4096+256)
		le.PutUint32(img[44:], 64)
		le.PutUint32(img[4096+256:], 1) // a live pid
		return img
	})
	put("gpu records over the header", func(img []byte) []byte {
		le.PutUint32(img[32:], 0)
		return img
	})
	put("gpu records past the end", func(img []byte) []byte {
		le.PutUint32(img[24:], 64)
		le.PutUint32(img[32:], uint32(len(img))-256)
		return img
	})
	put("total past the file", func(img []byte) []byte {
		le.PutUint64(img[16:], 1<<63)
		return img
	})
	put("too many slots", func(img []byte) []byte {
		le.PutUint32(img[28:], 1<<31)
		le.PutUint32(img[44:], 1<<31)
		return img
	})
	put("header size", func(img []byte) []byte {
		le.PutUint32(img[12:], 1)
		return img
	})
	return out
}

// FuzzParseRegion: the Go reader never panics on a damaged region file. The
// seeds hold every crafted image above, so plain `go test` runs them.
func FuzzParseRegion(f *testing.F) {
	img := regionImage()
	f.Add(img)
	f.Add(img[:4096])
	for _, c := range craftedRegions() {
		f.Add(c.img)
	}
	f.Add(regionWithContexts())
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := ParseRegion(b)
		if err == nil && (len(r.GPUs) > 64 || r == nil) {
			t.Fatalf("accepted %d gpus", len(r.GPUs))
		}
		if err != nil {
			return
		}
		for _, p := range r.Processes {
			for _, c := range p.Contexts {
				if c.GPU < 0 || c.GPU >= len(r.GPUs) || c.Count == 0 || c.Count >= 63 || c.Charged > p.Used[c.GPU] {
					t.Fatalf("context record %+v of a slot holding %v", c, p.Used)
				}
			}
		}
	})
}

// TestSecurityCraftedRegion: a region image a container crafted to make the
// agent's reader index past a record is refused with an error naming the bad
// field (not a panic, which took down /metrics for every container), and the
// well-formed image still reads.
func TestSecurityCraftedRegion(t *testing.T) {
	if r, err := ParseRegion(regionImage()); err != nil || len(r.GPUs) != 1 || r.GPUs[0].UUID != "GPU-fa4e0000-0000-4000-8000-000000000000" {
		t.Fatalf("well-formed image: %+v, %v", r, err)
	}
	for _, c := range craftedRegions() {
		t.Run(c.name, func(t *testing.T) {
			defer func() {
				if p := recover(); p != nil {
					t.Fatalf("ParseRegion panicked: %v", p)
				}
			}()
			r, err := ParseRegion(c.img)
			if err == nil {
				t.Fatalf("crafted image accepted: %+v", r)
			}
			if !strings.HasPrefix(err.Error(), "vcuda region: ") {
				t.Errorf("error %q does not say what was wrong", err)
			}
			t.Log(err)
		})
	}
}

// Every limits file the node agent can write (api.EncodeLimits) is read by
// vcuda's C parser with exactly the values written.
func TestAPIEncodedLimitsReadByVcuda(t *testing.T) {
	h := startHelper(t)
	rng := rand.New(rand.NewSource(1))
	hex := func(n int) string {
		const digits = "0123456789abcdefABCDEF"
		b := make([]byte, n)
		for i := range b {
			b[i] = digits[rng.Intn(len(digits))]
		}
		return string(b)
	}
	for i := 0; i < 500; i++ {
		l := &api.Limits{
			ContainerID: fmt.Sprintf("ctr-%d-%s", i, hex(12)),
			RegionPath:  fmt.Sprintf("/run/tessera/vcuda/%s.region", hex(8)),
		}
		n := 1 + rng.Intn(64)
		if i < 3 {
			n = []int{1, 64, 8}[i]
		}
		var want []string
		for g := 0; g < n; g++ {
			u := fmt.Sprintf("GPU-%08x-%s-%s-%s-%s", g, hex(4), hex(4), hex(4), hex(12))
			mem := rng.Int63()%(1<<40) + 1
			if g == 0 && i%7 == 0 {
				mem = 1<<63 - 1
			}
			cores := 1 + rng.Intn(100)
			l.GPUs = append(l.GPUs, api.GPULimit{UUID: u, MemoryBytes: mem, CoresPercent: cores})
			want = append(want, fmt.Sprintf("GPU-%s %d %d", strings.ToLower(u[4:]), mem, cores))
		}
		data, err := api.EncodeLimits(l)
		if err != nil {
			t.Fatalf("EncodeLimits: %v", err)
		}
		got := h.parse(t, data)
		exp := "OK " + l.ContainerID + "\t" + l.RegionPath + "\t" + strings.Join(want, "\t")
		if got != exp {
			t.Fatalf("api wrote\n%s\nvcuda read %q\nwant %q", data, got, exp)
		}
	}
}
