package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/tessera-gpu/tessera/internal/agent"
	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/deviceplugin"
	"github.com/tessera-gpu/tessera/internal/gpu"
	"github.com/tessera-gpu/tessera/internal/ledger"
	"github.com/tessera-gpu/tessera/internal/nri"
	"github.com/tessera-gpu/tessera/internal/podresources"
)

// runAgent is the node agent: inventory, CDI specs, device plugins, the NRI plugin, /metrics and /healthz.
func runAgent(args []string) error {
	fs := flag.NewFlagSet("tessera-node run", flag.ContinueOnError)
	var f nodeFlags
	f.register(fs)
	host, _ := os.Hostname()
	f.registerRun(fs, host)
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg, err := f.load(fs)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	backend, err := gpu.Open(gpuOptions(cfg))
	if err != nil {
		return err
	}
	defer backend.Close()
	l, err := ledger.Open(filepath.Join(cfg.DataDir, "ledger.json"))
	if err != nil {
		return err
	}
	hookBinary, err := hookBinaryPath(cfg.HookBinary)
	if err != nil {
		return err
	}
	a := agent.New(agent.Config{NodeName: cfg.NodeName, SharesPerGPU: cfg.SharesPerGPU, CDIDir: cfg.CDIDir,
		Generator: &cdi.Generator{Vendor: cfg.CDIVendor, VCUDALibrary: cfg.VCUDALibrary, HookBinary: hookBinary, RunDir: cfg.RunDir}}, backend, l)
	grants := podresources.New(cfg.PodResourcesSocket)
	defer grants.Close()
	a.WithAllocated(grants.List)

	client, err := kubeClient(cfg.Kubeconfig)
	if err != nil {
		slog.Warn("no API server: pods granted GPUs cannot be verified and will be refused; the inventory is not published", "err", err)
	}
	var pods nri.Pods = noPods{err}
	var events nri.Events
	if client != nil {
		apiPods := nri.NewAPIPods(ctx, client, cfg.NodeName)
		pods, events = apiPods, apiPods
		a.WithPublisher(publisher(ctx, client, cfg.NodeName))
		publishHoldings(ctx, client, cfg.NodeName, l)
	}
	if err := a.Refresh(ctx); err != nil {
		return err
	}

	plugin := nri.New(nri.Config{StateDir: cfg.RunDir, VCUDALibrary: cfg.VCUDALibrary, KataHandlers: []string{cfg.KataRuntimeHandler},
		PluginIndex: cfg.NRIPluginIndex, AdminNamespaces: cfg.AdminNamespaces, Events: events}, a, grants, pods)
	mgr := deviceplugin.NewManager(a, deviceplugin.Options{PluginDir: cfg.DevicePluginDir})

	errc := make(chan error, 4)
	go func() { errc <- named("device plugins", mgr.Run(ctx)) }()
	go func() { errc <- named("NRI plugin", plugin.Run(ctx, cfg.NRISocket)) }()
	go func() { errc <- named("health watch", a.WatchHealth(ctx)) }()
	go rediscover(ctx, a, cfg.RediscoverInterval.Duration)
	go releaseUnlisted(ctx, plugin, grants, unlistedInterval)
	srv, err := serveHTTP(cfg.Listen, a, mgr, plugin)
	if err != nil {
		return err
	}
	defer srv.Close()
	slog.Info("tessera-node running", "node", cfg.NodeName, "backend", backend.Name(), "cdiDir", cfg.CDIDir, "nri", cfg.NRISocket, "listen", cfg.Listen)
	select {
	case <-ctx.Done():
		return nil
	case err := <-errc:
		return err
	}
}

// hookBinaryPath is the host path of tessera-node that the CDI specs name as the realisation hook:
// configured, or this binary (the agent runs on the host, or its image's binary is installed there).
func hookBinaryPath(configured string) (string, error) {
	if configured != "" {
		return configured, nil
	}
	self, err := os.Executable()
	if err != nil {
		return "", fmt.Errorf("find this binary for the realisation hook (set --hook-binary): %w", err)
	}
	return filepath.EvalSymlinks(self)
}

func named(what string, err error) error {
	if err == nil || errors.Is(err, context.Canceled) {
		return nil
	}
	return fmt.Errorf("%s: %w", what, err)
}

func rediscover(ctx context.Context, a *agent.Agent, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if err := a.Refresh(ctx); err != nil {
				slog.Error("rediscover GPUs", "err", err)
			}
		}
	}
}

// unlistedInterval is how often the kubelet's pods are listed to release holds of pods it forgot: a
// cheap local call; a hold goes after two lists without its pod. Sandbox events normally release
// holds at once, but for sandboxes created before a containerd restart none that matched arrived
// (TestCluster/ContainerdRestart, TestNodeAgent).
const unlistedInterval = 10 * time.Second

// releaseUnlisted frees the holds of pods the kubelet no longer lists (nri.Plugin.ReleaseUnlisted).
func releaseUnlisted(ctx context.Context, plugin *nri.Plugin, grants *podresources.Client, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			listed, err := grants.List(ctx)
			if err != nil {
				slog.Warn("list the kubelet's pods to release stale holds", "err", err)
				continue
			}
			plugin.ReleaseUnlisted(ctx, listed)
		}
	}
}

func kubeClient(kubeconfig string) (kubernetes.Interface, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = kubeconfig
	rc, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, nil).ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("load kubeconfig: %w", err)
	}
	rc.QPS, rc.Burst = 20, 40
	return kubernetes.NewForConfig(rc)
}

// noPods answers when there is no API server: granted containers cannot be verified.
type noPods struct{ err error }

func (n noPods) Pod(context.Context, string, string, string) (*corev1.Pod, error) {
	return nil, fmt.Errorf("no API server access to read the pod (%v); start tessera-node with --kubeconfig or in-cluster credentials", n.err)
}

func serveHTTP(addr string, a *agent.Agent, mgr *deviceplugin.Manager, plugin *nri.Plugin) (*http.Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen for /metrics on %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		if a.Node() == nil {
			http.Error(w, "no inventory yet", http.StatusServiceUnavailable)
			return
		}
		for res, ok := range mgr.Registered() {
			if !ok {
				http.Error(w, "device plugin "+res+" not registered with the kubelet", http.StatusServiceUnavailable)
				return
			}
		}
		if !plugin.Synced() {
			http.Error(w, "NRI plugin not connected to the runtime", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, r *http.Request) {
		writeMetrics(w, a, plugin.ReadRegion)
		priv, admin, unrealised := plugin.SecurityStats()
		fmt.Fprintf(w, "# HELP tessera_privileged_gpu_containers_total Privileged containers admitted holding GPU device nodes (outside isolation).\n# TYPE tessera_privileged_gpu_containers_total counter\ntessera_privileged_gpu_containers_total %d\n", priv)
		fmt.Fprintf(w, "# HELP tessera_admin_gpu_containers_total Containers of admin namespaces admitted with GPUs nobody granted (monitoring).\n# TYPE tessera_admin_gpu_containers_total counter\ntessera_admin_gpu_containers_total %d\n", admin)
		fmt.Fprintf(w, "# HELP tessera_unrealised_gpu_containers Running containers holding GPU devices with no ledger entry, at the last Synchronize.\n# TYPE tessera_unrealised_gpu_containers gauge\ntessera_unrealised_gpu_containers %d\n", unrealised)
		n, total, refused := plugin.Stats()
		fmt.Fprintf(w, "# HELP tessera_nri_create_container_total CreateContainer requests the NRI plugin handled.\n# TYPE tessera_nri_create_container_total counter\ntessera_nri_create_container_total %d\n", n)
		fmt.Fprintf(w, "# HELP tessera_nri_create_container_seconds_total Time the NRI plugin spent in CreateContainer.\n# TYPE tessera_nri_create_container_seconds_total counter\ntessera_nri_create_container_seconds_total %g\n", total.Seconds())
		fmt.Fprintf(w, "# HELP tessera_nri_refused_containers_total Containers the NRI plugin refused.\n# TYPE tessera_nri_refused_containers_total counter\ntessera_nri_refused_containers_total %d\n", refused)
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(ln)
	return srv, nil
}
