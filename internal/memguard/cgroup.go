package memguard

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

// procFileLimit bounds every read of a /proc file: a cgroup file holds one line per hierarchy
// (about 14 on cgroup v1), each a path of at most PATH_MAX; a stat line is well under 1 KiB.
const procFileLimit = 64 << 10

// containerIDLen is the length of a runtime container ID (containerd, CRI-O, Docker: 64 hex).
const containerIDLen = 64

// runtimePrefixes name a container's cgroup under the systemd cgroup driver
// (cri-containerd-<id>.scope, crio-<id>.scope, docker-<id>.scope, libpod-<id>.scope).
var runtimePrefixes = []string{"cri-containerd-", "crio-", "docker-", "libpod-"}

// ContainerFromCgroup is the runtime container ID a /proc/<pid>/cgroup file places the process in,
// or false when it names none, or when its lines disagree. Each line is
// hierarchy-ID:controllers:path (cgroup v2 has the one line 0::path). In each path the outermost
// component that is a container's cgroup counts: the runtime made that one, while a process inside
// a container can only make cgroups below its own, so a nested cgroup named like another
// container's never moves the blame. A CRI-O conmon scope (crio-conmon-<id>) is not the container.
// The file comes from the host, but its paths are partly chosen by the tenant: anything malformed
// is no container, never a panic.
func ContainerFromCgroup(data []byte) (string, bool) {
	found := ""
	for _, line := range bytes.Split(data, []byte{'\n'}) {
		if len(line) == 0 {
			continue
		}
		parts := bytes.SplitN(line, []byte{':'}, 3)
		if len(parts) != 3 {
			continue
		}
		id, ok := containerInPath(string(parts[2]))
		if !ok {
			continue
		}
		if found != "" && found != id {
			return "", false // hierarchies disagree: no attribution is safe
		}
		found = id
	}
	return found, found != ""
}

// containerInPath is the outermost container ID in a cgroup path.
func containerInPath(path string) (string, bool) {
	for _, c := range strings.Split(path, "/") {
		if id, ok := containerInComponent(c); ok {
			return id, true
		}
	}
	return "", false
}

func containerInComponent(c string) (string, bool) {
	if isContainerID(c) {
		return c, true // cgroupfs driver: .../pod<uid>/<id>
	}
	c = strings.TrimSuffix(c, ".scope")
	for _, p := range runtimePrefixes {
		if id, ok := strings.CutPrefix(c, p); ok && isContainerID(id) {
			return id, true
		}
	}
	return "", false
}

func isContainerID(s string) bool {
	if len(s) != containerIDLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// readProcFile reads <hostProc>/<pid>/<name>, at most procFileLimit bytes; a longer file is an error.
func readProcFile(hostProc string, pid uint32, name string) ([]byte, error) {
	f, err := os.OpenFile(filepath.Join(hostProc, strconv.FormatUint(uint64(pid), 10), name), os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, procFileLimit+1))
	if err != nil {
		return nil, err
	}
	if len(data) > procFileLimit {
		return nil, fmt.Errorf("%s of pid %d is over %d bytes", name, pid, procFileLimit)
	}
	return data, nil
}

// processContainer is the container ID of a host pid, from <hostProc>/<pid>/cgroup.
func processContainer(hostProc string, pid uint32) (string, error) {
	data, err := readProcFile(hostProc, pid, "cgroup")
	if err != nil {
		return "", err
	}
	id, ok := ContainerFromCgroup(data)
	if !ok {
		return "", errNoContainer
	}
	return id, nil
}

var errNoContainer = errors.New("the cgroup names no single container")

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

// processStart is the start time of a host pid, from <hostProc>/<pid>/stat.
func processStart(hostProc string, pid uint32) (uint64, error) {
	data, err := readProcFile(hostProc, pid, "stat")
	if err != nil {
		return 0, err
	}
	return StartTime(data)
}
