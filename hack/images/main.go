// Command images builds Tessera's OCI images without a container daemon, with go-containerregistry:
// one layer made of the files named on the command line (built binaries, libvcuda.so, Debian
// packages unpacked by `make images`), on no base image. The output is reproducible: entries are
// sorted, owned by root, dated SOURCE_DATE_EPOCH, and so the same inputs give the same digests.
//
//	go run ./hack/images --name ghcr.io/tessera-gpu/tessera-node:v1 --out bin/images/tessera-node.tar \
//	  --add bin/tessera-node:/usr/bin/tessera-node --add .cache/debs/libc6:/ --entrypoint /usr/bin/tessera-node
//
// The archive is an OCI image layout (what `ctr images import` and `skopeo copy oci-archive:` read).
package main

import (
	"archive/tar"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/tessera-gpu/tessera/internal/fsatomic"
)

type multi []string

func (m *multi) String() string     { return strings.Join(*m, ",") }
func (m *multi) Set(v string) error { *m = append(*m, v); return nil }

func main() {
	if err := run(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "images:", err)
		os.Exit(1)
	}
}

type options struct {
	name, out, user string
	adds, links     multi
	entrypoint      multi
	env, labels     multi
	epoch           int64
}

func run(args []string) error {
	fs := flag.NewFlagSet("images", flag.ContinueOnError)
	var o options
	fs.StringVar(&o.name, "name", "", "image reference, e.g. ghcr.io/tessera-gpu/tessera-node:v0.1.0")
	fs.StringVar(&o.out, "out", "", "OCI layout archive to write (.tar)")
	fs.StringVar(&o.user, "user", "", "user the image runs as (e.g. 65532:65532)")
	fs.Var(&o.adds, "add", "SRC:DST: a file, or a folder's contents, into the image at DST (repeatable)")
	fs.Var(&o.links, "symlink", "PATH:TARGET: a symbolic link in the image (repeatable)")
	fs.Var(&o.entrypoint, "entrypoint", "the entrypoint, one argument per flag")
	fs.Var(&o.env, "env", "K=V in the image's environment (repeatable)")
	fs.Var(&o.labels, "label", "K=V image label (repeatable)")
	epoch, _ := strconv.ParseInt(os.Getenv("SOURCE_DATE_EPOCH"), 10, 64)
	fs.Int64Var(&o.epoch, "epoch", epoch, "timestamp of every file and of the image, in seconds (default $SOURCE_DATE_EPOCH, else 0)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if o.name == "" || o.out == "" || len(o.adds) == 0 {
		return fmt.Errorf("--name, --out and at least one --add are required (see --help)")
	}
	img, err := build(o)
	if err != nil {
		return err
	}
	digest, err := img.Digest()
	if err != nil {
		return err
	}
	if err := writeArchive(o.out, o.name, img, time.Unix(o.epoch, 0)); err != nil {
		return err
	}
	fmt.Printf("%s %s %s\n", o.out, o.name, digest)
	return nil
}

// build makes the image: one layer, an OCI manifest and config.
func build(o options) (v1.Image, error) {
	mtime := time.Unix(o.epoch, 0).UTC()
	entries := map[string]*entry{}
	for _, a := range o.adds {
		src, dst, ok := strings.Cut(a, ":")
		if !ok || !path.IsAbs(dst) {
			return nil, fmt.Errorf("--add %q: want SRC:/absolute/DST", a)
		}
		if err := collect(entries, src, dst); err != nil {
			return nil, fmt.Errorf("--add %q: %w", a, err)
		}
	}
	for _, l := range o.links {
		p, target, ok := strings.Cut(l, ":")
		if !ok || !path.IsAbs(p) {
			return nil, fmt.Errorf("--symlink %q: want /PATH:TARGET", l)
		}
		addParents(entries, p)
		entries[path.Clean(p)] = &entry{link: target}
	}
	data, err := layerTar(entries, mtime)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(strings.NewReader(data)), nil },
		tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, fmt.Errorf("layer: %w", err)
	}
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	if img, err = mutate.AppendLayers(img, layer); err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.Architecture, cf.OS = "amd64", "linux"
	cf.Created = v1.Time{Time: mtime}
	cf.Config.Entrypoint = o.entrypoint
	cf.Config.User = o.user
	cf.Config.Env = append([]string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, o.env...)
	cf.Config.Labels = map[string]string{}
	for _, l := range o.labels {
		k, v, ok := strings.Cut(l, "=")
		if !ok {
			return nil, fmt.Errorf("--label %q: want K=V", l)
		}
		cf.Config.Labels[k] = v
	}
	cf.History = nil
	return mutate.ConfigFile(img, cf)
}

// entry is one path of the layer: a file from the host, a folder or a link.
type entry struct {
	src  string // regular file to copy
	mode fs.FileMode
	link string
	dir  bool
}

// collect adds src (a file, or a folder's contents recursively) at dst.
func collect(entries map[string]*entry, src, dst string) error {
	st, err := os.Lstat(src)
	if err != nil {
		return err
	}
	if !st.IsDir() {
		return add(entries, src, path.Clean(dst), st)
	}
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil || rel == "." {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		return add(entries, p, path.Join(dst, filepath.ToSlash(rel)), info)
	})
}

func add(entries map[string]*entry, src, dst string, st fs.FileInfo) error {
	addParents(entries, dst)
	switch {
	case st.Mode()&fs.ModeSymlink != 0:
		target, err := os.Readlink(src)
		if err != nil {
			return err
		}
		entries[dst] = &entry{link: target}
	case st.IsDir():
		entries[dst] = &entry{dir: true, mode: st.Mode().Perm()}
	case st.Mode().IsRegular():
		// Only the executable bits of the source count: the same file gives the same layer
		// whatever the umask of the machine that built it.
		mode := fs.FileMode(0o644)
		if st.Mode()&0o111 != 0 {
			mode = 0o755
		}
		entries[dst] = &entry{src: src, mode: mode}
	default:
		return fmt.Errorf("%s: not a file, folder or link", src)
	}
	return nil
}

func addParents(entries map[string]*entry, p string) {
	for d := path.Dir(p); d != "/" && d != "."; d = path.Dir(d) {
		if _, ok := entries[d]; !ok {
			entries[d] = &entry{dir: true, mode: 0o755}
		}
	}
}

// layerTar writes the entries sorted by path, owned by root, all dated mtime.
func layerTar(entries map[string]*entry, mtime time.Time) (string, error) {
	paths := make([]string, 0, len(entries))
	for p := range entries {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	var b strings.Builder
	tw := tar.NewWriter(&b)
	for _, p := range paths {
		e := entries[p]
		h := &tar.Header{Name: strings.TrimPrefix(p, "/"), ModTime: mtime}
		switch {
		case e.link != "":
			h.Typeflag, h.Linkname, h.Mode = tar.TypeSymlink, e.link, 0o777
		case e.dir:
			h.Typeflag, h.Name, h.Mode = tar.TypeDir, h.Name+"/", 0o755
		default:
			data, err := os.ReadFile(e.src)
			if err != nil {
				return "", err
			}
			h.Typeflag, h.Mode, h.Size = tar.TypeReg, int64(e.mode), int64(len(data))
			if err := tw.WriteHeader(h); err != nil {
				return "", err
			}
			if _, err := tw.Write(data); err != nil {
				return "", err
			}
			continue
		}
		if err := tw.WriteHeader(h); err != nil {
			return "", err
		}
	}
	if err := tw.Close(); err != nil {
		return "", err
	}
	return b.String(), nil
}

// writeArchive writes img as an OCI image layout, named for containerd's import, into a tar
// archive whose entries are sorted and dated mtime.
func writeArchive(out, name string, img v1.Image, mtime time.Time) error {
	dir, err := os.MkdirTemp("", "tessera-image-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	tag := name[strings.LastIndex(name, ":")+1:]
	if strings.Contains(tag, "/") || !strings.Contains(name, ":") {
		return fmt.Errorf("--name %q: want REPOSITORY:TAG", name)
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{
		"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag})); err != nil {
		return err
	}
	var files []string
	if err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			files = append(files, p)
		}
		return err
	}); err != nil {
		return err
	}
	sort.Strings(files)
	return fsatomic.Write(out, 0o644, func(f io.Writer) error {
		return tarFiles(f, dir, files, mtime)
	})
}

// tarFiles writes files (under dir) as a tar archive of regular files dated mtime.
func tarFiles(f io.Writer, dir string, files []string, mtime time.Time) error {
	tw := tar.NewWriter(f)
	for _, p := range files {
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		if err := tw.WriteHeader(&tar.Header{Name: filepath.ToSlash(rel), Mode: 0o644, Size: int64(len(data)), ModTime: mtime, Typeflag: tar.TypeReg}); err != nil {
			return err
		}
		if _, err := tw.Write(data); err != nil {
			return err
		}
	}
	return tw.Close()
}
