package cdi

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/pkg/parser"
	specs "tags.cncf.io/container-device-interface/specs-go"
)

// DefaultPrefix starts the file name of every spec Tessera owns.
const DefaultPrefix = "tessera"

// Writer keeps a spec directory in sync with a set of specs.
type Writer struct {
	Dir string
	// Prefix marks the files this writer owns: <prefix>-<vendor>-<class>.json.
	Prefix string
}

// fileName is the writer's file for a spec kind, e.g. "tessera-tessera.dev-gpu.json".
func (w *Writer) fileName(kind string) string {
	vendor, class := parser.ParseQualifier(kind)
	return w.Prefix + "-" + vendor + "-" + class + ".json"
}

// owned reports whether a file in Dir is one of this writer's.
func (w *Writer) owned(name string) bool {
	return strings.HasPrefix(name, w.Prefix+"-") && (strings.HasSuffix(name, ".json") || strings.HasSuffix(name, ".yaml"))
}

// Sync writes every spec (atomically: temp file + rename, through the CDI library, only when its
// content changed) and removes this writer's files that are no longer in the set. It then loads the
// directory in a CDI cache and fails if any of our specs does not load cleanly.
func (w *Writer) Sync(all []*specs.Spec) error {
	if w.Prefix == "" {
		w.Prefix = DefaultPrefix
	}
	if err := os.MkdirAll(w.Dir, 0o755); err != nil {
		return fmt.Errorf("create CDI spec dir %s: %w (is it writable by the node agent? set --cdi-dir)", w.Dir, err)
	}
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(w.Dir), cdiapi.WithAutoRefresh(false))
	if err != nil && cache == nil {
		return fmt.Errorf("open CDI spec dir %s: %w", w.Dir, err)
	}
	want := map[string]bool{}
	for _, s := range all {
		name := w.fileName(s.Kind)
		want[name] = true
		if same, _ := sameContent(filepath.Join(w.Dir, name), s); same {
			continue
		}
		if err := cache.WriteSpec(s, name); err != nil {
			if errors.Is(err, os.ErrPermission) {
				return fmt.Errorf("write CDI spec %s in %s: %w (the directory is not writable by the node agent; set --cdi-dir)", name, w.Dir, err)
			}
			return fmt.Errorf("write CDI spec %s in %s: %w", name, w.Dir, err)
		}
		// The CDI library writes 0600; specs hold no secrets and non-root clients (nerdctl) read them.
		if err := os.Chmod(filepath.Join(w.Dir, name), 0o644); err != nil {
			return fmt.Errorf("make CDI spec %s readable: %w", name, err)
		}
	}
	entries, err := os.ReadDir(w.Dir)
	if err != nil {
		return fmt.Errorf("list CDI spec dir %s: %w", w.Dir, err)
	}
	for _, e := range entries {
		if e.IsDir() || !w.owned(e.Name()) || want[e.Name()] {
			continue
		}
		if err := cache.RemoveSpec(e.Name()); err != nil {
			return fmt.Errorf("remove stale CDI spec %s: %w", e.Name(), err)
		}
	}
	return w.verify()
}

// verify loads the directory the way containerd does and reports errors in our own files.
func (w *Writer) verify() error {
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(w.Dir), cdiapi.WithAutoRefresh(false))
	if cache == nil {
		return fmt.Errorf("load CDI spec dir %s: %w", w.Dir, err)
	}
	var errs []error
	for path, perrs := range cache.GetErrors() {
		if w.owned(filepath.Base(path)) {
			errs = append(errs, fmt.Errorf("%s: %w", path, errors.Join(perrs...)))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("CDI specs written to %s do not load: %w", w.Dir, errors.Join(errs...))
	}
	return nil
}

// sameContent reports whether path already holds exactly the JSON the CDI library would write.
func sameContent(path string, s *specs.Spec) (bool, error) {
	old, err := os.ReadFile(path)
	if err != nil {
		return false, err
	}
	data, err := json.Marshal(s)
	if err != nil {
		return false, err
	}
	return bytes.Equal(old, data), nil
}
