package main

import (
	"archive/tar"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestReproducible: the same inputs give the same image digest and archive bytes, whatever the
// files' own times and modes; every entry is root's and dated the epoch.
func TestReproducible(t *testing.T) {
	src := t.TempDir()
	bin := filepath.Join(src, "tool")
	if err := os.WriteFile(bin, []byte("#!/bin/sh\n"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(src, "tree", "lib"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "tree", "lib", "a.so"), []byte("lib"), 0o600); err != nil {
		t.Fatal(err)
	}
	o := options{name: "example.com/x:v1", adds: multi{bin + ":/usr/bin/tool", filepath.Join(src, "tree") + ":/"},
		links: multi{"/bin/sh:busybox"}, entrypoint: multi{"/usr/bin/tool"}, epoch: 1700000000}
	digestAndArchive := func() (string, []byte) {
		img, err := build(o)
		if err != nil {
			t.Fatal(err)
		}
		d, err := img.Digest()
		if err != nil {
			t.Fatal(err)
		}
		out := filepath.Join(t.TempDir(), "img.tar")
		if err := writeArchive(out, o.name, img, time.Unix(o.epoch, 0)); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		return d.String(), b
	}
	d1, a1 := digestAndArchive()
	// Touch the inputs: new times, other permission bits that do not change what runs.
	later := time.Now().Add(time.Hour)
	os.Chtimes(bin, later, later)
	os.Chmod(filepath.Join(src, "tree", "lib", "a.so"), 0o644)
	d2, a2 := digestAndArchive()
	if d1 != d2 || string(a1) != string(a2) {
		t.Fatalf("not reproducible: %s vs %s (archives equal: %v)", d1, d2, string(a1) == string(a2))
	}
	o.epoch++
	if d3, _ := digestAndArchive(); d3 == d1 {
		t.Fatal("the epoch does not reach the image")
	}

	img, err := build(options{name: o.name, adds: o.adds, links: o.links, epoch: 1700000000})
	if err != nil {
		t.Fatal(err)
	}
	layers, _ := img.Layers()
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	tr := tar.NewReader(rc)
	seen := map[string]*tar.Header{}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Uid != 0 || h.Gid != 0 || !h.ModTime.Equal(time.Unix(1700000000, 0)) {
			t.Errorf("%s: uid %d gid %d mtime %v", h.Name, h.Uid, h.Gid, h.ModTime)
		}
		seen[h.Name] = h
	}
	for name, mode := range map[string]int64{"usr/bin/tool": 0o755, "lib/a.so": 0o644, "usr/": 0o755, "usr/bin/": 0o755} {
		if h := seen[name]; h == nil || h.Mode != mode {
			t.Errorf("%s: %+v, want mode %o", name, h, mode)
		}
	}
	if h := seen["bin/sh"]; h == nil || h.Typeflag != tar.TypeSymlink || h.Linkname != "busybox" {
		t.Errorf("bin/sh: %+v", h)
	}
	// The archive is an OCI layout that names the image for containerd's import.
	dir := t.TempDir()
	out := filepath.Join(dir, "img.tar")
	if err := writeArchive(out, o.name, img, time.Unix(0, 0)); err != nil {
		t.Fatal(err)
	}
	f, _ := os.Open(out)
	defer f.Close()
	names := map[string]bool{}
	atr := tar.NewReader(f)
	for {
		h, err := atr.Next()
		if err != nil {
			break
		}
		names[h.Name] = true
		if h.Name == "index.json" {
			b, _ := io.ReadAll(atr)
			if !strings.Contains(string(b), `"io.containerd.image.name": "example.com/x:v1"`) {
				t.Errorf("index.json does not name the image: %s", b)
			}
		}
	}
	if !names["oci-layout"] || !names["index.json"] {
		t.Errorf("not an OCI layout: %v", names)
	}
}
