package memguard

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tessera-gpu/tessera/internal/hostproc"
)

const (
	idA = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	idB = "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210"
)

// TestSecurityContainerFromCgroup: the host's /proc/<pid>/cgroup under every runtime and cgroup
// driver names the container; a nested cgroup a tenant made and named like another container never
// moves the blame; garbage, disagreeing hierarchies and IDs that are not a runtime's name no
// container, never a panic.
func TestSecurityContainerFromCgroup(t *testing.T) {
	for _, c := range []struct {
		name, file string
		want       string // "" for no container
	}{
		{"containerd systemd v2", "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1a2b.slice/cri-containerd-" + idA + ".scope\n", idA},
		{"containerd cgroupfs v2", "0::/kubepods/besteffort/pod0e4b3c1a-1111-2222-3333-444455556666/" + idA + "\n", idA},
		{"crio systemd", "0::/kubepods.slice/kubepods-pod1.slice/crio-" + idA + ".scope\n", idA},
		{"crio conmon is not the container", "0::/kubepods.slice/kubepods-pod1.slice/crio-conmon-" + idA + ".scope\n", ""},
		{"docker", "0::/system.slice/docker-" + idA + ".scope\n", idA},
		{"docker cgroupfs", "0::/docker/" + idA + "\n", idA},
		{"podman", "0::/machine.slice/libpod-" + idA + ".scope\n", idA},
		{"cgroup v1 agree", "12:memory:/kubepods/burstable/pod1/" + idA + "\n11:devices:/kubepods/burstable/pod1/" + idA + "\n1:name=systemd:/kubepods/burstable/pod1/" + idA + "\n", idA},
		{"hybrid: v2 line at the root", "12:memory:/kubepods/pod1/" + idA + "\n0::/\n", idA},
		{"v1 lines disagree", "12:memory:/kubepods/pod1/" + idA + "\n11:devices:/kubepods/pod1/" + idB + "\n", ""},
		{"nested cgroup named like another container", "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-" + idA + ".scope/cri-containerd-" + idB + ".scope\n", idA},
		{"nested cgroupfs", "0::/kubepods/pod1/" + idA + "/" + idB + "\n", idA},
		{"read from a private cgroup namespace (the agent in a container)", "0::/../../kubepods-besteffort.slice/kubepods-besteffort-pod1.slice/cri-containerd-" + idA + ".scope\n", idA},
		{"host process", "0::/system.slice/containerd.service\n", ""},
		{"upper-case hex is no runtime's ID", "0::/kubepods/pod1/" + strings.ToUpper(idA) + "\n", ""},
		{"63 hex", "0::/kubepods/pod1/" + idA[1:] + "\n", ""},
		{"65 hex", "0::/kubepods/pod1/" + idA + "0\n", ""},
		{"prefix without an ID", "0::/kubepods/pod1/cri-containerd-.scope\n", ""},
		{"no path field", idA + "\n", ""},
		{"empty", "", ""},
		{"garbage", "\x00\xff::://\n:\n::\n\n", ""},
		{"CRLF", "0::/kubepods/pod1/" + idA + "\r\n", ""},
	} {
		got, ok := ContainerFromCgroup([]byte(c.file))
		if got != c.want || ok != (c.want != "") {
			t.Errorf("%s: got %q %v, want %q", c.name, got, ok, c.want)
		}
	}
}

func FuzzContainerFromCgroup(f *testing.F) {
	f.Add([]byte("0::/kubepods.slice/cri-containerd-" + idA + ".scope\n"))
	f.Add([]byte("12:memory:/kubepods/pod1/" + idA + "\n11:devices:/kubepods/pod1/" + idB + "\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		if id, ok := ContainerFromCgroup(data); ok && !isContainerID(id) {
			t.Fatalf("%q is not a container ID", id)
		}
	})
}

// TestSecurityProcFileBounded: a /proc file over the bound (or a symlink planted in a fake proc
// tree) is an error, not read whole.
func TestSecurityProcFileBounded(t *testing.T) {
	proc := t.TempDir()
	dir := filepath.Join(proc, "7")
	os.MkdirAll(dir, 0o755)
	big := "0::/kubepods/pod1/" + idA + "\n" + strings.Repeat("x", hostproc.FileLimit)
	os.WriteFile(filepath.Join(dir, "cgroup"), []byte(big), 0o644)
	if _, err := processContainer(proc, 7); err == nil || !strings.Contains(err.Error(), "over") {
		t.Errorf("oversized cgroup file: %v", err)
	}
	os.Symlink("/proc/self/stat", filepath.Join(dir, "stat"))
	if _, err := hostproc.Start(proc, 7); err == nil {
		t.Error("a symlinked stat file was followed")
	}
	if _, err := hostproc.Start(proc, 8); err == nil {
		t.Error("a missing pid has a start time")
	}
}
