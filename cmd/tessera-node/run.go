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

	"github.com/tessera-gpu/tessera/agent"
	"github.com/tessera-gpu/tessera/cdi"
	"github.com/tessera-gpu/tessera/deviceplugin"
	"github.com/tessera-gpu/tessera/gpu"
	"github.com/tessera-gpu/tessera/ledger"
	"github.com/tessera-gpu/tessera/nri"
	"github.com/tessera-gpu/tessera/podresources"
)

// runFlags are tessera-node run's own flags, beside the shared nodeFlags.
type runFlags struct {
	nodeFlags
	nodeName          string
	dataDir           string
	runDir            string
	pluginDir         string
	podResources      string
	nriSocket         string
	kubeconfig        string
	listen            string
	rediscoverEvery   time.Duration
	nriPluginIndex    string
	kataHandlerPrefix string
}

// runAgent is the node agent: inventory, CDI specs, device plugins, the NRI plugin, /metrics and /healthz.
func runAgent(args []string) error {
	fs := flag.NewFlagSet("tessera-node run", flag.ContinueOnError)
	var f runFlags
	f.register(fs)
	host, _ := os.Hostname()
	fs.StringVar(&f.nodeName, "node-name", host, "Kubernetes node name (the inventory annotation goes on this Node)")
	fs.StringVar(&f.dataDir, "data-dir", "/var/lib/tessera", "persistent state: the ledger")
	fs.StringVar(&f.runDir, "run-dir", "/run/tessera", "per-container vcuda files (limits, preload list, accounting region); best on tmpfs")
	fs.StringVar(&f.pluginDir, "device-plugin-dir", "/var/lib/kubelet/device-plugins", "the kubelet's device plugin directory (kubelet.sock lives here)")
	fs.StringVar(&f.podResources, "pod-resources-socket", podresources.DefaultSocket, "the kubelet's PodResources API socket")
	fs.StringVar(&f.nriSocket, "nri-socket", "/var/run/nri/nri.sock", "containerd's NRI socket")
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig for the API server (empty: in-cluster config); pods are read from it and the inventory is published to the Node")
	fs.StringVar(&f.listen, "listen", "127.0.0.1:9400", "address for /metrics and /healthz")
	fs.DurationVar(&f.rediscoverEvery, "rediscover-interval", time.Minute, "how often the GPUs are rediscovered (MIG or mdev changes made outside Tessera)")
	fs.StringVar(&f.nriPluginIndex, "nri-plugin-index", "50", "NRI plugin index (order among NRI plugins)")
	fs.StringVar(&f.kataHandlerPrefix, "kata-runtime-handler", "kata", "runtime handlers starting with this run pods in VMs (VFIO devices, no /dev/nvidia*)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg, err := f.load(fs)
	if err != nil {
		return err
	}
	if cfg.NodeName == "" {
		cfg.NodeName = f.nodeName
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	backend, err := gpu.Open(f.gpuOptions(cfg))
	if err != nil {
		return err
	}
	defer backend.Close()
	l, err := ledger.Open(filepath.Join(f.dataDir, "ledger.json"))
	if err != nil {
		return err
	}
	a := agent.New(agent.Config{NodeName: cfg.NodeName, SharesPerGPU: cfg.SharesPerGPU, CDIDir: cfg.CDIDir,
		Generator: &cdi.Generator{Vendor: cfg.CDIVendor, VCUDALibrary: cfg.VCUDALibrary}}, backend, l)
	grants := podresources.New(f.podResources)
	defer grants.Close()
	a.WithAllocated(grants.List)

	client, err := kubeClient(f.kubeconfig)
	if err != nil {
		slog.Warn("no API server: pods granted GPUs cannot be verified and will be refused; the inventory is not published", "err", err)
	}
	var pods nri.Pods = noPods{err}
	if client != nil {
		pods = nri.NewAPIPods(ctx, client, cfg.NodeName)
		a.WithPublisher(publisher(ctx, client, cfg.NodeName))
	}
	if err := a.Refresh(ctx); err != nil {
		return err
	}

	plugin := nri.New(nri.Config{StateDir: f.runDir, VCUDALibrary: cfg.VCUDALibrary, KataHandlers: []string{f.kataHandlerPrefix},
		PluginIndex: f.nriPluginIndex}, a, grants, pods)
	mgr := deviceplugin.NewManager(a, deviceplugin.Options{PluginDir: f.pluginDir})

	errc := make(chan error, 4)
	go func() { errc <- named("device plugins", mgr.Run(ctx)) }()
	go func() { errc <- named("NRI plugin", plugin.Run(ctx, f.nriSocket)) }()
	go func() { errc <- named("health watch", a.WatchHealth(ctx)) }()
	go rediscover(ctx, a, f.rediscoverEvery)
	srv, err := serveHTTP(f.listen, a, mgr, plugin)
	if err != nil {
		return err
	}
	defer srv.Close()
	slog.Info("tessera-node running", "node", cfg.NodeName, "backend", backend.Name(), "cdiDir", cfg.CDIDir, "nri", f.nriSocket, "listen", f.listen)
	select {
	case <-ctx.Done():
		return nil
	case err := <-errc:
		return err
	}
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
		writeMetrics(w, a, plugin.RegionPath)
		n, total, refused := plugin.Stats()
		fmt.Fprintf(w, "# HELP tessera_nri_create_container_total CreateContainer requests the NRI plugin handled.\n# TYPE tessera_nri_create_container_total counter\ntessera_nri_create_container_total %d\n", n)
		fmt.Fprintf(w, "# HELP tessera_nri_create_container_seconds_total Time the NRI plugin spent in CreateContainer.\n# TYPE tessera_nri_create_container_seconds_total counter\ntessera_nri_create_container_seconds_total %g\n", total.Seconds())
		fmt.Fprintf(w, "# HELP tessera_nri_refused_containers_total Containers the NRI plugin refused.\n# TYPE tessera_nri_refused_containers_total counter\ntessera_nri_refused_containers_total %d\n", refused)
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(ln)
	return srv, nil
}
