package main

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
)

// TestUninstallDecision: only a DaemonSet that is gone, being deleted or replaced (or a rejected
// ServiceAccount token) makes the stopping agent clean up; a DaemonSet that is still there (an
// upgrade) or an API error keeps the node's files.
func TestUninstallDecision(t *testing.T) {
	now := metav1.Now()
	ds := func(uid string, deleting bool) *appsv1.DaemonSet {
		d := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: "tessera-node", Namespace: "ts", UID: types.UID(uid)}}
		if deleting {
			d.DeletionTimestamp = &now
		}
		return d
	}
	gr := schema.GroupResource{Group: "apps", Resource: "daemonsets"}
	for _, tc := range []struct {
		name string
		objs []runtime.Object
		err  error
		want bool
	}{
		{"upgrade: the DaemonSet is there", []runtime.Object{ds("u1", false)}, nil, false},
		{"uninstall: gone", nil, nil, true},
		{"uninstall: being deleted", []runtime.Object{ds("u1", true)}, nil, true},
		{"replaced by another of the name", []runtime.Object{ds("u2", false)}, nil, true},
		{"ServiceAccount gone", []runtime.Object{ds("u1", false)}, apierrors.NewUnauthorized("token"), true},
		{"API error keeps the files", []runtime.Object{ds("u1", false)}, apierrors.NewInternalError(errors.New("etcd")), false},
		{"forbidden keeps the files", []runtime.Object{ds("u1", false)}, apierrors.NewForbidden(gr, "tessera-node", errors.New("rbac")), false},
	} {
		client := fake.NewClientset(tc.objs...)
		if tc.err != nil {
			client.PrependReactor("get", "daemonsets", func(k8stesting.Action) (bool, runtime.Object, error) { return true, nil, tc.err })
		}
		w := &ownerWatch{client: client, namespace: "ts", name: "tessera-node", uid: "u1", log: testLog(t)}
		if got, why := w.uninstalling(); got != tc.want {
			t.Errorf("%s: uninstalling = %t (%s), want %t", tc.name, got, why, tc.want)
		}
	}
	// What the watch saw decides without a read.
	w := &ownerWatch{client: fake.NewClientset(ds("u1", false)), namespace: "ts", name: "tessera-node", uid: "u1", log: testLog(t)}
	w.see(ds("u1", true))
	if got, _ := w.uninstalling(); !got {
		t.Error("a deletion the watch saw did not count")
	}
}

// TestCleanupNode removes the agent's files and nothing else: other vendors' CDI specs and files
// the agent did not make stay.
func TestCleanupNode(t *testing.T) {
	root := t.TempDir()
	cfg := &configv1.NodeConfig{Backend: "sim", CDIDir: filepath.Join(root, "cdi"), DataDir: filepath.Join(root, "data"),
		RunDir: filepath.Join(root, "run"), StateDir: filepath.Join(root, "run", "sim"),
		VCUDALibrary: filepath.Join(root, "lib", "libvcuda.so"), HookBinary: filepath.Join(root, "lib", "tessera-node")}
	files := map[string]bool{ // path -> stays
		filepath.Join(cfg.CDIDir, "tessera-tessera.dev-gpu.json"):                    false,
		filepath.Join(cfg.CDIDir, "nvidia.yaml"):                                     true,
		filepath.Join(cfg.DataDir, "ledger.json"):                                    false,
		filepath.Join(cfg.DataDir, "ledger.json.corrupt-20261127T014400.000000001Z"): false,
		filepath.Join(cfg.DataDir, "health.json"):                                    false,
		filepath.Join(cfg.DataDir, "bin", "tessera-node"):                            false,
		filepath.Join(cfg.RunDir, "containers", "c1", "limits"):                      false,
		filepath.Join(cfg.RunDir, "containers", "c1", "vcuda", "region"):             false,
		filepath.Join(cfg.RunDir, "claims", "cu", "limits"):                          false,
		filepath.Join(cfg.RunDir, "claims", "cu", "vcuda", "region"):                 false,
		filepath.Join(cfg.StateDir, "root", "dev", "nvidia0"):                        false,
		filepath.Join(root, "lib", "libvcuda.so"):                                    false,
		filepath.Join(root, "lib", "tessera-node"):                                   false,
		filepath.Join(root, "lib", "other.so"):                                       true,
	}
	for f := range files {
		if err := os.MkdirAll(filepath.Dir(f), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(f, []byte("{}"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("tessera-node", filepath.Join(root, "lib", hookName)); err != nil {
		t.Fatal(err)
	}
	if errs := cleanupNode(cfg); len(errs) > 0 {
		t.Fatalf("cleanup: %v", errs)
	}
	for f, stays := range files {
		if _, err := os.Stat(f); (err == nil) != stays {
			t.Errorf("%s: exists %t after cleanup, want %t", f, err == nil, stays)
		}
	}
	if _, err := os.Lstat(filepath.Join(root, "lib", hookName)); err == nil {
		t.Errorf("the %s link stayed", hookName)
	}
	for _, d := range []string{cfg.DataDir, cfg.RunDir} {
		if _, err := os.Stat(d); err == nil {
			t.Errorf("the empty folder %s stayed", d)
		}
	}
}

// TestRetryAPI: a failing call is tried five times, spaced by apiRetry; a NotFound or a success
// ends the tries at once.
func TestRetryAPI(t *testing.T) {
	saved := apiRetry
	t.Cleanup(func() { apiRetry = saved })
	apiRetry.Duration = time.Millisecond
	transient := errors.New("connection refused")
	for _, tc := range []struct {
		err   error
		tries int
	}{{transient, 5}, {apierrors.NewNotFound(schema.GroupResource{Resource: "pods"}, "p"), 1}, {nil, 1}} {
		tries := 0
		err := retryAPI(context.Background(), func(context.Context) error { tries++; return tc.err })
		if err != tc.err || tries != tc.tries {
			t.Errorf("call failing with %v: %d tries, %v; want %d tries", tc.err, tries, err, tc.tries)
		}
	}
}
