// Package hostproc reads what the host's /proc says about a process: a file of it, bounded; its
// start time; its PID namespace and its pid there. The node agent runs in the host's PID namespace
// and names processes by host pid (NVML's), while a container's processes know themselves by the
// pid of their own namespace: (PID namespace inode, pid there, start time) names one process in
// both. Files under /proc/<pid> are the kernel's, but a process chooses its command name (in stat)
// and a container partly its cgroup paths: everything is parsed as hostile, never a panic. One
// implementation for the memory guard and the simulated node's NVML (internal/gpu, sim_procs.go).
package hostproc

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// FileLimit bounds every read of a /proc file: a cgroup file holds one line per hierarchy (about
// 14 on cgroup v1), each a path of at most PATH_MAX; stat and status are well under 4 KiB.
const FileLimit = 64 << 10

// ReadFile reads <root>/<pid>/<name>, at most FileLimit bytes (a longer file is an error), without
// following a symlink in its last component.
func ReadFile(root string, pid uint32, name string) ([]byte, error) {
	f, err := os.OpenFile(filepath.Join(root, strconv.FormatUint(uint64(pid), 10), name), os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, FileLimit+1))
	if err != nil {
		return nil, err
	}
	if len(data) > FileLimit {
		return nil, fmt.Errorf("%s of pid %d is over %d bytes", name, pid, FileLimit)
	}
	return data, nil
}

// StartTime is field 22 of a /proc/<pid>/stat line: when the process started, in clock ticks since
// boot. A pid is reused only by a process that starts later, so pid and start time name one
// process. The command name (field 2) is in parentheses and may hold spaces and ')': fields are
// counted after the last ')'.
func StartTime(stat []byte) (uint64, error) {
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, errors.New("stat: no command name")
	}
	fields := strings.Fields(string(stat[i+1:]))
	const startField = 22 - 3 // fields after the name start at field 3 (state)
	if len(fields) <= startField {
		return 0, fmt.Errorf("stat: %d fields after the command name, want more than %d", len(fields), startField)
	}
	t, err := strconv.ParseUint(fields[startField], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("stat: start time: %w", err)
	}
	return t, nil
}

// Start is the start time of pid, from <root>/<pid>/stat.
func Start(root string, pid uint32) (uint64, error) {
	data, err := ReadFile(root, pid, "stat")
	if err != nil {
		return 0, err
	}
	return StartTime(data)
}

// PIDNamespace is the inode of pid's PID namespace, from the <root>/<pid>/ns/pid link
// ("pid:[4026531836]").
func PIDNamespace(root string, pid uint32) (uint64, error) {
	target, err := os.Readlink(filepath.Join(root, strconv.FormatUint(uint64(pid), 10), "ns", "pid"))
	if err != nil {
		return 0, err
	}
	inner, ok := strings.CutPrefix(target, "pid:[")
	if inner, ok = strings.CutSuffix(inner, "]"); !ok {
		return 0, fmt.Errorf("ns/pid of pid %d is %q, not pid:[<inode>]", pid, target)
	}
	ino, err := strconv.ParseUint(inner, 10, 64)
	if err != nil || ino == 0 {
		return 0, fmt.Errorf("ns/pid of pid %d is %q, not pid:[<inode>]", pid, target)
	}
	return ino, nil
}

// NSpid is the last pid of a /proc/<pid>/status file's NSpid line: the pid in the process's own
// PID namespace (the line lists it from the reader's namespace inwards).
func NSpid(status []byte) (uint64, error) {
	for _, line := range strings.Split(string(status), "\n") {
		if rest, ok := strings.CutPrefix(line, "NSpid:"); ok {
			f := strings.Fields(rest)
			if len(f) == 0 {
				return 0, errors.New("status: empty NSpid line")
			}
			v, err := strconv.ParseUint(f[len(f)-1], 10, 32)
			if err != nil || v == 0 {
				return 0, fmt.Errorf("status: NSpid %q", f[len(f)-1])
			}
			return v, nil
		}
	}
	return 0, errors.New("status: no NSpid line")
}

// Identity names one process in every PID namespace that sees it.
type Identity struct {
	PIDNS uint64 // inode of its PID namespace
	NSPID uint64 // its pid there
	Start uint64 // its start time (StartTime)
}

// IdentityOf is the identity of host pid in <root>.
func IdentityOf(root string, pid uint32) (Identity, error) {
	var id Identity
	var err error
	if id.PIDNS, err = PIDNamespace(root, pid); err != nil {
		return id, err
	}
	status, err := ReadFile(root, pid, "status")
	if err != nil {
		return id, err
	}
	if id.NSPID, err = NSpid(status); err != nil {
		return id, fmt.Errorf("pid %d: %w", pid, err)
	}
	if id.Start, err = Start(root, pid); err != nil {
		return id, fmt.Errorf("pid %d: %w", pid, err)
	}
	return id, nil
}
