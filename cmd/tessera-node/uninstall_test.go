package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/nri"
)

// TestUninstallDecision: only a DaemonSet that is gone, being deleted or replaced makes the stopping
// agent clean up; a DaemonSet that is still there (an upgrade) or an API error keeps the node's
// files (TestSecurityUninstallNever401 has the errors).
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
		{"API error keeps the files", []runtime.Object{ds("u1", false)}, apierrors.NewInternalError(errors.New("etcd")), false},
		{"forbidden keeps the files", []runtime.Object{ds("u1", false)}, apierrors.NewForbidden(gr, "tessera-node", errors.New("rbac")), false},
	} {
		client := fake.NewClientset(tc.objs...)
		if tc.err != nil {
			client.PrependReactor("get", "daemonsets", func(k8stesting.Action) (bool, runtime.Object, error) { return true, nil, tc.err })
		}
		w := resolvedWatch(t, client)
		if got, why := w.uninstalling(); got != tc.want {
			t.Errorf("%s: uninstalling = %t (%s), want %t", tc.name, got, why, tc.want)
		}
	}
	// What the watch saw decides without a read.
	w := resolvedWatch(t, fake.NewClientset(ds("u1", false)))
	w.see(ds("u1", true))
	if got, _ := w.uninstalling(); !got {
		t.Error("a deletion the watch saw did not count")
	}
}

// TestUninstallDeletionFromRelist: the DaemonSet's deletion counts when the watch learnt it only
// from a relist (a tombstone), not only when it saw it; another DaemonSet's deletion does not.
func TestUninstallDeletionFromRelist(t *testing.T) {
	ds := func(name string) *appsv1.DaemonSet {
		return &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ts", UID: "u1"}}
	}
	for _, tc := range []struct {
		name string
		obj  any
		want bool
	}{
		{"seen deleted", ds("tessera-node"), true},
		{"tombstone", cache.DeletedFinalStateUnknown{Key: "ts/tessera-node", Obj: ds("tessera-node")}, true},
		{"tombstone of another DaemonSet", cache.DeletedFinalStateUnknown{Key: "ts/other", Obj: ds("other")}, false},
		{"tombstone of another type", cache.DeletedFinalStateUnknown{Key: "ts/tessera-node",
			Obj: &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "tessera-node", Namespace: "ts"}}}, false},
	} {
		w := resolvedWatch(t, fake.NewClientset(ds("tessera-node"))) // still there when read
		w.handler().OnDelete(tc.obj)
		if got, why := w.uninstalling(); got != tc.want {
			t.Errorf("%s: uninstalling = %t (%s), want %t", tc.name, got, why, tc.want)
		}
	}
}

// resolvedWatch is an ownerWatch that has found its DaemonSet ts/tessera-node (UID u1).
func resolvedWatch(t *testing.T, client *fake.Clientset) *ownerWatch {
	w := &ownerWatch{client: client, namespace: "ts", pod: "tessera-node-x", log: testLog(t)}
	w.owner.Store(&metav1.OwnerReference{Kind: "DaemonSet", Name: "tessera-node", UID: "u1"})
	return w
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
		filepath.Join(cfg.DataDir, "ledger.json.lock"):                               false,
		filepath.Join(cfg.DataDir, "dra-mig.json"):                                   false,
		filepath.Join(cfg.DataDir, "ledger.json.corrupt-20261127T014400.000000001Z"): false,
		filepath.Join(cfg.DataDir, "health.json"):                                    false,
		filepath.Join(cfg.DataDir, "bin", "tessera-node"):                            false,
		filepath.Join(cfg.RunDir, "containers", "c1", "limits"):                      false,
		filepath.Join(cfg.RunDir, "containers", "c1", "vcuda", "region"):             false,
		filepath.Join(cfg.RunDir, "claims", "cu", "limits"):                          false,
		filepath.Join(cfg.RunDir, "claims", "cu", "vcuda", "region"):                 false,
		filepath.Join(nri.NodeFilesDir(cfg.RunDir), api.ContextOverheadFile):         false,
		filepath.Join(cfg.RunDir, "agent.seat"):                                      false,
		filepath.Join(cfg.RunDir, "agent.seat.lock"):                                 false,
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

// TestSecurityUninstallNever401: a stopping agent wipes the node (ledger, CDI specs, health) only on
// positive evidence that its DaemonSet is gone. A rejected token (401), a refusal (403), a timeout or
// an API server that is down, whether the DaemonSet was found before or not, keep everything, and the
// log says why: a transient auth failure during an upgrade must not lose holds and prepared claims.
func TestSecurityUninstallNever401(t *testing.T) {
	gr := schema.GroupResource{Group: "apps", Resource: "daemonsets"}
	errs := map[string]error{
		"401":                apierrors.NewUnauthorized("token rejected"),
		"403":                apierrors.NewForbidden(gr, "tessera-node", errors.New("rbac")),
		"timeout":            apierrors.NewTimeoutError("etcd", 1),
		"deadline":           context.DeadlineExceeded,
		"connection refused": errors.New("dial tcp 10.96.0.1:443: connect: connection refused"),
	}
	for name, err := range errs {
		// The DaemonSet was found at start, even deleted since (the watch missed it): the read at
		// stop fails and decides nothing.
		for _, objs := range [][]runtime.Object{{uninstallDS("u1")}, nil} {
			var log strings.Builder
			client := fake.NewClientset(objs...)
			client.PrependReactor("get", "daemonsets", func(k8stesting.Action) (bool, runtime.Object, error) { return true, nil, err })
			w := resolvedWatch(t, client)
			w.log = slog.New(slog.NewTextHandler(&log, nil))
			if got, why := w.uninstalling(); got {
				t.Errorf("%s on the DaemonSet read (%d objects): taken as an uninstall (%s); the node's files would be wiped", name, len(objs), why)
			}
			if !strings.Contains(log.String(), "keeping the node's files") {
				t.Errorf("%s: the log does not say the files are kept:\n%s", name, log.String())
			}
		}
		// The DaemonSet was never found (the API server failed since the agent started).
		client := fake.NewClientset(uninstallPod())
		client.PrependReactor("get", "pods", func(k8stesting.Action) (bool, runtime.Object, error) { return true, nil, err })
		client.PrependReactor("get", "daemonsets", func(k8stesting.Action) (bool, runtime.Object, error) { return true, nil, err })
		w := &ownerWatch{client: client, namespace: "ts", pod: "tessera-node-x", log: testLog(t)}
		if got, why := w.uninstalling(); got {
			t.Errorf("%s before the DaemonSet was found: taken as an uninstall (%s)", name, why)
		}
	}
	var log strings.Builder
	client := fake.NewClientset(uninstallDS("u1"))
	client.PrependReactor("get", "daemonsets", func(k8stesting.Action) (bool, runtime.Object, error) { return true, nil, errs["401"] })
	w := resolvedWatch(t, client)
	w.log = slog.New(slog.NewTextHandler(&log, nil))
	w.uninstalling()
	if !strings.Contains(log.String(), "(401)") {
		t.Errorf("the log does not name the 401 as the reason:\n%s", log.String())
	}
}

// TestSecurityAgentStartsWithAPIDown: with --cleanup-on-uninstall the agent starts while the API
// server is down (watchOwner returns at once), keeps the files if stopped before the API server came
// back, and finds its DaemonSet in the background once it does, so a later uninstall is still seen.
func TestSecurityAgentStartsWithAPIDown(t *testing.T) {
	saved := ownerRetry
	t.Cleanup(func() { ownerRetry = saved })
	ownerRetry = wait.Backoff{Duration: 5 * time.Millisecond, Factor: 2, Cap: 50 * time.Millisecond, Steps: 1 << 30}
	var down atomic.Bool
	down.Store(true)
	client := fake.NewClientset(uninstallPod(), uninstallDS("u1"))
	for _, verb := range []string{"get", "list", "watch"} {
		client.PrependReactor(verb, "*", func(k8stesting.Action) (bool, runtime.Object, error) {
			if down.Load() {
				return true, nil, errors.New("dial tcp 10.96.0.1:443: connect: connection refused")
			}
			return false, nil, nil
		})
	}
	client.PrependWatchReactor("*", func(k8stesting.Action) (bool, watch.Interface, error) {
		if down.Load() {
			return true, nil, errors.New("dial tcp 10.96.0.1:443: connect: connection refused")
		}
		return false, nil, nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	type result struct {
		w   *ownerWatch
		err error
	}
	done := make(chan result, 1)
	go func() {
		w, err := watchOwner(ctx, client, "ts", "tessera-node-x", testLog(t))
		done <- result{w, err}
	}()
	var w *ownerWatch
	select {
	case r := <-done:
		if r.err != nil {
			t.Fatalf("the agent cannot start while the API server is down: %v", r.err)
		}
		w = r.w
	case <-time.After(2 * time.Second):
		t.Fatal("watchOwner did not return within 2 s while the API server is down: the agent would not start (serve its node) until it answers")
	}
	if got, why := w.uninstalling(); got {
		t.Errorf("stopped while the API server is down: taken as an uninstall (%s)", why)
	}
	down.Store(false)
	deadline := time.Now().Add(5 * time.Second)
	for w.owner.Load() == nil {
		if time.Now().After(deadline) {
			t.Fatal("the DaemonSet was not found in the background after the API server came back")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if got, why := w.uninstalling(); got {
		t.Errorf("an upgrade (the DaemonSet is there) taken as an uninstall (%s)", why)
	}
	if err := client.AppsV1().DaemonSets("ts").Delete(ctx, "tessera-node", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if got, why := w.uninstalling(); !got {
		t.Errorf("the DaemonSet was deleted after the API server came back, but the stop keeps the files (%s)", why)
	}
}

func uninstallDS(uid string) *appsv1.DaemonSet {
	return &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: "tessera-node", Namespace: "ts", UID: types.UID(uid)}}
}

func uninstallPod() *corev1.Pod {
	yes := true
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "tessera-node-x", Namespace: "ts",
		OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "DaemonSet", Name: "tessera-node", UID: "u1", Controller: &yes}}}}
}

// TestOwnerRetrySchedule pins the background search for the agent's DaemonSet on a synctest
// bubble's clock: the pod is read at once, then after each failed read a step of ownerRetry later
// (doubling, then at its cap for as long as reads fail, not giving up there), each step logged as
// retryIn; a pod read ends the search and starts the watch; a pod not run by a DaemonSet ends it at
// once; the context's end ends it while it waits.
func TestOwnerRetrySchedule(t *testing.T) { synctest.Test(t, ownerRetrySchedule) }

func ownerRetrySchedule(t *testing.T) {
	saved := ownerRetry
	t.Cleanup(func() { ownerRetry = saved })
	ownerRetry = wait.Backoff{Duration: time.Second, Factor: 2, Cap: 4 * time.Second, Steps: 1 << 30}
	var gets atomic.Int64 // synctest.Wait orders nothing for the race detector
	var failures atomic.Int64
	client := func(pod *corev1.Pod) *fake.Clientset {
		c := fake.NewClientset(pod, uninstallDS("u1"))
		c.PrependReactor("get", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
			gets.Add(1)
			if failures.Add(-1) >= 0 {
				return true, nil, errors.New("dial tcp 10.96.0.1:443: connect: connection refused")
			}
			return false, nil, nil
		})
		return c
	}
	var log lockedLog // written by the watch's goroutines while the test reads it
	start := func(ctx context.Context, c *fake.Clientset) (*ownerWatch, <-chan struct{}) {
		log.reset()
		gets.Store(0)
		w := &ownerWatch{client: c, namespace: "ts", pod: "tessera-node-x", log: slog.New(slog.NewTextHandler(&log, nil))}
		done := make(chan struct{})
		go func() {
			defer close(done)
			w.run(ctx)
		}()
		return w, done
	}
	reads := func(when string, want int64) {
		t.Helper()
		synctest.Wait()
		if n := gets.Load(); n != want {
			t.Fatalf("%s: the pod read %d times, want %d", when, n, want)
		}
	}

	// Five failed reads, then one that answers: at 0, 1, 3, 7, 11 and 15 s.
	failures.Store(5)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel() // a failed check leaves no watch behind in the bubble
	w, done := start(ctx, client(uninstallPod()))
	reads("at once", 1)
	for _, at := range []struct {
		sleep time.Duration
		reads int64
	}{{time.Second / 2, 1}, {time.Second, 2}, {2 * time.Second, 3}, {4 * time.Second, 4}, {4 * time.Second, 5}} {
		time.Sleep(at.sleep)
		reads(fmt.Sprintf("%v later", at.sleep), at.reads)
	}
	if w.owner.Load() != nil {
		t.Fatal("the DaemonSet found while the pod's reads fail")
	}
	time.Sleep(3 * time.Second)
	reads("14.5 s in, before the cap's next read", 5)
	time.Sleep(time.Second)
	reads("15.5 s in, past the cap's next read", 6)
	if o := w.owner.Load(); o == nil || o.Name != "tessera-node" {
		t.Fatalf("the pod read at last, but the DaemonSet is %v", o)
	}
	var retries []string
	for _, line := range strings.Split(log.String(), "\n") {
		if _, after, ok := strings.Cut(line, "retryIn="); ok {
			retries = append(retries, strings.Fields(after)[0])
		}
	}
	if got := strings.Join(retries, " "); got != "1s 2s 4s 4s 4s" {
		t.Errorf("logged retries %q, want 1s 2s 4s 4s 4s:\n%s", got, log.String())
	}
	cancel()
	<-done
	time.Sleep(30 * time.Second)
	reads("after the context ended", 6)

	// A pod without a DaemonSet: one read, the search ends.
	failures.Store(0)
	bare := uninstallPod()
	bare.OwnerReferences = nil
	_, done = start(context.Background(), client(bare))
	synctest.Wait()
	select {
	case <-done:
	default:
		t.Fatal("the search goes on for a pod no DaemonSet runs")
	}
	reads("a pod no DaemonSet runs", 1)
	if !strings.Contains(log.String(), "not run by a DaemonSet") {
		t.Errorf("the log does not say why:\n%s", log.String())
	}

	// The context's end while the search waits for its next read.
	failures.Store(1 << 30)
	ctx, cancel = context.WithCancel(context.Background())
	defer cancel()
	_, done = start(ctx, client(uninstallPod()))
	time.Sleep(2 * time.Second)
	reads("2 s into a search", 2)
	cancel()
	synctest.Wait()
	select {
	case <-done:
	default:
		t.Fatal("the search goes on after its context ended")
	}
	reads("after the context ended", 2)
}

// lockedLog is a log destination the code under test writes while the test reads it.
type lockedLog struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func (l *lockedLog) reset() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b.Reset()
}
