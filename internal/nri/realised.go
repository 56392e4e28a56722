package nri

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"

	nriapi "github.com/containerd/nri/pkg/api"
	"golang.org/x/sys/unix"

	api "github.com/tessera-gpu/tessera/api/v1"
)

const realisedFile = "realised"

// markRealised records that the plugin approved the container: the nonce goes into the adjustment
// and into the container's directory on the host.
func (p *Plugin) markRealised(id string, adj *nriapi.ContainerAdjustment) error {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return fmt.Errorf("realisation nonce: %w", err)
	}
	nonce := hex.EncodeToString(b[:])
	dir := p.containerDir(id)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("create the container's directory: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, realisedFile), []byte(nonce), 0o600); err != nil {
		return fmt.Errorf("write the container's realisation mark: %w", err)
	}
	adj.AddAnnotation(api.AnnotationRealised, nonce)
	return nil
}

// containerIDPattern is what a runtime's container ID looks like; anything else (a path) is refused
// before it is joined into a host path.
var containerIDPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$`)

// CheckRealised is the realisation hook's check: state is the OCI state the runtime passes a hook on
// stdin (its id and the container's annotations). It fails unless the NRI plugin approved this
// container, naming what to do.
func CheckRealised(runDir string, state io.Reader) error {
	var st struct {
		ID          string            `json:"id"`
		Annotations map[string]string `json:"annotations"`
	}
	if err := json.NewDecoder(io.LimitReader(state, 1<<20)).Decode(&st); err != nil {
		return fmt.Errorf("read the container's OCI state on stdin: %w", err)
	}
	if !containerIDPattern.MatchString(st.ID) {
		return fmt.Errorf("container id %q in the OCI state is not a container id", st.ID)
	}
	const notRealised = "container %s holds Tessera GPU devices but the tessera NRI plugin did not realise it (%s); " +
		"it must not run unchecked. Check that tessera-node is running and connected to containerd's NRI socket; the kubelet retries the container"
	got, ok := st.Annotations[api.AnnotationRealised]
	if !ok {
		return fmt.Errorf(notRealised, st.ID, "no "+api.AnnotationRealised+" annotation: the plugin did not answer or is not connected")
	}
	want, err := readSmall(filepath.Join(runDir, "containers", st.ID, realisedFile), 64)
	if err != nil {
		return fmt.Errorf(notRealised, st.ID, "no realisation mark on the host: "+err.Error())
	}
	if string(want) != got {
		return fmt.Errorf(notRealised, st.ID, "its "+api.AnnotationRealised+" annotation does not match the mark on the host")
	}
	return nil
}

// readSmall reads a file the agent wrote, refusing anything but a regular file (no symlink, FIFO or
// device: opened O_NOFOLLOW|O_NONBLOCK) and reading at most max bytes.
func readSmall(path string, max int64) ([]byte, error) {
	f, err := OpenRegular(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(io.LimitReader(f, max))
}

// OpenRegular opens a file for reading without following a symlink in its last component and
// without blocking on a FIFO, and refuses it unless it is a regular file: the files a container can
// write (its accounting region) are read by the privileged agent.
func OpenRegular(path string) (*os.File, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, &os.PathError{Op: "open", Path: path, Err: errors.New("not a regular file (" + fi.Mode().Type().String() + ")")}
	}
	return f, nil
}
