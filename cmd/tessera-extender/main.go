// Command tessera-extender is Tessera's kube-scheduler extender: it filters and scores nodes for
// pods asking for nvidia.com/gpu and tessera.dev/vgpu*, and binds them with a per-container GPU
// assignment. Cluster state comes only from the API server (informers); one replica binds
// (leader election), all replicas answer filter and prioritize.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	cli "github.com/urfave/cli/v3"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/extender"
	"github.com/tessera-gpu/tessera/internal/placement"
	"github.com/tessera-gpu/tessera/internal/telemetry"
)

type options struct {
	kubeconfig, listen, metricsListen, config, policy, identity   string
	advertiseURL, peerListen                                      string
	leaderElect, pickOne, version, reusePort, warmMemo, draClaims bool
	// policySet: --policy (or its variable) was given, and overrides the config file's policy.
	policySet bool
	// schedulerNames, when given, replace the config file's schedulerNames.
	schedulerNames []string
	// tls overrides the config file's tls fields that are set.
	tls configv1.ExtenderTLS
	qps int
	log telemetry.LogOptions
}

// envPrefix starts the environment variable of every flag: --policy is also TESSERA_EXTENDER_POLICY.
const envPrefix = "TESSERA_EXTENDER_"

// parseFlags reads the flags with urfave/cli: each from the command line, else from its environment
// variable, else its default. It returns flag.ErrHelp when it printed the help.
func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	host, _ := os.Hostname()
	str := func(name string, dst *string, def, usage string) cli.Flag {
		return &cli.StringFlag{Name: name, Destination: dst, Value: def, Usage: usage, Sources: telemetry.EnvSources(envPrefix, name)}
	}
	boolean := func(name string, dst *bool, def bool, usage string) cli.Flag {
		return &cli.BoolFlag{Name: name, Destination: dst, Value: def, Usage: usage, Sources: telemetry.EnvSources(envPrefix, name)}
	}
	flags := []cli.Flag{
		str("kubeconfig", &o.kubeconfig, "", "kubeconfig file (empty: in-cluster config)"),
		str("listen", &o.listen, "127.0.0.1:8888", "address the extender HTTP API listens on (POST /filter, /prioritize, /bind; GET /healthz)"),
		str("config", &o.config, "", "ExtenderConfig YAML file (apiVersion tessera.dev/v1, kind ExtenderConfig); empty: defaults"),
		str("policy", &o.policy, "", "default placement policy, overriding the config file: "+fmt.Sprint(api.KnownPolicies)),
		&cli.StringSliceFlag{Name: "scheduler-names", Destination: &o.schedulerNames, Sources: telemetry.EnvSources(envPrefix, "scheduler-names"),
			Usage: "schedulers (a pod's spec.schedulerName) whose pods bind binds, any other pod refused; overriding the config file's schedulerNames (default " + configv1.DefaultSchedulerName + "); comma-separated or repeated"},
		str("identity", &o.identity, fmt.Sprintf("%s-%d", host, os.Getpid()), "this replica's identity in leader election and node bind Leases"),
		&cli.IntFlag{Name: "kube-api-qps", Destination: &o.qps, Value: 100, Sources: telemetry.EnvSources(envPrefix, "kube-api-qps"),
			Usage: "requests per second to the API server (burst twice that); a bind costs two to eight (two on a node this replica bound last)"},
		str("advertise-url", &o.advertiseURL, "", "URL other replicas reach this one at (http://POD_IP:PORT); non-leaders pass binds on to the leader's. With --peer-listen, port 0 stands for that listener's port"),
		str("peer-listen", &o.peerListen, "", "an extra address of the extender API, for binds other replicas pass on to this one; port 0 picks a free port (for replicas sharing a host network, where --listen is shared with --reuse-port)"),
		boolean("reuse-port", &o.reusePort, false, "open --listen and --metrics-listen with SO_REUSEPORT, so replicas on one host network share the ports (the kernel spreads connections over them)"),
		boolean("filter-pick-one", &o.pickOne, false, "filter keeps only the placement policy's chosen node (ties to the smallest name) and holds it until the bind, so the kube-scheduler binds where the policy prefers"),
		boolean("dra-claims", &o.draClaims, false, "place pods whose DRA claims request Tessera's DeviceClasses ("+api.DRAClassWholeGPU+", "+api.DRAClassShareGPU+") as device-plugin pods are placed (the scheduler's allocator still picks the devices inside the chosen node): reads ResourceClaims and ResourceClaimTemplates (resource.k8s.io/v1, Kubernetes 1.34+; needs list and watch on both) and counts allocated claims on each node"),
		boolean("warm-memo", &o.warmMemo, true, "re-evaluate, on one background goroutine, the nodes that changed for the request shapes the evaluation memo holds (and every node for the 32 most recently used shapes after a new typical-shape snapshot), so that the next pod of a shape finds its outcomes remembered; costs a few ms of CPU per pod"),
		boolean("leader-elect", &o.leaderElect, true, "bind only while holding the leader Lease (the other replicas answer filter/prioritize)"),
		str("tls-cert-file", &o.tls.CertFile, "", "serving certificate (PEM) of the extender API and the peer port; also the client certificate a replica presents when passing a verb on to the leader (overrides the config's tls.certFile). Re-read when it changes"),
		str("tls-key-file", &o.tls.KeyFile, "", "key of --tls-cert-file (overrides tls.keyFile)"),
		str("tls-client-ca-file", &o.tls.ClientCAFile, "", "CA bundle client certificates must chain to; it also verifies the leader's certificate (overrides tls.clientCAFile)"),
		&cli.StringSliceFlag{Name: "tls-allowed-clients", Destination: &o.tls.AllowedClients, Sources: telemetry.EnvSources(envPrefix, "tls-allowed-clients"),
			Usage: "client identities allowed to call (a verified client certificate's CommonName, DNS name or Organization): the kube-scheduler's and the extender's own; overrides tls.allowedClients; comma-separated or repeated"},
		str("tls-peer-server-name", &o.tls.PeerServerName, "", "name the leader's serving certificate must carry when a verb is passed on (default: the first DNS name of --tls-cert-file)"),
		str("metrics-listen", &o.metricsListen, "", "address /metrics (Prometheus) and /healthz are served on apart from the extender API, so that scrapes need no access to it (the chart: 0.0.0.0:9447); empty: /metrics is served on --listen"),
		&cli.BoolFlag{Name: "version", Destination: &o.version, Usage: "print the version and exit"},
	}
	parsed := false
	cmd := &cli.Command{Name: "tessera-extender", Usage: "Tessera's kube-scheduler extender", HideHelpCommand: true,
		Flags: append(flags, o.log.CLIFlags(envPrefix)...), ErrWriter: stderr,
		Action: func(_ context.Context, cmd *cli.Command) error {
			parsed = true
			o.policySet = cmd.IsSet("policy") && o.policy != ""
			return nil
		}}
	if err := cmd.Run(context.Background(), append([]string{"tessera-extender"}, args...)); err != nil {
		fmt.Fprintln(stderr, "tessera-extender:", err)
		return nil, err
	}
	if !parsed {
		return nil, flag.ErrHelp
	}
	return o, nil
}

func main() {
	o, err := parseFlags(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		os.Exit(2)
	}
	if o.version {
		telemetry.PrintVersion(os.Stdout, "tessera-extender")
		return
	}
	log, err := o.log.Setup(os.Stderr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "tessera-extender:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, o, log); err != nil {
		log.Error("tessera-extender failed", "err", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, o *options, log *slog.Logger) error {
	cfg, err := configv1.LoadExtenderConfig(o.config)
	if err != nil {
		return err
	}
	// Flags override the file (validated again with them).
	if o.policySet {
		cfg.Policy = o.policy
	}
	if len(o.schedulerNames) > 0 {
		cfg.SchedulerNames = o.schedulerNames
	}
	overrideTLS(&cfg.TLS, o.tls)
	if err := cfg.Validate(); err != nil {
		return err
	}
	var rc *rest.Config
	if o.kubeconfig != "" {
		rc, err = clientcmd.BuildConfigFromFlags("", o.kubeconfig)
	} else {
		rc, err = rest.InClusterConfig()
	}
	if err != nil {
		return fmt.Errorf("kubernetes client config: %w", err)
	}
	// A bind costs two to eight API calls; client-go's default 5 QPS would starve binds and the
	// leader Lease renewals under a burst of pods.
	rc.QPS, rc.Burst = float32(o.qps), o.qps*2
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return fmt.Errorf("kubernetes client: %w", err)
	}
	eng, err := placement.NewEngine(cfg.Policy)
	if err != nil {
		return err
	}
	class := extender.ClassOptions{Experiment: cfg.ExperimentPriorityClasses, Inference: cfg.InferencePriorityClasses,
		Training: cfg.TrainingPriorityClasses, AllowPolicyOverride: *cfg.AllowPolicyOverride}
	state := extender.NewState(cfg.ReservationTTL.Duration, log)
	state.InventoryMaxAge = cfg.InventoryMaxAge.Duration
	factory := informers.NewSharedInformerFactory(client, 0)
	quotas, err := extender.WireInformers(factory, state, class)
	if err != nil {
		return fmt.Errorf("informers: %w", err)
	}
	pdbs, podByUID, err := extender.WirePreemptionListers(factory)
	if err != nil {
		return fmt.Errorf("informers: %w", err)
	}
	var claims *extender.ClaimSource
	if o.draClaims {
		if claims, err = extender.WireClaimInformers(factory, state); err != nil {
			return fmt.Errorf("informers: %w", err)
		}
	}
	nodes := factory.Core().V1().Nodes().Lister()
	events, stopEvents := telemetry.NewEventRecorder(client, corev1.EventSource{Component: "tessera-extender"})
	defer stopEvents()
	leader := &atomic.Bool{}
	x := &extender.Extender{
		Engine: eng, State: state, Client: client, Quotas: quotas, PDBs: pdbs, PodByUID: podByUID, Class: class, Log: log,
		NodeByName: func(name string) *corev1.Node {
			n, _ := nodes.Get(name) // not found: nil, and bind reads the API server
			return n
		},
		Events:         events,
		Locker:         &extender.NodeLocker{Client: client, Namespace: cfg.LeaseNamespace, Identity: o.identity, Duration: 15 * time.Second, Keep: true},
		BindTimeout:    30 * time.Second,
		PickOne:        o.pickOne,
		Claims:         claims,
		SchedulerNames: cfg.SchedulerNames,
	}
	secure, err := serveTLS(o, cfg.TLS)
	if err != nil {
		return err
	}
	if o.leaderElect {
		x.Leader = leader
		x.LeaderURL = extender.LeaseLeaderURL(client, cfg.LeaseNamespace, cfg.LeaderElectionID)
		x.Forward = &http.Client{Timeout: 35 * time.Second}
		if secure != nil {
			x.Forward = secure.ForwardClient(35 * time.Second)
		}
	}
	factory.Start(ctx.Done())
	// Every replica watches the bind Leases (one namespace) so that a replica taking over from a
	// dead one has already seen its kept Leases age (NodeLocker.Observe).
	leaseInformers := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace(cfg.LeaseNamespace))
	if err := extender.WireLeaseObserver(leaseInformers, x.Locker); err != nil {
		return err
	}
	leaseInformers.Start(ctx.Done())
	var synced atomic.Bool
	go func() {
		for informer, ok := range factory.WaitForCacheSync(ctx.Done()) {
			if !ok { // stopped before the caches filled: stay not ready
				log.Warn("informer cache not synced", "type", informer.String())
				return
			}
		}
		synced.Store(true)
		log.Info("cluster state rebuilt from the API server")
	}()
	if o.warmMemo {
		go x.RunWarmer(ctx)
	}
	go wait.UntilWithContext(ctx, func(context.Context) {
		if n := state.ExpireReservations(); n > 0 {
			log.Warn("expired in-flight reservations", "count", n)
		}
	}, 10*time.Second)
	// Listen before standing for election: the advertised URL may name the peer listener's port.
	lns, err := listen(o)
	if err != nil {
		return err
	}
	defer lns.close()
	if secure != nil {
		lns.serveTLS(secure.ServerConfig())
	}
	advertise, err := advertiseURL(o.advertiseURL, lns.peer)
	if err != nil {
		return err
	}
	if o.leaderElect {
		lock := &resourcelock.LeaseLock{
			LeaseMeta:  metav1ObjectMeta(cfg.LeaderElectionID, cfg.LeaseNamespace),
			Client:     client.CoordinationV1(),
			LockConfig: resourcelock.ResourceLockConfig{Identity: extender.LeaderIdentity(o.identity, advertise)},
		}
		// RunOrDie returns when leadership is lost (an API server outage, say): stand again, or this
		// replica would refuse every bind forever.
		go func() {
			for ctx.Err() == nil {
				leaderelection.RunOrDie(ctx, leaderelection.LeaderElectionConfig{
					Lock: lock, LeaseDuration: 15 * time.Second, RenewDeadline: 10 * time.Second, RetryPeriod: 2 * time.Second,
					ReleaseOnCancel: true,
					Callbacks: leaderelection.LeaderCallbacks{
						OnStartedLeading: func(context.Context) { leader.Store(true); log.Info("leading: this replica binds") },
						OnStoppedLeading: func() {
							if leader.Swap(false) {
								log.Warn("stopped leading; standing for election again")
							}
							// The next leader binds at once on the nodes this replica bound last.
							rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
							defer cancel()
							x.Locker.ReleaseKept(rctx)
						},
					},
				})
			}
		}()
	}
	reg := telemetry.NewRegistry("tessera-extender")
	metrics := newExtenderMetrics(reg, leader, o.leaderElect, x.Evaluations, x.Bounded, x.Warmed)
	reg.MustRegister(newPressureCollector(x.State.Shapes()))
	registerStateMetrics(reg, x.State.Conflicts, x.State.ExpiredReservations)
	verbsHandler := x.Handler(synced.Load)
	mux := http.NewServeMux()
	mux.Handle("/metrics", telemetry.MetricsHandler(reg))
	mux.Handle("/healthz", verbsHandler)
	main := metrics.instrument(verbsHandler)
	if o.metricsListen == "" {
		mux.Handle("/", main)
		main = mux
	}
	servers := []*http.Server{{Handler: main, ReadHeaderTimeout: 10 * time.Second}}
	listeners := []net.Listener{lns.api}
	if lns.metrics != nil {
		servers = append(servers, &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second})
		listeners = append(listeners, lns.metrics)
	}
	if o.reusePort {
		// A new connection per call lets the kernel spread the scheduler's calls over the replicas
		// sharing the port; a kept-alive one would send them all to one replica.
		servers[0].SetKeepAlivesEnabled(false)
	}
	if lns.peer != nil {
		// The peer port is this replica's own: it also serves its /metrics, which a shared metrics
		// port cannot address.
		peer := http.NewServeMux()
		peer.Handle("/metrics", telemetry.MetricsHandler(reg))
		peer.Handle("/healthz", verbsHandler)
		peer.Handle("/", metrics.instrument(verbsHandler))
		servers = append(servers, &http.Server{Handler: peer, ReadHeaderTimeout: 10 * time.Second})
		listeners = append(listeners, lns.peer)
	}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		for _, srv := range servers {
			_ = srv.Shutdown(sctx)
		}
		x.Locker.ReleaseKept(sctx) // binds are over: free the node Leases kept between them
	}()
	log.Info("serving", "version", telemetry.Version(), "listen", lns.api.Addr().String(), "metricsListen", o.metricsListen, "advertise", advertise, "policy", cfg.Policy, "identity", o.identity, "leaderElect", o.leaderElect, "tls", secure != nil)
	errc := make(chan error, len(servers))
	for i, srv := range servers {
		go func() { errc <- srv.Serve(listeners[i]) }()
	}
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serve: %w", err)
	}
	return nil
}
