package v1

import (
	"bytes"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/tessera-gpu/tessera/api/internal/strict"
)

// The vcuda limits file: written by the node agent per container, bind-mounted read-only at
// LimitsPathInContainer, read by vcuda (vcuda/README.md documents the same format).
//
//	tessera-vcuda-limits 1
//	container <container-id>
//	region <absolute path of the shared accounting region>
//	gpu <uuid> <memory-cap-bytes> <cores-percent>
const (
	LimitsHeader          = "tessera-vcuda-limits 1"
	LimitsPathInContainer = "/etc/tessera/vcuda/limits"
	// RegionDirInContainer is where the agent mounts the container's writable accounting directory.
	RegionDirInContainer = "/run/tessera/vcuda"
	// VCUDALibraryInContainer is where share containers find libvcuda.so (/etc/ld.so.preload names it).
	VCUDALibraryInContainer = "/usr/local/lib/tessera/libvcuda.so"
	// LimitsEnv names the variable vcuda honours only when LimitsPathInContainer does not exist (host tests).
	LimitsEnv = "TESSERA_VCUDA_LIMITS"
	// maxLimitsGPUs matches vcuda's table size.
	maxLimitsGPUs = 64
)

// Limits is the content of one container's vcuda limits file.
type Limits struct {
	ContainerID string
	RegionPath  string
	GPUs        []GPULimit
}

// GPULimit caps one visible GPU. CoresPercent 100 means no compute throttling.
type GPULimit struct {
	UUID         string
	MemoryBytes  int64
	CoresPercent int
}

// EncodeLimits validates and renders a limits file.
func EncodeLimits(l *Limits) ([]byte, error) {
	if err := l.Validate(); err != nil {
		return nil, err
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "%s\ncontainer %s\nregion %s\n", LimitsHeader, l.ContainerID, l.RegionPath)
	for _, g := range l.GPUs {
		fmt.Fprintf(&b, "gpu %s %d %d\n", g.UUID, g.MemoryBytes, g.CoresPercent)
	}
	return b.Bytes(), nil
}

// DecodeLimits parses a limits file with the same rules vcuda applies.
func DecodeLimits(data []byte) (*Limits, error) {
	if len(data) > maxDocumentBytes {
		return nil, fmt.Errorf("invalid vcuda limits: %d bytes exceeds the %d byte limit", len(data), maxDocumentBytes)
	}
	l := &Limits{}
	lineNo, header := 0, false
	seen := map[string]bool{}
	fail := func(format string, args ...any) error {
		return fmt.Errorf("invalid vcuda limits: line %d: %s", lineNo, fmt.Sprintf(format, args...))
	}
	// Lines end at '\n' only: a '\r' is a control character, as vcuda sees it.
	for _, line := range strings.Split(string(data), "\n") {
		lineNo++
		if strings.IndexFunc(line, func(r rune) bool { return r > 0x7e || (r < 0x20 && r != '\t') }) >= 0 {
			return nil, fail("non-ASCII or control character")
		}
		if strings.Trim(line, " \t") == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if !header {
			if line != LimitsHeader {
				return nil, fail("first line must be %q, got %q", LimitsHeader, line)
			}
			header = true
			continue
		}
		// Fields are separated by exactly one space or tab, as vcuda parses them.
		f := strings.FieldsFunc(line, func(r rune) bool { return r == ' ' || r == '\t' })
		if strings.Join(f, " ") != strings.Map(func(r rune) rune {
			if r == '\t' {
				return ' '
			}
			return r
		}, line) {
			return nil, fail("empty field (a doubled, leading or trailing separator)")
		}
		want := map[string]int{"container": 2, "region": 2, "gpu": 4}[f[0]]
		if want == 0 {
			return nil, fail("unknown keyword %q (expected container, region or gpu)", f[0])
		}
		if len(f) != want {
			return nil, fail("%s takes %d fields, got %d", f[0], want-1, len(f)-1)
		}
		if f[0] != "gpu" {
			if seen[f[0]] {
				return nil, fail("%s given twice", f[0])
			}
			seen[f[0]] = true
		}
		switch f[0] {
		case "container":
			l.ContainerID = f[1]
		case "region":
			l.RegionPath = f[1]
		case "gpu":
			mem, err := strconv.ParseInt(f[2], 10, 64)
			if err != nil || !digitsOnly(f[2]) {
				return nil, fail("gpu %s: memory cap %q is not a byte count", f[1], f[2])
			}
			cores, err := strconv.Atoi(f[3])
			if err != nil || !digitsOnly(f[3]) {
				return nil, fail("gpu %s: cores %q is not a percent", f[1], f[3])
			}
			l.GPUs = append(l.GPUs, GPULimit{UUID: f[1], MemoryBytes: mem, CoresPercent: cores})
		}
	}
	if !header {
		return nil, fmt.Errorf("invalid vcuda limits: missing %q header", LimitsHeader)
	}
	if err := l.Validate(); err != nil {
		return nil, err
	}
	return l, nil
}

// Validate checks the limits the way vcuda will.
func (l *Limits) Validate() error {
	fe := &strict.Errors{Doc: "vcuda limits"}
	if l.ContainerID == "" || strings.ContainsAny(l.ContainerID, " \t\n#") {
		fe.Add("container", "must be a non-empty id without spaces, got %q", l.ContainerID)
	}
	if !filepath.IsAbs(l.RegionPath) || strings.ContainsAny(l.RegionPath, " \t\n") {
		fe.Add("region", "must be an absolute path without spaces, got %q", l.RegionPath)
	}
	if len(l.GPUs) == 0 || len(l.GPUs) > maxLimitsGPUs {
		fe.Add("gpu", "must list 1 to %d GPUs, got %d", maxLimitsGPUs, len(l.GPUs))
	}
	seen := map[string]bool{}
	for i, g := range l.GPUs {
		p := fmt.Sprintf("gpu[%d]", i)
		if !IsGPUUUID(g.UUID) {
			fe.Add(p+".uuid", "must look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, got %q", g.UUID)
		}
		// vcuda compares UUIDs case-insensitively.
		if seen[strings.ToLower(g.UUID)] {
			fe.Add(p+".uuid", "duplicated GPU %s", g.UUID)
		}
		seen[strings.ToLower(g.UUID)] = true
		if g.MemoryBytes < 1 {
			fe.Add(p+".memory", "must be at least 1 byte, got %d", g.MemoryBytes)
		}
		if g.CoresPercent < 1 || g.CoresPercent > MaxCoresPercent {
			fe.Add(p+".cores", "must be between 1 and 100, got %d", g.CoresPercent)
		}
	}
	return fe.Err()
}

// digitsOnly reports whether s is a plain decimal number (vcuda accepts no sign).
func digitsOnly(s string) bool {
	return s != "" && strings.Trim(s, "0123456789") == ""
}
