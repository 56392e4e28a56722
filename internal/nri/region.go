package nri

import (
	"fmt"
	"io"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// RegionLimit bounds a container's vcuda accounting region: the region (about 0.6 MiB today) lives
// alone on a tmpfs of this size, so a container writing past it fills its own tmpfs, not the
// node's /run; the agent never reads more than this.
const RegionLimit = 4 << 20

// createRegion makes an accounting region in owner's dir (ownerDir: a container's, or a shared
// claim's): an empty file (vcuda sizes and initialises it on first use) on its own size-limited
// tmpfs. The container gets only the FILE (vcudaMountList): it can write it but cannot replace it
// with a FIFO or a symlink, nor create anything beside it.
func (p *Plugin) createRegion(ownerDir string) (string, error) {
	dir := filepath.Join(ownerDir, "vcuda")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("create the container's vcuda directory: %w", err)
	}
	opts := fmt.Sprintf("size=%d,nr_inodes=8,mode=0755", RegionLimit)
	if err := unix.Mount("tessera-region", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, opts); err != nil {
		return "", fmt.Errorf("mount the size-limited tmpfs for the container's accounting region at %s: %w (tessera-node needs CAP_SYS_ADMIN and, in a pod, a Bidirectional mount of its run dir)", dir, err)
	}
	path := filepath.Join(dir, "region")
	// Writable by any user: the container's processes may run as any UID.
	if err := os.WriteFile(path, nil, 0o666); err != nil {
		return "", fmt.Errorf("create the container's accounting region: %w", err)
	}
	if err := os.Chmod(path, 0o666); err != nil { // past the umask
		return "", fmt.Errorf("create the container's accounting region: %w", err)
	}
	return path, nil
}

// removeContainerDir removes a container's files, unmounting its region's tmpfs first.
func (p *Plugin) removeContainerDir(id string) {
	removeOwnerDir(p.containerDir(id))
}

// removeOwnerDir removes a container's or a claim's vcuda files, unmounting the region's tmpfs
// first.
func removeOwnerDir(dir string) {
	if err := unix.Unmount(filepath.Join(dir, "vcuda"), unix.MNT_DETACH); err != nil && err != unix.EINVAL && err != unix.ENOENT {
		fmt.Fprintf(os.Stderr, "unmount %s: %v\n", filepath.Join(dir, "vcuda"), err)
	}
	os.RemoveAll(dir)
}

// ReadRegion reads a container's (or, by its ledger ID, a claim's) accounting region for /metrics
// without trusting it: the containers write it, so it is opened O_NOFOLLOW|O_NONBLOCK, must be a regular file, and at most RegionLimit
// bytes are read. A region that is not there yet (no CUDA process ran) is an error.
func (p *Plugin) ReadRegion(containerID string) ([]byte, error) {
	f, err := OpenRegular(p.RegionPath(containerID))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(io.LimitReader(f, RegionLimit))
}
