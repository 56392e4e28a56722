package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// ControlPlane is a real, loopback-only Kubernetes control plane built from upstream by
// test/tools/install-k8s.sh: etcd, kube-apiserver, and optionally kube-scheduler (with a scheduler
// extender) and kube-controller-manager. Every port is picked free at start, certificates come from a
// private CA, and everything lives under Dir; the test's cleanup kills each process by PID and
// removes Dir. No kubelet runs: tests create Node objects through the API, or start a kubelet on top
// (KubeletKubeconfig, PKI.Issue for its serving certificate, APIServerURL).
type ControlPlane struct {
	Dir          string
	PKI          *PKI
	APIServerURL string // https://127.0.0.1:<port>
	// Kubeconfig is an admin (system:masters) kubeconfig; Client and RESTConfig use it.
	Kubeconfig string
	RESTConfig *rest.Config
	Client     *kubernetes.Clientset

	Etcd              *Process
	APIServer         *Process
	Scheduler         *Process // nil with NoScheduler
	ControllerManager *Process // nil unless ControllerManager

	// SchedulerConfig is the KubeSchedulerConfiguration file the scheduler runs with.
	SchedulerConfig string
	schedulerPort   int
	kcmPort         int
	etcdURL         string
	saKey           string // service-account signing key (for kube-controller-manager)

	procs []*Process // every process, in start order (teardown stops them in reverse)
	cpus  []int      // ControlPlaneOptions.CPUs
}

// ControlPlaneOptions selects the components.
type ControlPlaneOptions struct {
	// Extender, when set, adds an `extenders:` entry to the scheduler's configuration. The extender
	// itself is the test's to start (StartProcess), before or after the control plane.
	Extender *ExtenderConfig
	// NoScheduler leaves kube-scheduler out.
	NoScheduler bool
	// ControllerManager adds kube-controller-manager with the controllers a node-less test cluster
	// wants (service accounts and their tokens, kube-root-ca.crt, namespaces, garbage collection,
	// workloads, disruption budgets); never the node-lifecycle controller, which would taint API-made nodes unreachable.
	ControllerManager bool
	// SchedulerVerbosity is kube-scheduler's -v (default 2).
	SchedulerVerbosity int
	// SchedulerExtraConfig is appended to the KubeSchedulerConfiguration (top-level YAML keys such
	// as percentageOfNodesToScore or profiles).
	SchedulerExtraConfig string
	// AdmissionConfig, when set, is an AdmissionConfiguration (YAML) kube-apiserver reads with
	// --admission-control-config-file (e.g. ResourceQuota's limitedResources).
	AdmissionConfig string
	// SchedulerMaxBackoff, when set (whole seconds), caps the retry backoff of pods whose
	// scheduling failed; the scheduler's default is 1 s doubling up to 10 s.
	SchedulerMaxBackoff time.Duration
	// CPUs, when set, pins every process of the control plane (and those StartProcess adds) to
	// these CPUs from its start; AddProcess starts one with CPUs of its own.
	CPUs []int
}

// ExtenderConfig is the scheduler's view of a scheduler extender (KubeSchedulerConfiguration
// `extenders:` entry).
type ExtenderConfig struct {
	// URLPrefix is where the extender serves, e.g. http://127.0.0.1:PORT; the scheduler POSTs to
	// URLPrefix/<verb>.
	URLPrefix string
	// FilterVerb, PrioritizeVerb and BindVerb default to "filter", "prioritize" and "bind"; set
	// NoBind to let the scheduler bind itself.
	FilterVerb, PrioritizeVerb, BindVerb string
	NoBind                               bool
	// PreemptVerb, when set, makes the scheduler ask the extender about preemption candidates.
	PreemptVerb string
	// Weight multiplies the extender's priorities (default 1).
	Weight int
	// HTTPTimeout bounds each call (default: the scheduler's, 30s).
	HTTPTimeout time.Duration
	// Ignorable lets scheduling go on when the extender cannot be reached (default: it cannot).
	Ignorable bool
	// ManagedResources are the resources that make a pod interesting to the extender; default
	// TesseraManagedResources.
	ManagedResources []ManagedResource
	// NodeCacheCapable makes the scheduler send node names only, not whole Node objects (the
	// extender then relies on its own node informer, as deploy/helm configures it).
	NodeCacheCapable bool
}

// ManagedResource is one `managedResources` entry of an extender.
type ManagedResource struct {
	Name string
	// IgnoredByScheduler makes the scheduler's own fit check skip the resource (nodes do not
	// advertise it; the extender accounts for it).
	IgnoredByScheduler bool
}

// TesseraManagedResources are the resources tessera-extender manages: whole GPUs and share counts
// are node capacity the scheduler checks too; per-share memory and cores are the extender's alone.
func TesseraManagedResources() []ManagedResource {
	return []ManagedResource{
		{Name: api.ResourceGPU},
		{Name: api.ResourceShare},
		{Name: api.ResourceShareMemory, IgnoredByScheduler: true},
		{Name: api.ResourceShareMemoryPercent, IgnoredByScheduler: true},
		{Name: api.ResourceShareCores, IgnoredByScheduler: true},
	}
}

// StartControlPlane starts the control plane and waits until the API serves, the "default"
// namespace has its "default" ServiceAccount and the scheduler is ready. The test's cleanup tears
// everything down (processes the test added with StartProcess included).
func StartControlPlane(t testing.TB, opts ControlPlaneOptions) *ControlPlane {
	t.Helper()
	dir, err := os.MkdirTemp("", "tsr-cp-")
	if err != nil {
		t.Fatal(err)
	}
	cp := &ControlPlane{Dir: dir, cpus: opts.CPUs}
	t.Cleanup(func() { cp.teardown(t) })
	for _, d := range []string{"logs", "etcd"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	cp.PKI, err = newPKI(filepath.Join(dir, "pki"))
	if err != nil {
		t.Fatal(err)
	}
	cp.startEtcd(t)
	cp.startAPIServer(t, opts.AdmissionConfig)
	cp.waitAPIServer(t)
	if !opts.NoScheduler {
		cp.startScheduler(t, opts)
	}
	if opts.ControllerManager {
		cp.startControllerManager(t)
	}
	cp.CreateNamespace(t, metav1.NamespaceDefault)
	if cp.Scheduler != nil {
		cp.WaitSchedulerReady(t)
	}
	if cp.ControllerManager != nil {
		cp.waitHealthz(t, cp.ControllerManager, cp.kcmPort, "/healthz")
	}
	return cp
}

// StartProcess starts a binary under the control plane's care: its log goes to Dir/logs/<name>.log
// and the cleanup stops it before the control plane. It runs on the control plane's CPUs.
func (cp *ControlPlane) StartProcess(t testing.TB, name, bin string, args ...string) *Process {
	t.Helper()
	p := &Process{Name: name, Bin: bin, Args: args, CPUs: cp.cpus, Log: filepath.Join(cp.Dir, "logs", name+".log")}
	cp.AddProcess(t, p)
	return p
}

// AddProcess starts p (made by the caller: its own environment, CPUs, log) under the control
// plane's care, as StartProcess does.
func (cp *ControlPlane) AddProcess(t testing.TB, p *Process) {
	t.Helper()
	cp.procs = append(cp.procs, p)
	p.Start(t)
}

func (cp *ControlPlane) startEtcd(t testing.TB) {
	t.Helper()
	client := "http://127.0.0.1:" + strconv.Itoa(freePort(t))
	peer := "http://127.0.0.1:" + strconv.Itoa(freePort(t))
	cp.Etcd = cp.StartProcess(t, "etcd", tool(t, "etcd"),
		"--name=default", "--data-dir="+filepath.Join(cp.Dir, "etcd"),
		"--listen-client-urls="+client, "--advertise-client-urls="+client,
		"--listen-peer-urls="+peer, "--initial-advertise-peer-urls="+peer,
		"--initial-cluster=default="+peer,
		"--unsafe-no-fsync", "--log-level=warn")
	hc := &http.Client{Timeout: 2 * time.Second}
	err := waitFor(30*time.Second, 100*time.Millisecond, func() (bool, error) {
		if !cp.Etcd.Running() {
			return false, fmt.Errorf("etcd exited")
		}
		resp, err := hc.Get(client + "/health")
		if err != nil {
			return false, err
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, fmt.Errorf("etcd /health: %s", resp.Status)
	})
	if err != nil {
		t.Fatalf("etcd did not come up: %v\n%s", err, cp.Etcd.LogTail(30))
	}
	cp.etcdURL = client
}

func (cp *ControlPlane) startAPIServer(t testing.TB, admissionConfig string) {
	t.Helper()
	admissionFile := "" // the flag's default: none
	if admissionConfig != "" {
		admissionFile = filepath.Join(cp.Dir, "admission.yaml")
		if err := os.WriteFile(admissionFile, []byte(admissionConfig), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	p := cp.PKI
	port := freePort(t)
	cp.APIServerURL = "https://127.0.0.1:" + strconv.Itoa(port)
	issue := func(name string, spec CertSpec) (string, string) {
		c, k, err := p.Issue(name, spec)
		if err != nil {
			t.Fatal(err)
		}
		return c, k
	}
	srvCert, srvKey := issue("apiserver", CertSpec{CommonName: "kube-apiserver", Hosts: []string{"127.0.0.1", "10.0.0.1", "localhost",
		"kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"}})
	kubeletCert, kubeletKey := issue("apiserver-kubelet-client", CertSpec{CommonName: "kube-apiserver-kubelet-client", Organizations: []string{"kubeadm:cluster-admins"}})
	proxyCert, proxyKey := issue("front-proxy-client", CertSpec{CommonName: "front-proxy-client"})
	saPub, saKey, err := p.serviceAccountKeys()
	if err != nil {
		t.Fatal(err)
	}
	cp.Kubeconfig = cp.MintKubeconfig(t, "admin", CertSpec{CommonName: "tessera-e2e-admin", Organizations: []string{"system:masters"}})
	cp.APIServer = cp.StartProcess(t, "kube-apiserver", tool(t, "kube-apiserver"),
		"--etcd-servers="+cp.etcdURL,
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--secure-port="+strconv.Itoa(port),
		"--endpoint-reconciler-type=none",
		"--tls-cert-file="+srvCert, "--tls-private-key-file="+srvKey,
		"--client-ca-file="+p.CACert,
		"--kubelet-client-certificate="+kubeletCert, "--kubelet-client-key="+kubeletKey,
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+saPub, "--service-account-signing-key-file="+saKey,
		"--service-cluster-ip-range=10.0.0.0/24",
		"--authorization-mode=Node,RBAC", "--allow-privileged=true",
		// requestheader flags silence the missing-CA complaints of the aggregation layer
		"--requestheader-client-ca-file="+p.CACert, "--requestheader-allowed-names=front-proxy-client",
		"--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
		"--requestheader-extra-headers-prefix=X-Remote-Extra-",
		"--proxy-client-cert-file="+proxyCert, "--proxy-client-key-file="+proxyKey,
		"--profiling=false", "--admission-control-config-file="+admissionFile)
	cp.saKey = saKey
}

func (cp *ControlPlane) waitAPIServer(t testing.TB) {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", cp.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	cfg.QPS, cfg.Burst = 200, 400
	cp.RESTConfig = cfg
	cp.Client, err = kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	cp.WaitAPIServerReady(t)
}

// WaitAPIServerReady waits until kube-apiserver answers /readyz, e.g. after cp.APIServer.Start
// (etcd keeps the cluster's state across an API server restart).
func (cp *ControlPlane) WaitAPIServerReady(t testing.TB) {
	t.Helper()
	err := waitFor(2*time.Minute, 200*time.Millisecond, func() (bool, error) {
		if !cp.APIServer.Running() {
			return false, fmt.Errorf("kube-apiserver exited")
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		body, err := cp.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		if err != nil {
			return false, fmt.Errorf("/readyz: %v %s", err, body)
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("kube-apiserver did not become ready: %v\n%s", err, cp.APIServer.LogTail(40))
	}
}

// SchedulerConfiguration renders the KubeSchedulerConfiguration for kubeconfig and opts.
func SchedulerConfiguration(kubeconfig string, opts ControlPlaneOptions) string {
	var b strings.Builder
	fmt.Fprintf(&b, `apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: %s
leaderElection:
  leaderElect: false
`, kubeconfig)
	if opts.SchedulerMaxBackoff > 0 {
		fmt.Fprintf(&b, "podInitialBackoffSeconds: 1\npodMaxBackoffSeconds: %d\n", int(opts.SchedulerMaxBackoff/time.Second))
	}
	if e := opts.Extender; e != nil {
		verb := func(v, def string) string {
			if v == "" {
				return def
			}
			return v
		}
		weight := e.Weight
		if weight == 0 {
			weight = 1
		}
		fmt.Fprintf(&b, `extenders:
- urlPrefix: %q
  filterVerb: %s
  prioritizeVerb: %s
`, e.URLPrefix, verb(e.FilterVerb, "filter"), verb(e.PrioritizeVerb, "prioritize"))
		if !e.NoBind {
			fmt.Fprintf(&b, "  bindVerb: %s\n", verb(e.BindVerb, "bind"))
		}
		if e.PreemptVerb != "" {
			fmt.Fprintf(&b, "  preemptVerb: %s\n", e.PreemptVerb)
		}
		fmt.Fprintf(&b, "  weight: %d\n  enableHTTPS: false\n  nodeCacheCapable: %t\n  ignorable: %t\n", weight, e.NodeCacheCapable, e.Ignorable)
		if e.HTTPTimeout > 0 {
			fmt.Fprintf(&b, "  httpTimeout: %s\n", e.HTTPTimeout)
		}
		b.WriteString("  managedResources:\n")
		mr := e.ManagedResources
		if mr == nil {
			mr = TesseraManagedResources()
		}
		for _, r := range mr {
			fmt.Fprintf(&b, "  - name: %s\n    ignoredByScheduler: %t\n", r.Name, r.IgnoredByScheduler)
		}
	}
	b.WriteString(opts.SchedulerExtraConfig)
	return b.String()
}

func (cp *ControlPlane) startScheduler(t testing.TB, opts ControlPlaneOptions) {
	t.Helper()
	kc := cp.MintKubeconfig(t, "scheduler", CertSpec{CommonName: "system:kube-scheduler"})
	cp.SchedulerConfig = filepath.Join(cp.Dir, "scheduler-config.yaml")
	if err := os.WriteFile(cp.SchedulerConfig, []byte(SchedulerConfiguration(kc, opts)), 0o600); err != nil {
		t.Fatal(err)
	}
	v := opts.SchedulerVerbosity
	if v == 0 {
		v = 2
	}
	cp.schedulerPort = freePort(t)
	cp.Scheduler = cp.StartProcess(t, "kube-scheduler", tool(t, "kube-scheduler"),
		"--config="+cp.SchedulerConfig,
		"--authentication-kubeconfig="+kc, "--authorization-kubeconfig="+kc,
		"--bind-address=127.0.0.1", "--secure-port="+strconv.Itoa(cp.schedulerPort), "-v="+strconv.Itoa(v))
}

// WaitSchedulerReady waits until kube-scheduler reports ready (informers synced), e.g. after
// cp.Scheduler.Start.
func (cp *ControlPlane) WaitSchedulerReady(t testing.TB) {
	t.Helper()
	cp.waitHealthz(t, cp.Scheduler, cp.schedulerPort, "/readyz")
}

func (cp *ControlPlane) waitHealthz(t testing.TB, p *Process, port int, path string) {
	t.Helper()
	p.WaitHealthy(t, fmt.Sprintf("https://127.0.0.1:%d%s", port, path), time.Minute)
}

func (cp *ControlPlane) startControllerManager(t testing.TB) {
	t.Helper()
	kc := cp.MintKubeconfig(t, "controller-manager", CertSpec{CommonName: "system:kube-controller-manager"})
	cp.kcmPort = freePort(t)
	cp.ControllerManager = cp.StartProcess(t, "kube-controller-manager", tool(t, "kube-controller-manager"),
		"--kubeconfig="+kc, "--authentication-kubeconfig="+kc, "--authorization-kubeconfig="+kc,
		"--bind-address=127.0.0.1", "--secure-port="+strconv.Itoa(cp.kcmPort), "--leader-elect=false",
		"--service-account-private-key-file="+cp.saKey, "--root-ca-file="+cp.PKI.CACert,
		"--cluster-signing-cert-file="+cp.PKI.CACert, "--cluster-signing-key-file="+cp.PKI.CAKey,
		"--use-service-account-credentials=true",
		"--controllers=serviceaccount-controller,serviceaccount-token-controller,root-ca-certificate-publisher-controller,"+
			"namespace-controller,garbage-collector-controller,replicaset-controller,deployment-controller,"+
			"daemonset-controller,job-controller,pod-garbage-collector-controller,"+
			"disruption-controller,"+ // PodDisruptionBudgets' status, which evictions check (TestMultiNode/Drain)
			"resourceclaim-controller") // claims from ResourceClaimTemplates (TestDRA)
}

// MintKubeconfig issues a client certificate for spec (CN is the user, Organizations the groups)
// and writes Dir/<name>.kubeconfig for it; it returns the path.
func (cp *ControlPlane) MintKubeconfig(t testing.TB, name string, spec CertSpec) string {
	t.Helper()
	c, k, err := cp.PKI.Issue(name, spec)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(cp.Dir, name+".kubeconfig")
	if err := writeKubeconfig(path, cp.APIServerURL, cp.PKI.CACert, c, k); err != nil {
		t.Fatal(err)
	}
	return path
}

// KubeletKubeconfig returns a kubeconfig for the kubelet of node (user system:node:<node>, group
// system:nodes, as the Node authorizer expects). Its serving certificate comes from
// cp.PKI.Issue("kubelet-serving", CertSpec{CommonName: node, Hosts: ...}).
func (cp *ControlPlane) KubeletKubeconfig(t testing.TB, node string) string {
	t.Helper()
	return cp.MintKubeconfig(t, "kubelet-"+node, CertSpec{CommonName: "system:node:" + node, Organizations: []string{"system:nodes"}})
}

// CreateNamespace creates a namespace (unless it exists) and its "default" ServiceAccount, which
// pod admission requires and which no controller creates without kube-controller-manager. It
// also publishes the kube-root-ca.crt ConfigMap a kubelet needs for projected token volumes.
func (cp *ControlPlane) CreateNamespace(t testing.TB, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ca, err := os.ReadFile(cp.PKI.CACert)
	if err != nil {
		t.Fatal(err)
	}
	err = waitFor(30*time.Second, 100*time.Millisecond, func() (bool, error) {
		_, err := cp.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			return false, err
		}
		_, err = cp.Client.CoreV1().ServiceAccounts(name).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			return false, err
		}
		_, err = cp.Client.CoreV1().ConfigMaps(name).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "kube-root-ca.crt"},
			Data: map[string]string{"ca.crt": string(ca)}}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			return false, err
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("create namespace %s: %v", name, err)
	}
}

// LogTails returns the end of every component's log, for failure messages.
func (cp *ControlPlane) LogTails(lines int) string {
	var b strings.Builder
	for _, p := range cp.procs {
		fmt.Fprintf(&b, "----- %s (%s)\n%s\n", p.Name, p.Log, p.LogTail(lines))
	}
	return b.String()
}

// teardown stops every process, newest first, and removes Dir. On failure it logs the end of each
// component's log first; with TESSERA_E2E_KEEP=1 it keeps Dir for inspection.
func (cp *ControlPlane) teardown(t testing.TB) {
	if t.Failed() {
		t.Logf("control plane logs (%s):\n%s", cp.Dir, cp.LogTails(25))
	}
	for i := len(cp.procs) - 1; i >= 0; i-- {
		cp.procs[i].Stop(t)
	}
	for _, p := range cp.procs {
		if p.Running() {
			t.Errorf("%s is still running after teardown", p.Name)
		}
	}
	if os.Getenv("TESSERA_E2E_KEEP") == "1" {
		t.Logf("TESSERA_E2E_KEEP=1: keeping %s", cp.Dir)
		return
	}
	if err := os.RemoveAll(cp.Dir); err != nil {
		t.Errorf("remove %s: %v", cp.Dir, err)
	}
}
