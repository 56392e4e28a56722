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
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
	"github.com/tessera-gpu/tessera/internal/cdi"
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

// ownerWatch follows the DaemonSet that owns the agent's pod.
type ownerWatch struct {
	client    kubernetes.Interface
	namespace string
	name      string
	uid       types.UID
	log       *slog.Logger
	// gone is set when the watch saw the DaemonSet deleted, being deleted, or replaced by another
	// of the same name.
	gone atomic.Bool
}

// watchOwner finds the DaemonSet that owns the pod and watches it until ctx ends.
func watchOwner(ctx context.Context, client kubernetes.Interface, namespace, pod string, log *slog.Logger) (*ownerWatch, error) {
	if namespace == "" || pod == "" {
		return nil, errors.New("--cleanup-on-uninstall needs --pod-name and --pod-namespace (the chart passes them from the downward API)")
	}
	var p *metav1.PartialObjectMetadata
	err := retryAPI(ctx, func(ctx context.Context) error {
		got, err := client.CoreV1().Pods(namespace).Get(ctx, pod, metav1.GetOptions{})
		if err == nil {
			p = &metav1.PartialObjectMetadata{ObjectMeta: got.ObjectMeta}
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("read this agent's pod %s/%s to find its DaemonSet: %w", namespace, pod, err)
	}
	ref := metav1.GetControllerOf(p)
	if ref == nil || ref.Kind != "DaemonSet" {
		return nil, fmt.Errorf("pod %s/%s is not run by a DaemonSet: --cleanup-on-uninstall applies to the chart's DaemonSet only", namespace, pod)
	}
	w := &ownerWatch{client: client, namespace: namespace, name: ref.Name, uid: ref.UID, log: log}
	lw := cache.NewListWatchFromClient(client.AppsV1().RESTClient(), "daemonsets", namespace, fields.OneTermEqualSelector("metadata.name", ref.Name))
	_, ctrl := cache.NewInformerWithOptions(cache.InformerOptions{
		ListerWatcher: lw, ObjectType: &appsv1.DaemonSet{},
		Handler: cache.ResourceEventHandlerFuncs{
			AddFunc:    func(obj any) { w.see(obj) },
			UpdateFunc: func(_, obj any) { w.see(obj) },
			DeleteFunc: func(any) { w.gone.Store(true) },
		},
	})
	go ctrl.RunWithContext(ctx)
	log.Info("watching this agent's DaemonSet: its deletion (helm uninstall) makes the agent clean the node up on exit", "daemonset", namespace+"/"+ref.Name)
	return w, nil
}

func (w *ownerWatch) see(obj any) {
	if ds, ok := obj.(*appsv1.DaemonSet); ok && (ds.DeletionTimestamp != nil || ds.UID != w.uid) {
		w.gone.Store(true)
	}
}

// uninstalling decides, as the agent stops, whether its DaemonSet is going away. The watch usually
// knows already; otherwise one read decides: not found, being deleted, or another of the same name
// means yes, and so does a rejected ServiceAccount token (the release's ServiceAccount is deleted
// with the DaemonSet). Any other error keeps the node's files: an upgrade must never lose them.
func (w *ownerWatch) uninstalling() (bool, string) {
	if w.gone.Load() {
		return true, "the DaemonSet " + w.name + " was deleted"
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ds, err := w.client.AppsV1().DaemonSets(w.namespace).Get(ctx, w.name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return true, "the DaemonSet " + w.name + " is gone"
	case apierrors.IsUnauthorized(err):
		return true, "this agent's ServiceAccount is gone"
	case err != nil:
		w.log.Warn("cannot tell whether this is an uninstall; keeping the node's files", "daemonset", w.name, "err", err)
		return false, ""
	case ds.DeletionTimestamp != nil:
		return true, "the DaemonSet " + w.name + " is being deleted"
	case ds.UID != w.uid:
		return true, "the DaemonSet " + w.name + " was replaced"
	}
	return false, ""
}

// apiRetry spaces retryAPI's five tries: 1 s, then half as long again each time (1, 1.5, 2.25,
// 3.4 s; about the 1, 2, 3, 4 s it replaced, without a wait after the last try).
var apiRetry = wait.Backoff{Duration: time.Second, Factor: 1.5, Steps: 5}

// retryAPI retries a call for a short while: the agent starts with its pod, when the API server
// may still be settling.
func retryAPI(ctx context.Context, call func(context.Context) error) error {
	backoff := apiRetry
	for try := 1; ; try++ {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := call(cctx)
		cancel()
		if err == nil || apierrors.IsNotFound(err) || apierrors.IsForbidden(err) || try >= apiRetry.Steps {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(backoff.Step()):
		}
	}
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
	if cfg.Backend == "sim" {
		keep(os.RemoveAll(cfg.StateDir))
	}
	for _, f := range []string{"ledger.json", "health.json", "bin"} {
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
