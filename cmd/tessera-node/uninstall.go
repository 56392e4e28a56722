package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	cli "github.com/urfave/cli/v3"
	"golang.org/x/sys/unix"
	appsv1 "k8s.io/api/apps/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/handover"
	"github.com/tessera-gpu/tessera/internal/informer"
	"github.com/tessera-gpu/tessera/internal/nri"
)

// An agent in a DaemonSet pod gets SIGTERM both when the chart is upgraded (the pod is replaced;
// running containers keep their GPUs and the new pod reads the same ledger) and when it is
// uninstalled (nothing should stay on the node). The signal does not say which, so the agent watches
// the DaemonSet that owns its pod: when that is deleted, or being deleted, the agent removes what it
// put on the node after it has stopped.

// uninstallFlags are `tessera-node run`'s flags for telling an uninstall from an upgrade.
type uninstallFlags struct {
	enabled               bool
	podName, podNamespace string
}

func (u *uninstallFlags) flags(f *nodeFlags) []cli.Flag {
	return []cli.Flag{
		field(f, "", &cli.BoolFlag{Name: "cleanup-on-uninstall", Destination: &u.enabled, Usage: "when the DaemonSet that runs this pod is deleted (helm uninstall), remove on exit what the agent put on the node: its CDI specs, the ledger and health files and bin/ in --data-dir, the per-container files in --run-dir, the simulated node's --state-dir, --vcuda-library and --hook-binary (the chart's init container installs them); needs --pod-name and --pod-namespace"}),
		field(f, "", &cli.StringFlag{Name: "pod-name", Destination: &u.podName, Usage: "this agent's pod (the chart: $(POD_NAME)), to find the DaemonSet that owns it"}),
		field(f, "", &cli.StringFlag{Name: "pod-namespace", Destination: &u.podNamespace, Usage: "this agent's pod's namespace (the chart: $(POD_NAMESPACE))"}),
	}
}

// ownerWatch follows the DaemonSet that owns the agent's pod. It is started without waiting for the
// API server: the agent serves its node whether or not the API server answers, and finds its
// DaemonSet in the background.
type ownerWatch struct {
	client         kubernetes.Interface
	namespace, pod string
	log            *slog.Logger
	// owner is the DaemonSet once the pod's controller reference was read; nil until then.
	owner atomic.Pointer[metav1.OwnerReference]
	// gone is set when the watch saw the DaemonSet deleted, being deleted, or replaced by another
	// of the same name.
	gone atomic.Bool
}

// errNotDaemonSet: the pod has no DaemonSet controller; retrying does not change that.
var errNotDaemonSet = errors.New("not run by a DaemonSet: --cleanup-on-uninstall applies to the chart's DaemonSet only")

// ownerRetry spaces the background tries to find the agent's DaemonSet while the API server does
// not answer: 1 s, doubling up to a try a minute, until the agent stops.
var ownerRetry = wait.Backoff{Duration: time.Second, Factor: 2, Cap: time.Minute, Steps: 1 << 30}

// watchOwner starts following the DaemonSet that owns the pod until ctx ends. It returns at once:
// reading the pod and watching its DaemonSet retry in the background, so an API server that is
// down when the agent starts delays only the uninstall decision, never the node's service.
func watchOwner(ctx context.Context, client kubernetes.Interface, namespace, pod string, log *slog.Logger) (*ownerWatch, error) {
	if namespace == "" || pod == "" {
		return nil, errors.New("--cleanup-on-uninstall needs --pod-name and --pod-namespace (the chart passes them from the downward API)")
	}
	w := &ownerWatch{client: client, namespace: namespace, pod: pod, log: log}
	go w.run(ctx)
	return w, nil
}

// run finds the DaemonSet, retrying for as long as the agent runs, then watches it.
func (w *ownerWatch) run(ctx context.Context) {
	var ref *metav1.OwnerReference
	var lastErr error
	// The first try is at once, each next one a step of ownerRetry after the last ended (sliding);
	// the step, taken when a try has failed, is logged with that try's error. DelayFunc stays at
	// the cap once reached (ExponentialBackoff would stop there).
	next := ownerRetry.DelayFunc()
	retryIn := wait.DelayFunc(func() time.Duration {
		d := next()
		w.log.Warn("cannot find this agent's DaemonSet yet; retrying (the node is served meanwhile; a stop before it is found keeps the node's files)", "err", lastErr, "retryIn", d)
		return d
	})
	err := retryIn.Until(ctx, true, true, func(ctx context.Context) (bool, error) {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		var err error
		ref, err = w.resolve(cctx)
		if errors.Is(err, errNotDaemonSet) {
			return false, err
		}
		lastErr = err
		return err == nil, nil
	})
	if errors.Is(err, errNotDaemonSet) {
		w.log.Error("cannot watch this agent's DaemonSet; the node's files stay when the agent stops", "err", err)
		return
	}
	if err != nil {
		return // ctx ended
	}
	w.owner.Store(ref)
	selector := fields.OneTermEqualSelector("metadata.name", ref.Name).String()
	daemonSets := w.client.AppsV1().DaemonSets(w.namespace)
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.FieldSelector = selector
			return daemonSets.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = selector
			return daemonSets.Watch(ctx, o)
		},
	}
	_, ctrl := cache.NewInformerWithOptions(cache.InformerOptions{
		ListerWatcher: lw, ObjectType: &appsv1.DaemonSet{}, Handler: w.handler(),
	})
	w.log.Info("watching this agent's DaemonSet: its deletion (helm uninstall) makes the agent clean the node up on exit", "daemonset", w.namespace+"/"+ref.Name)
	ctrl.RunWithContext(ctx)
}

// resolve reads the agent's pod for the DaemonSet that controls it.
func (w *ownerWatch) resolve(ctx context.Context) (*metav1.OwnerReference, error) {
	got, err := w.client.CoreV1().Pods(w.namespace).Get(ctx, w.pod, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("read this agent's pod %s/%s to find its DaemonSet: %w", w.namespace, w.pod, err)
	}
	ref := metav1.GetControllerOf(got)
	if ref == nil || ref.Kind != "DaemonSet" {
		return nil, fmt.Errorf("pod %s/%s is %w", w.namespace, w.pod, errNotDaemonSet)
	}
	return ref, nil
}

// ours: ds is the DaemonSet the pod belongs to by name.
func (w *ownerWatch) ours(ds *appsv1.DaemonSet) bool {
	ref := w.owner.Load()
	return ref != nil && ds.Namespace == w.namespace && ds.Name == ref.Name
}

// handler takes the DaemonSet watch's events: a deletion of ours, seen or learnt from a relist (a
// tombstone), or ours being deleted or replaced, marks it gone.
func (w *ownerWatch) handler() cache.ResourceEventHandlerFuncs {
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { w.see(obj) },
		UpdateFunc: func(_, obj any) { w.see(obj) },
		DeleteFunc: informer.OnDelete(func(ds *appsv1.DaemonSet) {
			if w.ours(ds) {
				w.gone.Store(true)
			}
		}),
	}
}

func (w *ownerWatch) see(obj any) {
	ref := w.owner.Load()
	if ds, ok := obj.(*appsv1.DaemonSet); ok && w.ours(ds) && (ds.DeletionTimestamp != nil || ds.UID != ref.UID) {
		w.gone.Store(true)
	}
}

// uninstalling decides, as the agent stops, whether its DaemonSet is going away. Only positive
// evidence counts: the watch saw it deleted, or one read finds it gone, being deleted, or replaced
// by another of the same name. Everything else keeps the node's files, and says why: a rejected
// token (401) or a refusal (403) during an upgrade, an API server that does not answer, or a
// DaemonSet never found. An upgrade must never lose the holds, the prepared claims or the specs.
func (w *ownerWatch) uninstalling() (bool, string) {
	if w.gone.Load() {
		return true, "the DaemonSet " + w.owner.Load().Name + " was deleted"
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	keep := func(err error) (bool, string) {
		w.log.Warn("cannot tell whether this is an uninstall; keeping the node's files (if the release was uninstalled, remove them by hand: docs/upgrade.md#uninstall)", "why", uncertain(err), "err", err)
		return false, ""
	}
	ref := w.owner.Load()
	if ref == nil {
		var err error
		if ref, err = w.resolve(ctx); err != nil {
			return keep(err)
		}
	}
	ds, err := w.client.AppsV1().DaemonSets(w.namespace).Get(ctx, ref.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return true, "the DaemonSet " + ref.Name + " is gone"
	case err != nil:
		return keep(err)
	case ds.DeletionTimestamp != nil:
		return true, "the DaemonSet " + ref.Name + " is being deleted"
	case ds.UID != ref.UID:
		return true, "the DaemonSet " + ref.Name + " was replaced"
	}
	return false, ""
}

// uncertain says why an error is no evidence of an uninstall.
func uncertain(err error) string {
	switch {
	case apierrors.IsUnauthorized(err):
		return "the API server rejected this agent's token (401): a rotated token or a restarting API server gives that during an upgrade too"
	case apierrors.IsForbidden(err):
		return "the API server refused the read (403): RBAC being replaced during an upgrade gives that too"
	case errors.Is(err, errNotDaemonSet):
		return "this agent's pod has no DaemonSet to watch"
	case errors.Is(err, context.DeadlineExceeded) || apierrors.IsTimeout(err) || apierrors.IsServerTimeout(err):
		return "the API server did not answer in time"
	}
	return "the API server's answer is no evidence that the DaemonSet is gone"
}

// cleanupNode removes what the agent put on the node, after every part of it has stopped. Regions
// of containers still running are detached, not torn down: the container's bind mount keeps its
// region (and libvcuda.so, the ledger-free preload list) alive until it exits.
func cleanupNode(cfg *configv1.NodeConfig) []error {
	var errs []error
	keep := func(err error) {
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	// The agent's CDI specs: a writer that owns no spec removes all of its files.
	keep((&cdi.Writer{Dir: cfg.CDIDir}).Sync(nil))
	// The per-container files and the per-claim ones (a DRA claim's region and limits, shared by
	// its containers).
	for _, sub := range []string{"containers", "claims"} {
		owners := filepath.Join(cfg.RunDir, sub)
		ids, _ := os.ReadDir(owners)
		for _, id := range ids {
			region := filepath.Join(owners, id.Name(), "vcuda")
			if err := unix.Unmount(region, unix.MNT_DETACH); err != nil && err != unix.EINVAL && err != unix.ENOENT {
				keep(fmt.Errorf("unmount %s: %w", region, err))
			}
		}
		keep(os.RemoveAll(owners))
	}
	// The node-wide files share containers read (the measured context overhead): running
	// containers keep their bind mount of the folder.
	keep(os.RemoveAll(nri.NodeFilesDir(cfg.RunDir)))
	if cfg.Backend == "sim" {
		keep(os.RemoveAll(cfg.StateDir))
	}
	for _, f := range handover.Files() {
		keep(os.RemoveAll(filepath.Join(cfg.RunDir, f)))
	}
	for _, f := range []string{"ledger.json", "ledger.json.lock", "dra-mig.json", "health.json", "bin"} {
		keep(os.RemoveAll(filepath.Join(cfg.DataDir, f)))
	}
	// The copies of corrupt ledgers the ledger kept aside (ledger.json.corrupt-<time>).
	aside, _ := filepath.Glob(filepath.Join(cfg.DataDir, "ledger.json.corrupt-*"))
	for _, f := range aside {
		keep(os.Remove(f))
	}
	if cfg.HookBinary != "" {
		keep(os.Remove(cfg.HookBinary))
		// The nvidia-cdi-hook link the agent made beside it (hookBinaries).
		if cfg.CDIHookPath == "" {
			link := filepath.Join(filepath.Dir(cfg.HookBinary), hookName)
			if target, err := os.Readlink(link); err == nil && target == filepath.Base(cfg.HookBinary) {
				keep(os.Remove(link))
			}
		}
	}
	keep(os.Remove(cfg.VCUDALibrary))
	// Empty folders go too, except those mounted into this pod (the hostPath volumes themselves).
	for _, d := range []string{cfg.DataDir, cfg.RunDir, filepath.Dir(cfg.VCUDALibrary)} {
		_ = os.Remove(d)
	}
	return errs
}
