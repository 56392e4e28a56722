package memguard

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/tessera-gpu/tessera/internal/hostproc"
)

// errReplaced: the pid no longer names the process that was measured (it exited, or its pid was
// reused by another process, or it left the container).
var errReplaced = errors.New("the process was replaced")

// killProcess sends SIGKILL to a measured process, and only to it. The process is pinned first
// with a pidfd, then re-checked (same start time, same container), then signalled through the
// pidfd: a pid reused after the check cannot receive the signal. Where the kernel has no pidfd
// (before 5.3) the check is followed by kill(2), with the small window that leaves.
func killProcess(hostProc string, p attributed, containerID string) error {
	fd, err := unix.PidfdOpen(int(p.pid), 0)
	switch {
	case errors.Is(err, unix.ESRCH):
		return fmt.Errorf("%w: %v", errReplaced, err)
	case errors.Is(err, unix.ENOSYS):
		fd = -1
	case err != nil:
		return fmt.Errorf("pidfd_open %d: %w", p.pid, err)
	default:
		defer unix.Close(fd)
	}
	if err := sameProcess(hostProc, p, containerID); err != nil {
		return err
	}
	if fd >= 0 {
		err = unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0)
	} else {
		err = unix.Kill(int(p.pid), unix.SIGKILL)
	}
	if errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("%w: %v", errReplaced, err)
	}
	if err != nil {
		return fmt.Errorf("SIGKILL %d: %w", p.pid, err)
	}
	return nil
}

// sameProcess checks that pid still names the process measured: the start time it had then, in
// the container it was in then.
func sameProcess(hostProc string, p attributed, containerID string) error {
	start, err := hostproc.Start(hostProc, p.pid)
	if err != nil {
		return fmt.Errorf("%w: %v", errReplaced, err)
	}
	if start != p.start {
		return fmt.Errorf("%w: pid %d started at tick %d, the measured process at %d", errReplaced, p.pid, start, p.start)
	}
	id, err := processContainer(hostProc, p.pid)
	if err != nil {
		return fmt.Errorf("%w: %v", errReplaced, err)
	}
	if id != containerID {
		return fmt.Errorf("%w: pid %d is now in container %s", errReplaced, p.pid, id)
	}
	return nil
}
