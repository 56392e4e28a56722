package podresourcestest

import (
	"context"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/tessera-gpu/tessera/internal/podresources"
)

// TestClientReadsWhatTheServerWasTold: grants of device-plugin resources and of DRA claims (one with
// no devices) come back through the real client as they were added; a forgotten pod is gone.
func TestClientReadsWhatTheServerWasTold(t *testing.T) {
	dir, err := os.MkdirTemp("/tmp", "tsr-podres-") // unix socket paths are short
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	s := NewServer()
	main := podresources.Key{Namespace: "ns", Pod: "p", Container: "main"}
	side := podresources.Key{Namespace: "ns", Pod: "p", Container: "side"}
	other := podresources.Key{Namespace: "ns", Pod: "q", Container: "main"}
	s.Add(main, "nvidia.com/gpu", "gpu-0", "gpu-1")
	s.Add(main, podresources.ClaimKey("ns", "c1"), "gpu.tessera.dev/node-a/gpu-2")
	s.Add(main, podresources.ClaimKey("ns", "empty"))
	s.Add(side, "tessera.dev/vgpu", "vgpu-3")
	s.Add(other, "tessera.dev/vgpu", "vgpu-4")
	srv, err := s.Serve(filepath.Join(dir, "podres.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	c := podresources.New(filepath.Join(dir, "podres.sock"))
	t.Cleanup(func() { c.Close() })

	got, err := c.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	want := map[podresources.Key]podresources.Grant{
		main: {"nvidia.com/gpu": {"gpu-0", "gpu-1"}, podresources.ClaimKey("ns", "c1"): {"gpu.tessera.dev/node-a/gpu-2"},
			podresources.ClaimKey("ns", "empty"): nil},
		side:  {"tessera.dev/vgpu": {"vgpu-3"}},
		other: {"tessera.dev/vgpu": {"vgpu-4"}},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("listed %v, want %v", got, want)
	}
	if inUse := s.InUse("tessera.dev/vgpu"); len(inUse) != 2 || !inUse["vgpu-3"] || !inUse["vgpu-4"] {
		t.Errorf("in use %v", inUse)
	}
	s.Forget("ns", "p")
	if got, err := c.List(context.Background()); err != nil || len(got) != 1 || got[other] == nil {
		t.Errorf("after Forget: %v %v", got, err)
	}
}
