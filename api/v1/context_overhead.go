package v1

import (
	"bytes"
	"fmt"
	"maps"
	"slices"
	"time"
)

// The node agent's measured per-context overhead, published to share containers: written by the
// agent (its memory guard) into ContextOverheadDir under its run directory, which the NRI plugin
// mounts read-only at NodeFilesDirInContainer; read by vcuda at a context creation whose cost it
// does not know (vcuda/README.md, "Measured context overhead"; vcuda/src/limits.h).
//
//	tessera-context-overhead 1
//	written <unix seconds>
//	gpu <uuid> <bytes per context>
//
// vcuda charges the larger of this and its table (ContextOverheadBytes), so the file only ever
// raises a charge.
const (
	ContextOverheadHeader = "tessera-context-overhead 1"
	// NodeFilesDirInContainer is the agent's node-wide files, read-only in every share container.
	// A directory, not the file: the agent replaces the file by rename, which a file bind mount
	// would not follow.
	NodeFilesDirInContainer = "/etc/tessera/node"
	// ContextOverheadFile is the file's name in that directory (and in ContextOverheadDir).
	ContextOverheadFile            = "context-overhead"
	ContextOverheadPathInContainer = NodeFilesDirInContainer + "/" + ContextOverheadFile
	// ContextOverheadDir is the directory under the agent's run directory that holds the file.
	ContextOverheadDir = "node"
	// ContextOverheadMaxAge: vcuda ignores a file written longer ago (vcuda's VC_OVERHEAD_MAX_AGE):
	// the agent stopped measuring.
	ContextOverheadMaxAge = 600 * time.Second
	// ContextOverheadMaxBytes bounds one figure (vcuda's VC_OVERHEAD_MAX_BYTES).
	ContextOverheadMaxBytes = 64 << 30
)

// EncodeContextOverheads renders the file: each GPU (by UUID) with its model's overhead in bytes.
func EncodeContextOverheads(written time.Time, byUUID map[string]int64) ([]byte, error) {
	var b bytes.Buffer
	fmt.Fprintf(&b, "%s\nwritten %d\n", ContextOverheadHeader, written.Unix())
	for _, uuid := range slices.Sorted(maps.Keys(byUUID)) {
		v := byUUID[uuid]
		if !IsGPUUUID(uuid) {
			return nil, fmt.Errorf("context overhead: %q is not a GPU UUID", uuid)
		}
		if v < 1 || v > ContextOverheadMaxBytes {
			return nil, fmt.Errorf("context overhead of %s: %d bytes is not within 1..%d", uuid, v, int64(ContextOverheadMaxBytes))
		}
		fmt.Fprintf(&b, "gpu %s %d\n", uuid, v)
	}
	return b.Bytes(), nil
}
