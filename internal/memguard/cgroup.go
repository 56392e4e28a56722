package memguard

import (
	"bytes"
	"errors"
	"strings"

	"github.com/tessera-gpu/tessera/internal/hostproc"
)

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

// processContainer is the container ID of a host pid, from <hostProc>/<pid>/cgroup.
func processContainer(hostProc string, pid uint32) (string, error) {
	data, err := hostproc.ReadFile(hostProc, pid, "cgroup")
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
