package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"
	"github.com/prometheus/client_golang/prometheus"
	cli "github.com/urfave/cli/v3"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"

	"github.com/tessera-gpu/tessera/internal/agent"
	"github.com/tessera-gpu/tessera/internal/deviceplugin"
	"github.com/tessera-gpu/tessera/internal/dra"
	"github.com/tessera-gpu/tessera/internal/gpu"
	"github.com/tessera-gpu/tessera/internal/handover"
	"github.com/tessera-gpu/tessera/internal/ledger"
	"github.com/tessera-gpu/tessera/internal/nri"
	"github.com/tessera-gpu/tessera/internal/podresources"
	"github.com/tessera-gpu/tessera/internal/runtimecheck"
	"github.com/tessera-gpu/tessera/internal/telemetry"
)

// runAgent is the node agent: inventory, CDI specs, device plugins, the NRI plugin, /metrics and /healthz.
func runAgent(args []string) error {
	var f nodeFlags
	var un uninstallFlags
	host, _ := os.Hostname()
	flags := append(append(f.flags(), f.runFlags(host)...), un.flags(&f)...)
	return command("tessera-node run", "the node agent: device plugins, NRI plugin, CDI specs, /metrics and /healthz", flags, func(_ context.Context, cmd *cli.Command) error {
		return agentMain(&f, &un, cmd)
	}).Run(context.Background(), append([]string{"tessera-node run"}, args...))
}

// agentMain runs the agent with the parsed flags.
func agentMain(f *nodeFlags, un *uninstallFlags, cmd *cli.Command) error {
	log, err := f.log.Setup(os.Stderr)
	if err != nil {
		return err
	}
	cfg, err := f.load(cmd)
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
	l, err := ledger.Open(filepath.Join(cfg.DataDir, "ledger.json"), log)
	if err != nil {
		return err
	}
	gen, err := cdiGenerator(cfg, backend, true)
	if err != nil {
		return err
	}
	gen.Driver.Log = log
	client, err := kubeClient(cfg.Kubeconfig)
	if err != nil {
		log.Warn("no API server: pods granted GPUs cannot be verified and will be refused; the inventory is not published", "err", err)
	}
	acfg := agent.Config{NodeName: cfg.NodeName, SharesPerGPU: cfg.SharesPerGPU, CDIDir: cfg.CDIDir,
		Generator:       gen,
		HealthStatePath: filepath.Join(cfg.DataDir, "health.json"),
		Health:          gpu.HealthOptions{IgnoredXIDs: cfg.IgnoredXIDs, CheckInterval: cfg.HealthCheckInterval.Duration},
		Log:             log}
	var events record.EventRecorder
	if client != nil {
		var stopEvents func()
		acfg.Recorder, stopEvents = agent.NewEventRecorder(client, cfg.NodeName)
		defer stopEvents()
		events = acfg.Recorder
	}
	a := agent.New(acfg, backend, l)
	grants := podresources.New(cfg.PodResourcesSocket)
	defer grants.Close()
	a.WithAllocated(grants.List)

	var owner *ownerWatch
	if un.enabled {
		if client == nil {
			return fmt.Errorf("--cleanup-on-uninstall needs the API server to watch this agent's DaemonSet: %w", err)
		}
		if owner, err = watchOwner(ctx, client, un.podNamespace, un.podName, log); err != nil {
			return err
		}
	}
	var pods nri.Pods = noPods{err}
	var holdingsLeftOut atomic.Int64
	if client != nil {
		apiPods := nri.NewAPIPods(ctx, client, cfg.NodeName)
		pods = apiPods
		migCapable := func(uuid string) bool { n := a.Node(); return n != nil && n.MIGCapable[uuid] }
		a.WithPublisher(publisher(ctx, client, cfg.NodeName, migCapable, log))
		publishHoldings(ctx, client, cfg.NodeName, l, &holdingsLeftOut, log)
	}
	reg := telemetry.NewRegistry("tessera-node")
	metrics := newNodeMetrics(reg)
	onRefusal := refusalEvents(events)
	if err := a.Refresh(ctx); err != nil {
		return err
	}
	if err := metrics.verifyLedger(l, a.Inventory(), log); err != nil {
		return err
	}

	plugin := nri.New(nri.Config{StateDir: cfg.RunDir, VCUDALibrary: cfg.VCUDALibrary, KataHandlers: []string{cfg.KataRuntimeHandler},
		PluginIndex: cfg.NRIPluginIndex, AdminNamespaces: cfg.AdminNamespaces, Events: events, Log: log,
		OnCreate: func(pod *nriapi.PodSandbox, c *nriapi.Container, took time.Duration, refusal error) {
			metrics.observeCreate(pod, c, took, refusal)
			onRefusal(pod, c, took, refusal)
		}}, a, grants, pods)
	mgr := deviceplugin.NewManager(a, deviceplugin.Options{PluginDir: cfg.DevicePluginDir, Logger: log, ObserveAllocate: metrics.observeAllocate})
	badRegions := &badRegions{total: metrics.badRegions, log: log}
	state := &nodeState{node: cfg.NodeName, agent: a, regions: func() []containerUsage { return readContainerRegions(a, plugin.ReadRegion, badRegions) }}
	registerStateCollectors(reg, state, hamiNames{current: cfg.HAMiMetrics, legacy: cfg.HAMiLegacyMetrics})
	registerSecurityMetrics(reg, plugin, &holdingsLeftOut)

	errc := make(chan error, 5)
	// What the agent stops when a newer agent of the node takes over (nodeDuties): its device
	// plugins, and the memory guard and hold release, which two agents would run twice over the
	// node's containers (two kills, two Events, two releases of one hold).
	untilHandover, handOver := context.WithCancel(ctx)
	defer handOver()
	go func() {
		err := mgr.Run(untilHandover)
		if err == nil {
			<-ctx.Done() // stopped at a handover to a newer agent: this one runs on until stopped
		}
		errc <- named("device plugins", err)
	}()
	go func() { errc <- named("health watch", a.WatchHealth(ctx)) }()
	go rediscover(ctx, a.Refresh, cfg.RediscoverInterval.Duration, log)
	var draPlugin *dra.Driver
	if cfg.DRA {
		if client == nil {
			return fmt.Errorf("--dra needs the API server (ResourceSlices, ResourceClaims): %w", err)
		}
		draPlugin = dra.New(a, log).OnUnprepared(plugin.ReleaseClaim).Observe(metrics.observeDRA)
		if cfg.DRADynamicMIG {
			migCapable := func(uuid string) bool { n := a.Node(); return n != nil && n.MIGCapable[uuid] }
			if draPlugin, err = draPlugin.WithDynamicMIG(dra.DynamicMIG{Partitioner: gpu.NewPartitioner(backend.NVML()), MIGCapable: migCapable,
				Refresh: a.Refresh, JournalPath: filepath.Join(cfg.DataDir, "dra-mig.json")}); err != nil {
				return err
			}
		}
		go func() {
			errc <- named("DRA plugin", draPlugin.Run(ctx, dra.Options{NodeName: cfg.NodeName, Client: client,
				RegistrarDir: cfg.DRARegistrarDir, PluginDir: cfg.DRAPluginDir, UnhealthyEffect: resourceapi.DeviceTaintEffect(cfg.DRAUnhealthyEffect),
				RollingUpdateUID: types.UID(cfg.DRARollingUpdateUID)}))
		}()
	}
	go releaseUnlisted(untilHandover, grants.List, plugin.ReleaseUnlisted, unlistedInterval, log)
	check := &runtimecheck.Check{Node: cfg.NodeName, NRISocket: cfg.NRISocket, CRISocket: cfg.CRISocket, CDIDir: cfg.CDIDir,
		Synced: plugin.Synced, Events: events, Log: log, After: time.After}
	go check.Run(ctx)
	if err := startMemoryGuard(untilHandover, cfg, backend, a, plugin, events, reg, log); err != nil {
		return err
	}
	duties := &nodeDuties{seat: handover.Options{Dir: cfg.RunDir, Name: un.podName, Log: log}, listen: cfg.Listen,
		serve:        func(ln net.Listener) *http.Server { return serveHTTP(ln, a, mgr, plugin, draPlugin, reg) },
		nri:          func(ctx context.Context) error { return plugin.Run(ctx, cfg.NRISocket) },
		registered:   func() bool { return allRegistered(mgr) },
		registerWait: 10 * time.Second, handedOver: handOver, log: log}
	go func() { errc <- named("NRI plugin", duties.run(ctx)) }()
	log.Info("tessera-node running", "version", telemetry.Version(), "node", cfg.NodeName, "backend", backend.Name(), "cdiDir", cfg.CDIDir, "nri", cfg.NRISocket, "listen", cfg.Listen)
	select {
	case <-ctx.Done():
	case err := <-errc:
		return err
	}
	if owner == nil {
		return nil
	}
	uninstall, why := owner.uninstalling()
	if !uninstall {
		log.Info("stopping; the node's files stay for the next agent (upgrade or restart)")
		return nil
	}
	// Let the device plugins (their sockets), the NRI plugin and the health watch finish first,
	// well within the pod's termination grace period.
	stopped := time.After(5 * time.Second)
wait:
	for range 3 {
		select {
		case <-errc:
		case <-stopped:
			break wait
		}
	}
	log.Info("uninstall: removing what the agent put on the node", "why", why)
	if errs := cleanupNode(cfg); len(errs) > 0 {
		return fmt.Errorf("uninstall cleanup: %w", errors.Join(errs...))
	}
	log.Info("uninstall: the node is clean")
	return nil
}

func named(what string, err error) error {
	if err == nil || errors.Is(err, context.Canceled) {
		return nil
	}
	return fmt.Errorf("%s: %w", what, err)
}

// rediscover refreshes the agent's GPUs once an interval, the first an interval after start (run
// refreshed just before); a failed refresh is logged and the next one tried.
func rediscover(ctx context.Context, refresh func(context.Context) error, every time.Duration, log *slog.Logger) {
	_ = wait.PollUntilContextCancel(ctx, every, false, func(ctx context.Context) (bool, error) {
		if err := refresh(ctx); err != nil {
			log.Error("rediscover GPUs", "err", err)
		}
		return false, nil // never done: it ends with ctx
	})
}

// unlistedInterval is how often the kubelet's pods are listed to release holds of pods that will run
// no container again (nri.Plugin.ReleaseUnlisted): a cheap local call; a finished pod's holds go at
// the next list, a gone pod's after two lists without it. Sandbox events normally release holds at
// once, but a pod's phase may reach the API server after its sandbox stopped, and for sandboxes
// created before a containerd restart no matching event arrived (TestCluster/ContainerdRestart,
// TestNodeAgent).
const unlistedInterval = 10 * time.Second

// releaseUnlisted frees the holds of finished or gone pods (nri.Plugin.ReleaseUnlisted) once an
// interval, the first an interval after start; a failed list is logged and the next one tried.
func releaseUnlisted(ctx context.Context, list func(context.Context) (map[podresources.Key]podresources.Grant, error),
	release func(context.Context, map[podresources.Key]podresources.Grant), every time.Duration, log *slog.Logger) {
	_ = wait.PollUntilContextCancel(ctx, every, false, func(ctx context.Context) (bool, error) {
		listed, err := list(ctx)
		if err != nil {
			log.Warn("list the kubelet's pods to release stale holds", "err", err)
			return false, nil
		}
		release(ctx, listed)
		return false, nil
	})
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

// noPods answers when there is no API server: granted containers cannot be verified, and holds go
// by the kubelet's word alone (nri.ErrNoAPIServer).
type noPods struct{ err error }

func (n noPods) Pod(context.Context, string, string, string) (*corev1.Pod, error) {
	return nil, fmt.Errorf("%w (%v); start tessera-node with --kubeconfig or in-cluster credentials", nri.ErrNoAPIServer, n.err)
}

// allRegistered reports whether every device plugin is registered with the kubelet.
func allRegistered(mgr *deviceplugin.Manager) bool {
	for _, ok := range mgr.Registered() {
		if !ok {
			return false
		}
	}
	return true
}

// serveHTTP serves /healthz and the registry's /metrics on ln. draPlugin is nil without --dra.
func serveHTTP(ln net.Listener, a *agent.Agent, mgr *deviceplugin.Manager, plugin *nri.Plugin, draPlugin *dra.Driver, reg *prometheus.Registry) *http.Server {
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
		if draPlugin != nil {
			if err := draPlugin.Ready(); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
		}
		fmt.Fprintln(w, "ok")
	})
	mux.Handle("/metrics", telemetry.MetricsHandler(reg))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(ln)
	return srv
}

// refusalEvents records a Warning Event on the pod of every container the NRI plugin refuses, so
// `kubectl describe pod` says why the container does not start.
func refusalEvents(rec record.EventRecorder) func(*nriapi.PodSandbox, *nriapi.Container, time.Duration, error) {
	return func(pod *nriapi.PodSandbox, c *nriapi.Container, _ time.Duration, refusal error) {
		if refusal == nil || rec == nil {
			return
		}
		rec.Eventf(nri.PodRef(pod), corev1.EventTypeWarning, "GPUContainerRefused", "container %q refused by the Tessera node agent: %v", c.GetName(), refusal)
	}
}
