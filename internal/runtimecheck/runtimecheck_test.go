package runtimecheck

import (
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"k8s.io/client-go/tools/record"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// containerdConfig is info["config"] as containerd 2.2's CRI Status (verbose) reports it, cut to a
// few of its keys (test/e2e's TestRuntimeCheckContainerd reads the real one).
func containerdConfig(cdi string) map[string]string {
	return map[string]string{"golang": `"go1.24"`, "config": `{"containerd":{"defaultRuntimeName":"runc"},"enableSelinux":false,` + cdi + `,"rootDir":"/var/lib/containerd/io.containerd.grpc.v1.cri"}`}
}

func TestCDIProblem(t *testing.T) {
	for _, tc := range []struct {
		name  string
		info  map[string]string
		want  string // in the problem; "" for none
		known bool
	}{
		{"containerd 2.x defaults", containerdConfig(`"enableCDI":true,"cdiSpecDirs":["/etc/cdi","/var/run/cdi"]`), "", true},
		{"the directory with a trailing slash", containerdConfig(`"enableCDI":true,"cdiSpecDirs":["/etc/cdi/"]`), "", true},
		{"CDI off", containerdConfig(`"enableCDI":false,"cdiSpecDirs":["/etc/cdi","/var/run/cdi"]`), "set enable_cdi = true", true},
		{"another directory", containerdConfig(`"enableCDI":true,"cdiSpecDirs":["/var/run/cdi"]`), "add '/etc/cdi' to cdi_spec_dirs", true},
		{"no directory", containerdConfig(`"enableCDI":true,"cdiSpecDirs":null`), "add '/etc/cdi' to cdi_spec_dirs", true},
		{"a runtime without enableCDI", containerdConfig(`"cdiSpecDirs":["/etc/cdi"]`), "", false},
		{"no config", map[string]string{"golang": `"go1.24"`}, "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, known, err := CDIProblem(tc.info, "/etc/cdi")
			if err != nil || known != tc.known || (tc.want == "") != (p == "") || !strings.Contains(p, tc.want) {
				t.Errorf("CDIProblem = %q, known %v, %v; want %q, known %v", p, known, err, tc.want, tc.known)
			}
		})
	}
	if _, _, err := CDIProblem(map[string]string{"config": "{not json"}, "/etc/cdi"); err == nil || !strings.Contains(err.Error(), "CRI status config") {
		t.Errorf("unreadable config: %v, want an error naming it", err)
	}
}

func TestNRIProblem(t *testing.T) {
	dir := t.TempDir()
	missing, present := filepath.Join(dir, "nri.sock"), filepath.Join(dir, "present.sock")
	if err := os.WriteFile(present, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if p := NRIProblem(missing, true, NRIGrace); p != "" {
		t.Errorf("synchronised: %q, want no problem", p)
	}
	if p := NRIProblem(missing, false, NRIGrace); !strings.Contains(p, "no NRI socket at "+missing) || !strings.Contains(p, "disable = false") {
		t.Errorf("no socket: %q, want it named and the setting to change", p)
	}
	if p := NRIProblem(present, false, NRIGrace); !strings.Contains(p, "has not synchronised") || !strings.Contains(p, "disable = false") {
		t.Errorf("a socket but no Synchronize: %q, want that said and the setting to change", p)
	}
}

// fakeCRI answers Status with info, as a CRI runtime does, and refuses everything else.
type fakeCRI struct {
	runtimeapi.UnimplementedRuntimeServiceServer
	info     map[string]string
	verboses []bool
}

func (f *fakeCRI) Status(_ context.Context, r *runtimeapi.StatusRequest) (*runtimeapi.StatusResponse, error) {
	f.verboses = append(f.verboses, r.GetVerbose())
	resp := &runtimeapi.StatusResponse{Status: &runtimeapi.RuntimeStatus{}}
	if r.GetVerbose() {
		resp.Info = f.info // a runtime fills Info only when asked for verbose status
	}
	return resp, nil
}

func serveCRI(t *testing.T, info map[string]string) (string, *fakeCRI) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "cri.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeCRI{info: info}
	s := grpc.NewServer()
	runtimeapi.RegisterRuntimeServiceServer(s, f)
	go s.Serve(l)
	t.Cleanup(s.Stop)
	return sock, f
}

// run runs the check to its end and returns the events it recorded.
func run(t *testing.T, c *Check) []string {
	t.Helper()
	rec := record.NewFakeRecorder(10)
	c.Node, c.CDIDir, c.Events, c.Log = "gpu-1", "/etc/cdi", rec, slog.New(slog.DiscardHandler)
	waited := time.Duration(0)
	c.After = func(d time.Duration) <-chan time.Time {
		waited = d
		ch := make(chan time.Time, 1)
		ch <- time.Time{}
		return ch
	}
	c.Run(context.Background())
	if waited != NRIGrace {
		t.Errorf("the NRI verdict came after %s, want NRIGrace", waited)
	}
	close(rec.Events)
	var out []string
	for e := range rec.Events {
		out = append(out, e)
	}
	return out
}

func TestCheckReportsNRIAndCDIOff(t *testing.T) {
	sock, cri := serveCRI(t, containerdConfig(`"enableCDI":false,"cdiSpecDirs":["/etc/cdi"]`))
	nri := filepath.Join(t.TempDir(), "nri.sock")
	ev := run(t, &Check{NRISocket: nri, CRISocket: sock, Synced: func() bool { return false }})
	if len(ev) != 2 || !strings.HasPrefix(ev[0], "Warning CDIUnavailable containerd has CDI off") || !strings.Contains(ev[0], "enable_cdi = true") ||
		!strings.HasPrefix(ev[1], "Warning NRIUnavailable ") || !strings.Contains(ev[1], "no NRI socket at "+nri) {
		t.Errorf("events %q, want a CDIUnavailable naming enable_cdi and an NRIUnavailable naming the socket", ev)
	}
	if len(cri.verboses) != 1 || !cri.verboses[0] {
		t.Errorf("CRI Status calls (verbose?) %v, want one verbose call", cri.verboses)
	}
}

func TestCheckQuietWhenAllIsOn(t *testing.T) {
	sock, _ := serveCRI(t, containerdConfig(`"enableCDI":true,"cdiSpecDirs":["/etc/cdi","/var/run/cdi"]`))
	if ev := run(t, &Check{NRISocket: "/nonexistent/nri.sock", CRISocket: sock, Synced: func() bool { return true }}); len(ev) != 0 {
		t.Errorf("events %q, want none", ev)
	}
}

func TestCheckWithoutCRISocket(t *testing.T) {
	// No CRI socket mounted: nothing can be said of CDI, and NRI is still judged.
	ev := run(t, &Check{NRISocket: "/nonexistent/nri.sock", CRISocket: filepath.Join(t.TempDir(), "none.sock"), Synced: func() bool { return false }})
	if len(ev) != 1 || !strings.HasPrefix(ev[0], "Warning NRIUnavailable ") {
		t.Errorf("events %q, want the NRIUnavailable alone", ev)
	}
}
