package deviceplugin

import (
	"context"
	"fmt"
	"log/slog"
	"syscall"

	"github.com/fsnotify/fsnotify"
)

// fileID tells one instance of a file from another at the same path. The inode number alone is not
// enough: a restarted kubelet's new kubelet.sock was seen to get the old one's inode number, so
// the change time is part of the identity. The zero value means "no file".
type fileID struct {
	ino       uint64
	ctimeSec  int64
	ctimeNsec int64
}

func statID(path string) fileID {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return fileID{}
	}
	return fileID{ino: st.Ino, ctimeSec: st.Ctim.Sec, ctimeNsec: st.Ctim.Nsec}
}

// watchDir reports (coalesced) that something in dir was created, removed or renamed, which is how
// a kubelet restart shows: it deletes every socket in the directory, then creates kubelet.sock.
// The events only prompt a look; the manager and plugins compare file identities to decide, so a
// missed or spurious event costs nothing but latency. The returned channel is closed when ctx ends
// or the watch fails, after which only the manager's polling notices changes.
func watchDir(ctx context.Context, dir string, log *slog.Logger) (<-chan struct{}, error) {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, fmt.Errorf("create watcher: %w", err)
	}
	if err := w.Add(dir); err != nil {
		w.Close()
		return nil, fmt.Errorf("watch %s: %w", dir, err)
	}
	out := make(chan struct{}, 1)
	go func() {
		defer close(out)
		defer w.Close()
		for {
			select {
			case <-ctx.Done():
				return
			case ev, ok := <-w.Events:
				if !ok {
					return
				}
				if ev.Has(fsnotify.Create) || ev.Has(fsnotify.Remove) || ev.Has(fsnotify.Rename) {
					signal(out)
				}
			case err, ok := <-w.Errors:
				if !ok {
					return
				}
				// An overflow means events were lost; prompt a full look and keep watching.
				log.Warn("watching the device plugin directory", "dir", dir, "err", err)
				signal(out)
			}
		}
	}()
	return out, nil
}
