package v1

import (
	"bytes"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// The measured compute file: what the host's driver measured of each of a share container's
// processes (NVML's per-process SM utilisation, integrated over its sample periods), written by the
// node agent into ComputeMeasuredDir beside the container's limits file, which the NRI plugin mounts
// read-only at ComputeMeasuredDirInContainer; read by vcuda as its compute limiter's reference.
//
//	tessera-compute-measured 1
//	written <host CLOCK_MONOTONIC ns of the write>
//	gpu <uuid> pid <pid in the container's PID namespace> start <field 22 of /proc/<pid>/stat> busy <ns> at <host CLOCK_MONOTONIC ns>
//
// Every line ends in "\n", fields are separated by one space, numbers are decimal without sign or
// leading zeros, UUIDs canonical (lowercase hex). busy is the ns during which at least one of the
// process's kernels ran on the GPU since the agent first saw it there; at is the end of the newest
// sample period counted in busy. For one (gpu, pid, start) neither ever decreases.
const (
	ComputeMeasuredHeader = "tessera-compute-measured 1"
	// ComputeMeasuredDir is the directory, in a container's vcuda directory (where its limits file
	// is), that holds the file. A directory is mounted, not the file: the agent replaces the file by
	// rename, which a file bind mount would not follow.
	ComputeMeasuredDir = "measured"
	// ComputeMeasuredFile is the file's name in that directory.
	ComputeMeasuredFile = "compute"
	// ComputeMeasuredDirInContainer is where share containers find the directory (beside
	// LimitsPathInContainer: vcuda reads <directory of its limits file>/measured/compute).
	ComputeMeasuredDirInContainer = "/etc/tessera/vcuda/" + ComputeMeasuredDir
	// ComputeMeasuredMaxBytes and ComputeMeasuredMaxLines bound the file (vcuda reads no more).
	ComputeMeasuredMaxBytes = 256 << 10
	ComputeMeasuredMaxLines = 4096
)

// ComputeMeasured is the content of one measured compute file.
type ComputeMeasured struct {
	// Written is the host CLOCK_MONOTONIC ns of the write.
	Written uint64
	Lines   []ComputeMeasuredLine
}

// ComputeMeasuredLine is one process on one GPU as the driver measured it.
type ComputeMeasuredLine struct {
	UUID string
	// PID is the process's pid in the container's PID namespace; Start its start time (field 22 of
	// /proc/<pid>/stat, clock ticks since boot): together they name one process.
	PID, Start uint64
	// Busy is the cumulative ns at least one of its kernels ran on the GPU; At the host
	// CLOCK_MONOTONIC ns at which the newest period counted in Busy ended.
	Busy, At uint64
}

// isCanonicalGPUUUID is a GPU UUID in lowercase hex, as the file and the limits file write it.
func isCanonicalGPUUUID(s string) bool {
	return IsGPUUUID(s) && s[4:] == strings.ToLower(s[4:])
}

// EncodeComputeMeasured renders the file; it refuses what ParseComputeMeasured would.
func EncodeComputeMeasured(m *ComputeMeasured) ([]byte, error) {
	if len(m.Lines) > ComputeMeasuredMaxLines {
		return nil, fmt.Errorf("measured compute: %d gpu lines, at most %d", len(m.Lines), ComputeMeasuredMaxLines)
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "%s\nwritten %d\n", ComputeMeasuredHeader, m.Written)
	for i, l := range m.Lines {
		if !isCanonicalGPUUUID(l.UUID) {
			return nil, fmt.Errorf("measured compute: line %d: %q is not a canonical GPU UUID (GPU- and lowercase hex)", i, l.UUID)
		}
		if l.PID == 0 {
			return nil, fmt.Errorf("measured compute: line %d: pid 0 names no process", i)
		}
		fmt.Fprintf(&b, "gpu %s pid %d start %d busy %d at %d\n", l.UUID, l.PID, l.Start, l.Busy, l.At)
	}
	if b.Len() > ComputeMeasuredMaxBytes {
		return nil, fmt.Errorf("measured compute: %d bytes, at most %d", b.Len(), ComputeMeasuredMaxBytes)
	}
	return b.Bytes(), nil
}

// ParseComputeMeasured parses a measured compute file strictly: exactly the format
// EncodeComputeMeasured writes, nothing else (no comments, blank lines, extra spaces, signs,
// leading zeros, uppercase UUIDs or a missing final newline). An error names the line (1-based)
// and what is wrong with it.
func ParseComputeMeasured(data []byte) (*ComputeMeasured, error) {
	if len(data) > ComputeMeasuredMaxBytes {
		return nil, fmt.Errorf("invalid measured compute file: %d bytes exceeds the %d byte limit", len(data), ComputeMeasuredMaxBytes)
	}
	if len(data) == 0 {
		return nil, errors.New("invalid measured compute file: empty (want the header " + strconv.Quote(ComputeMeasuredHeader) + ")")
	}
	if data[len(data)-1] != '\n' {
		return nil, errors.New("invalid measured compute file: the last line does not end in a newline (a truncated file?)")
	}
	lines := strings.Split(string(data[:len(data)-1]), "\n")
	fail := func(n int, format string, args ...any) error {
		return fmt.Errorf("invalid measured compute file: line %d: %s", n+1, fmt.Sprintf(format, args...))
	}
	if lines[0] != ComputeMeasuredHeader {
		return nil, fail(0, "want the header %q, got %q", ComputeMeasuredHeader, lines[0])
	}
	if len(lines) < 2 {
		return nil, fail(1, "missing: want \"written <ns>\"")
	}
	m := &ComputeMeasured{}
	if len(lines)-2 > ComputeMeasuredMaxLines {
		return nil, fmt.Errorf("invalid measured compute file: %d gpu lines, at most %d", len(lines)-2, ComputeMeasuredMaxLines)
	}
	w := strings.Split(lines[1], " ")
	if len(w) != 2 || w[0] != "written" {
		return nil, fail(1, "want \"written <ns>\", got %q", lines[1])
	}
	var err error
	if m.Written, err = parseMeasuredNumber(w[1]); err != nil {
		return nil, fail(1, "written: %v", err)
	}
	keys := [...]string{"gpu", "", "pid", "", "start", "", "busy", "", "at", ""}
	for n := 2; n < len(lines); n++ {
		f := strings.Split(lines[n], " ")
		if len(f) != len(keys) {
			return nil, fail(n, "want \"gpu <uuid> pid <n> start <n> busy <ns> at <ns>\" (10 fields separated by one space), got %d fields: %q", len(f), lines[n])
		}
		var l ComputeMeasuredLine
		for i, k := range keys {
			if k != "" && f[i] != k {
				return nil, fail(n, "field %d is %q, want %q", i+1, f[i], k)
			}
		}
		l.UUID = f[1]
		if !isCanonicalGPUUUID(l.UUID) {
			return nil, fail(n, "%q is not a canonical GPU UUID (GPU- and lowercase hex, as in the limits file)", l.UUID)
		}
		for _, v := range []struct {
			name string
			to   *uint64
			s    string
		}{{"pid", &l.PID, f[3]}, {"start", &l.Start, f[5]}, {"busy", &l.Busy, f[7]}, {"at", &l.At, f[9]}} {
			if *v.to, err = parseMeasuredNumber(v.s); err != nil {
				return nil, fail(n, "%s: %v", v.name, err)
			}
		}
		if l.PID == 0 {
			return nil, fail(n, "pid 0 names no process")
		}
		m.Lines = append(m.Lines, l)
	}
	return m, nil
}

// parseMeasuredNumber is a decimal uint64 without sign or leading zeros ("0" itself allowed).
func parseMeasuredNumber(s string) (uint64, error) {
	if !digitsOnly(s) || len(s) > 1 && s[0] == '0' {
		return 0, fmt.Errorf("%q is not a decimal number without sign or leading zeros", s)
	}
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%q is out of range for 64 bits", s)
	}
	return v, nil
}
