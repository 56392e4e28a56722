package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/retry"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/placement"
	"github.com/tessera-gpu/tessera/internal/placement/simulate"
)

// policyKubeScheduler is the benchmark's name for the kube-scheduler alone (no extender; in-tree
// NodeResourcesFit with MostAllocated over CPU, memory, whole GPUs and share tokens).
const policyKubeScheduler = "kube-scheduler"

// BenchmarkPlacement replays a trace through the real kube-scheduler against API-only nodes made
// from the trace (no kubelet: pods are bound, never run), with the paper's protocol for one seed
// (the seed's arrival order and node permutation; nodes are named "%04d-<sn>" by that permutation,
// so the smallest name breaks ties as in the reference simulator). It prints tessera-sim's lines
// (policy=<name> unallocated_gpu_pct_at_100=<x.xx>) plus pods/s, and the simulator's number for the
// same seed with shapes learned online (what the live extender can know) beside it.
//
// Environment: TESSERA_BENCH_NODES, TESSERA_BENCH_PODS (CSV; default the openb default trace),
// TESSERA_BENCH_SEED (42), TESSERA_BENCH_LIMIT (first N pods of the list, 0 = all),
// TESSERA_BENCH_POLICIES (tessera,fgd,kube-scheduler; DRA claims instead of device-plugin
// resources: dra-least, dra-most, dra-tessera, placement_bench_dra_test.go), TESSERA_BENCH_VARY (a variant of the cluster and
// the pod list as tessera-sim's --vary derives it, e.g. split=0.7,multigpu-request=0.5; empty: both as
// they are),
// TESSERA_BENCH_NODE_COPIES (each node of the
// list k times, 1 = as listed; the arrivals follow the capacity, since the protocol resamples pods
// up to 130% of it) and TESSERA_BENCH_ARRIVALS (stop after the first N arrivals, 0 = all; a run
// stopped before the 100% arrived point prints the load it reached, not a number at 100%).
// TESSERA_BENCH_EXTENDER_CPUS (a CPU list, e.g. 1; empty: no pinning) runs tessera-extender on
// those CPUs and everything else of the run (etcd, kube-apiserver, kube-scheduler, the
// controller-manager, this process's client) on the CPUs left, in every policy's run alike;
// TESSERA_BENCH_EXTENDER_ENV (space-separated NAME=value, e.g. GOMAXPROCS=2 GODEBUG=gctrace=1) is
// added to the extender's environment only.
// `make bench-placement` sets them.
func BenchmarkPlacement(b *testing.B) {
	data := filepath.Join(repoRoot(), "..", "shared", "data", "openb")
	nodesCSV := envOr("TESSERA_BENCH_NODES", filepath.Join(data, "openb_node_list_gpu_node.csv"))
	podsCSV := envOr("TESSERA_BENCH_PODS", filepath.Join(data, "openb_pod_list_default.csv"))
	seed, _ := strconv.ParseUint(envOr("TESSERA_BENCH_SEED", "42"), 10, 64)
	limit, _ := strconv.Atoi(envOr("TESSERA_BENCH_LIMIT", "0"))
	copies, err := strconv.Atoi(envOr("TESSERA_BENCH_NODE_COPIES", "1"))
	if err != nil || copies < 1 {
		b.Fatalf("TESSERA_BENCH_NODE_COPIES=%q: want a whole number >= 1", os.Getenv("TESSERA_BENCH_NODE_COPIES"))
	}
	stopAfter, err := strconv.Atoi(envOr("TESSERA_BENCH_ARRIVALS", "0"))
	if err != nil || stopAfter < 0 {
		b.Fatalf("TESSERA_BENCH_ARRIVALS=%q: want a whole number >= 0 (0: all arrivals)", os.Getenv("TESSERA_BENCH_ARRIVALS"))
	}
	nodes, err := simulate.LoadNodes(nodesCSV)
	if err != nil {
		b.Fatal(err)
	}
	if nodes, err = replicateNodes(nodes, copies); err != nil {
		b.Fatal(err)
	}
	pods, err := simulate.LoadPods(podsCSV)
	if err != nil {
		b.Fatal(err)
	}
	if limit > 0 && limit < len(pods) {
		pods = pods[:limit]
	}
	if vary := os.Getenv("TESSERA_BENCH_VARY"); vary != "" {
		if nodes, pods, err = simulate.VaryClusterBy(nodes, pods, vary); err != nil { // as tessera-sim --vary
			b.Fatalf("TESSERA_BENCH_VARY: %v", err)
		}
	}
	pin, err := benchPinning(os.Getenv("TESSERA_BENCH_EXTENDER_CPUS"))
	if err != nil {
		b.Fatalf("TESSERA_BENCH_EXTENDER_CPUS: %v", err)
	}
	if pin.extender != nil {
		tesseraBinary(b, "tessera-extender") // built on every CPU, before this process is pinned
		if err := pinSelf(pin.rest); err != nil {
			b.Fatal(err)
		}
		fmt.Printf("pinning: tessera-extender on CPUs %s; etcd, kube-apiserver, kube-scheduler, the controller-manager and the benchmark on CPUs %s\n",
			formatCPUList(pin.extender), formatCPUList(pin.rest))
	}
	cluster := simulate.NewCluster(nodes, pods)
	arrivals := len(cluster.Arrivals(seed, 1.3))
	for _, policy := range strings.Split(envOr("TESSERA_BENCH_POLICIES", "tessera,fgd,kube-scheduler"), ",") {
		b.Run(policy, func(b *testing.B) {
			for range b.N {
				r := replayLive(b, cluster, policy, seed, stopAfter, pin)
				line := placementLine(policy, r.unallocated, r.arrivedPct, r.allocatedPct, r.podsPerSec, seed, len(nodes), r.replayed, arrivals)
				full := reached100(r.arrivedPct, r.replayed >= arrivals)
				if policy != policyKubeScheduler && full {
					res, err := cluster.Run(policy, seed, 1.3)
					if err != nil {
						b.Fatal(err)
					}
					line += fmt.Sprintf("; simulator (shapes online, same seed): %.2f", res.Unallocated[len(res.Unallocated)-1])
				}
				fmt.Println(line)
				if full {
					b.ReportMetric(r.unallocated[len(r.unallocated)-1], "unalloc%@100")
				}
				b.ReportMetric(r.podsPerSec, "pods/s")
			}
		})
	}
}

// benchCPUs is the run's CPU pinning: the extender's CPUs and the rest's; both nil without pinning.
type benchCPUs struct{ extender, rest []int }

// benchPinning reads TESSERA_BENCH_EXTENDER_CPUS (empty: no pinning) against the CPUs this process
// may use.
func benchPinning(list string) (benchCPUs, error) {
	if strings.TrimSpace(list) == "" {
		return benchCPUs{}, nil
	}
	own, err := parseCPUList(list)
	if err != nil {
		return benchCPUs{}, err
	}
	allowed, err := allowedCPUs()
	if err != nil {
		return benchCPUs{}, err
	}
	rest, err := splitCPUs(allowed, own)
	if err != nil {
		return benchCPUs{}, err
	}
	return benchCPUs{extender: own, rest: rest}, nil
}

// loadAverage is the machine's 1, 5 and 15 minute load averages (/proc/loadavg), which count
// every process, other sessions' too.
func loadAverage() string {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown (" + err.Error() + ")"
	}
	f := strings.Fields(string(data))
	if len(f) < 3 {
		return "unknown (" + string(data) + ")"
	}
	return strings.Join(f[:3], " ")
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// benchGPUMemory is each GPU's memory in the benchmark's inventories; shares ask for the same
// percentage of it as of compute, so memory never binds before compute (the trace has no GPU memory).
const benchGPUMemory = 16 << 30

// liveResult is one live replay: the unallocated GPU % at each checkpoint, the GPU load arrived
// and allocated at its end (percent of capacity), pods/s, and how many arrivals it replayed.
type liveResult struct {
	unallocated              []float64
	arrivedPct, allocatedPct float64
	podsPerSec               float64
	replayed                 int
}

// replayLive runs one policy over the seed's arrivals (the first stopAfter of them when > 0) and
// prints where the time went (CPU per process, the extender's and the scheduler's latencies, each
// pod's time to bound).
func replayLive(b *testing.B, c *simulate.Cluster, policy string, seed uint64, stopAfter int, pin benchCPUs) liveResult {
	fmt.Printf("policy=%s load average before: %s\n", policy, loadAverage())
	opts := ControlPlaneOptions{SchedulerMaxBackoff: time.Second, CPUs: pin.rest}
	mode, isDRA, err := draBenchPolicy(policy)
	if err != nil {
		b.Fatal(err)
	}
	extenderPolicy := policy
	var addr string
	if isDRA {
		opts.ControllerManager = true // claims from the pods' ResourceClaimTemplates
		extenderPolicy = mode.extenderPolicy
	}
	switch {
	case isDRA && extenderPolicy == "" && mode.scoring != "":
		opts.SchedulerExtraConfig = benchSchedulerConfig(`
      scoringStrategy:
        type: ` + mode.scoring + `
        resources:
        - {name: cpu, weight: 1}
        - {name: memory, weight: 1}`)
	case isDRA && extenderPolicy == "":
		opts.SchedulerExtraConfig = benchSchedulerConfig("") // the default scoring: LeastAllocated over CPU and memory
	case policy == policyKubeScheduler:
		opts.SchedulerExtraConfig = benchSchedulerConfig(`
      scoringStrategy:
        type: MostAllocated
        resources:
        - {name: cpu, weight: 1}
        - {name: memory, weight: 1}
        - {name: nvidia.com/gpu, weight: 1}
        - {name: tessera.dev/vgpu, weight: 1}`)
	default:
		addr = fmt.Sprintf("127.0.0.1:%d", freePort(b))
		opts.Extender = chartExtender(b, "http://"+addr)
		// Every pod goes to the extender (no managedResources): CPU-only pods shape the GPU nodes too.
		opts.Extender.ManagedResources = []ManagedResource{}
		opts.SchedulerExtraConfig = benchSchedulerConfig("")
	}
	cp := StartControlPlane(b, opts)
	rc := *cp.RESTConfig
	rc.QPS, rc.Burst = 2000, 4000
	client := kubernetes.NewForConfigOrDie(&rc)
	var x *Process
	if addr != "" {
		args := []string{"--kubeconfig", cp.Kubeconfig, "--listen", addr, "--policy", extenderPolicy, "--leader-elect=false", "--filter-pick-one=true",
			"--kube-api-qps=1000", "--scheduler-names=default-scheduler"}
		if isDRA {
			args = append(args, "--dra-claims")
		}
		x = &Process{Name: "tessera-extender", Bin: tesseraBinary(b, "tessera-extender"), Args: args, CPUs: pin.extender,
			Env: strings.Fields(os.Getenv("TESSERA_BENCH_EXTENDER_ENV")), Log: filepath.Join(cp.Dir, "logs", "tessera-extender.log")}
		cp.AddProcess(b, x)
		x.WaitHealthy(b, "http://"+addr+"/healthz", time.Minute)
	}
	if isDRA {
		applyBenchDeviceClasses(b, cp)
	}
	states := createBenchNodes(b, client, c, seed, isDRA)

	// Pod outcomes come from a watch: bound (spec.nodeName) or found unschedulable.
	type outcome struct {
		placed bool
		node   string
		at     time.Time // when the watch saw it
	}
	var mu sync.Mutex
	done := map[string]outcome{}
	cond := sync.NewCond(&mu)
	factory := informers.NewSharedInformerFactory(client, 0)
	inf := factory.Core().V1().Pods().Informer()
	record := func(o any) {
		p, ok := o.(*corev1.Pod)
		if !ok {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if _, seen := done[p.Name]; seen {
			return
		}
		switch {
		case p.Spec.NodeName != "":
			done[p.Name] = outcome{placed: true, node: p.Spec.NodeName, at: time.Now()}
		case unschedulablePod(p):
			done[p.Name] = outcome{at: time.Now()}
		default:
			return
		}
		cond.Broadcast()
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: record, UpdateFunc: func(_, o any) { record(o) }}); err != nil {
		b.Fatal(err)
	}
	stop := make(chan struct{})
	defer close(stop)
	factory.Start(stop)
	factory.WaitForCacheSync(stop)

	arrivals := c.Arrivals(seed, 1.3)
	if stopAfter > 0 && stopAfter < len(arrivals) {
		arrivals = arrivals[:stopAfter]
	}
	if isDRA {
		createDRATemplates(b, client, arrivals)
	}
	request := make([]int, len(arrivals))
	placed := make([]bool, len(arrivals))
	created := make([]time.Time, len(arrivals))
	var toBound []time.Duration
	// A small window of pods in flight keeps the scheduler busy while its queue (FIFO by arrival)
	// keeps the arrival order; Filter's holds make each decision see the ones before it.
	const window = 8
	ctx := context.Background()
	pids := map[string]int{"etcd": cp.Etcd.Pid(), "kube-apiserver": cp.APIServer.Pid(), "kube-scheduler": cp.Scheduler.Pid(),
		"benchmark": os.Getpid()}
	if x != nil {
		pids["tessera-extender"] = x.Pid()
	}
	cpu := newCPUMeter(pids)
	start := time.Now()
	// A pod neither bound nor found unschedulable in a minute (a bind that keeps failing, say) counts
	// as failed; the ticker wakes the waiter to look at the clock.
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	go func() {
		for range tick.C {
			cond.Broadcast()
		}
	}()
	stuck := 0
	resolve := func(i int) {
		name := benchPodName(i)
		deadline := time.Now().Add(time.Minute)
		mu.Lock()
		for {
			if _, ok := done[name]; ok || time.Now().After(deadline) {
				break
			}
			cond.Wait()
		}
		o, ok := done[name]
		mu.Unlock()
		if !ok {
			stuck++
			b.Logf("pod %s (arrival %d) neither bound nor unschedulable after a minute: counted as failed", name, i)
		}
		request[i] = arrivals[i].GPURequest()
		if !o.placed {
			_ = client.CoreV1().Pods(metav1.NamespaceDefault).Delete(ctx, name, metav1.DeleteOptions{})
			return
		}
		placed[i] = true
		toBound = append(toBound, o.at.Sub(created[i]))
		if policy == policyKubeScheduler {
			// No extender: the node agent places locally (best fit); a share the node cannot hold fails.
			n := states[o.node]
			r := arrivals[i].Request()
			if cands, u := placement.Candidates(n, r); u == nil {
				n.Apply(r, &cands[0])
			} else {
				placed[i] = false
			}
		}
	}
	for i := range arrivals {
		if i >= window {
			resolve(i - window)
		}
		created[i] = time.Now()
		pod := benchPod(i, &arrivals[i])
		if isDRA {
			pod = draBenchPod(i, &arrivals[i])
		}
		if _, err := client.CoreV1().Pods(metav1.NamespaceDefault).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			b.Fatalf("create pod %d: %v", i, err)
		}
	}
	for i := max(0, len(arrivals)-window); i < len(arrivals); i++ {
		resolve(i)
	}
	elapsed := time.Since(start)
	fmt.Printf("policy=%s profile: %s\n", policy, cpu.report())
	fmt.Printf("policy=%s load average after: %s; CPUs allowed: %s\n", policy, loadAverage(), cpu.affinity())
	fmt.Printf("policy=%s profile: pod create -> bound seen by the watch (%d in flight): %s\n", policy, window, durationStats(toBound))
	printSchedulingLatency(cp, policy, addr)
	if x != nil {
		// The state-divergence counters (issue 14's live bug): both must stay 0.
		data, _ := os.ReadFile(x.Log)
		fmt.Printf("policy=%s: extender state counted two holders of one GPU %d times; binds refused as no longer fitting: %d\n",
			policy, strings.Count(string(data), "state counts two holders"), strings.Count(string(cp.Scheduler.LogTail(1<<30)), "no longer fits"))
	}
	if stuck > 0 {
		fmt.Printf("policy=%s: %d pods were neither bound nor refused within a minute\n", policy, stuck)
		if x != nil {
			fmt.Println(x.LogTail(30))
		}
		fmt.Println(cp.Scheduler.LogTail(30))
	}
	arrivedPct, allocatedPct := arrivedLoad(c.Capacity, request, placed)
	return liveResult{unallocated: simulate.UnallocatedAt(c.Capacity, request, placed), arrivedPct: arrivedPct, allocatedPct: allocatedPct,
		podsPerSec: float64(len(arrivals)) / elapsed.Seconds(), replayed: len(arrivals)}
}

// printSchedulingLatency prints the extender's request histogram per verb (addr: its API, which
// serves /metrics; empty without an extender) and the scheduler's durations, as scraped at the end
// of a replay (only the replay's pods went through either): the attempt (from the cycle's start to bound: the
// serial scheduling cycle plus the asynchronous binding cycle), the algorithm (filter and score,
// the extender's filter and prioritize included: the serial part that bounds pods/s) and the
// in-tree extension points (plugins only).
func printSchedulingLatency(cp *ControlPlane, policy, addr string) {
	if addr != "" {
		h, err := scrapeHistograms(&http.Client{Timeout: 10 * time.Second}, "http://"+addr+"/metrics", "tessera_extender_request_duration_seconds", "verb")
		if err != nil {
			fmt.Printf("policy=%s profile: extender latency: %v\n", policy, err)
		} else {
			fmt.Printf("policy=%s profile: extender (tessera_extender_request_duration_seconds, HTTP handler time): %s\n", policy, formatHists(h))
		}
		if h, err := scrapeHistograms(&http.Client{Timeout: 10 * time.Second}, "http://"+addr+"/metrics", "tessera_extender_request_phase_seconds", "verb,phase"); err != nil {
			fmt.Printf("policy=%s profile: extender request phases: %v\n", policy, err)
		} else {
			fmt.Printf("policy=%s profile: extender call phases by verb (tessera_extender_request_phase_seconds; read: waiting for kube-scheduler to send the body): %s\n", policy, formatHists(h))
		}
		if rt, err := scrapeGoRuntime(&http.Client{Timeout: 10 * time.Second}, "http://"+addr+"/metrics"); err != nil {
			fmt.Printf("policy=%s profile: extender Go runtime: %v\n", policy, err)
		} else {
			fmt.Printf("policy=%s profile: extender Go runtime (whole process life): %s\n", policy, rt)
		}
		if evals, err := scrapeEvaluations(&http.Client{Timeout: 10 * time.Second}, "http://"+addr+"/metrics"); err != nil {
			fmt.Printf("policy=%s profile: extender evaluations: %v\n", policy, err)
		} else {
			fmt.Printf("policy=%s profile: extender node outcomes (tessera_extender_node_evaluations_total): %s\n", policy, evals)
		}
	}
	hc, err := schedulerMetricsClient(cp)
	if err != nil {
		fmt.Printf("policy=%s profile: %v\n", policy, err)
		return
	}
	url := fmt.Sprintf("https://127.0.0.1:%d/metrics", cp.schedulerPort)
	for _, m := range []struct{ name, by string }{
		{"scheduler_scheduling_attempt_duration_seconds", "result"},
		{"scheduler_scheduling_algorithm_duration_seconds", ""},
		{"scheduler_framework_extension_point_duration_seconds", "extension_point"},
	} {
		h, err := scrapeHistograms(hc, url, m.name, m.by)
		if err != nil {
			fmt.Printf("policy=%s profile: %v\n", policy, err)
			continue
		}
		fmt.Printf("policy=%s profile: kube-scheduler %s: %s\n", policy, m.name, formatHists(h))
	}
}

// benchSchedulerConfig is the scheduler configuration's tail: every feasible node scored, and the
// per-share caps (which nodes do not advertise) left out of the scheduler's own fit check, as the
// chart's managedResources do; extra goes under NodeResourcesFit's args.
func benchSchedulerConfig(extra string) string {
	return `percentageOfNodesToScore: 100
profiles:
- schedulerName: default-scheduler
  pluginConfig:
  - name: NodeResourcesFit
    args:
      ignoredResources: [tessera.dev/vgpu-cores, tessera.dev/vgpu-memory-percent, tessera.dev/vgpu-memory]` + extra + "\n"
}

func unschedulablePod(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
			return true
		}
	}
	return false
}

func benchPodName(i int) string { return fmt.Sprintf("p%06d", i) }

// benchPod is a trace pod as a Pod: CPU and memory requests, whole GPUs or one share with the
// trace's compute (and as much of the GPU's memory in percent), and the GPU model restriction as
// the annotation the extender reads and a node affinity the kube-scheduler alone honours.
func benchPod(i int, p *simulate.Pod) *corev1.Pod {
	req := corev1.ResourceList{
		corev1.ResourceCPU:    *resource.NewMilliQuantity(p.CPUMilli, resource.DecimalSI),
		corev1.ResourceMemory: *resource.NewQuantity(p.MemMiB<<20, resource.BinarySI),
	}
	lim := corev1.ResourceList{}
	q := func(v int64) resource.Quantity { return *resource.NewQuantity(v, resource.DecimalSI) }
	switch {
	case p.NumGPU == 0 || p.GPUMilli == 0:
	case p.GPUMilli < placement.MilliPerGPU:
		lim[api.ResourceShare] = q(1)
		lim[api.ResourceShareCores] = q(int64(p.GPUMilli / 10))
		lim[api.ResourceShareMemoryPercent] = q(int64(p.GPUMilli / 10))
	default:
		lim[api.ResourceGPU] = q(int64(p.NumGPU))
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: benchPodName(i), Namespace: metav1.NamespaceDefault, Annotations: map[string]string{}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "main", Image: "none",
			Resources: corev1.ResourceRequirements{Requests: req, Limits: lim}}}},
	}
	for k, v := range lim { // extended resources: requests equal limits
		pod.Spec.Containers[0].Resources.Requests[k] = v
	}
	if len(p.Models) > 0 {
		pod.Annotations[api.AnnotationGPUModel] = strings.Join(p.Models, "|")
		pod.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
			NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{
				Key: api.LabelGPUModel, Operator: corev1.NodeSelectorOpIn, Values: p.Models}}}}}}}
	}
	return pod
}

// createBenchNodes makes the trace's nodes through the API (Ready, untainted, allocatable from the
// trace, the inventory annotation) and returns an empty placement state per node name (for the
// kube-scheduler-alone run's local placement).
// With withDRA the nodes publish ResourceSlices too (createDRASlices).
func createBenchNodes(b *testing.B, client kubernetes.Interface, c *simulate.Cluster, seed uint64, withDRA bool) map[string]*placement.NodeState {
	order := c.NodeOrder(seed)
	states := map[string]*placement.NodeState{}
	var mu sync.Mutex
	work := make(chan int)
	errs := make(chan error, len(order))
	var wg sync.WaitGroup
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for pos := range work {
				n := c.Nodes[order[pos]]
				name := benchNodeName(pos, len(order), n.Name)
				ns, err := createBenchNode(client, name, pos, n, withDRA)
				if err != nil {
					errs <- err
					continue
				}
				mu.Lock()
				states[name] = ns
				mu.Unlock()
			}
		}()
	}
	for pos := range order {
		work <- pos
	}
	close(work)
	wg.Wait()
	close(errs)
	for err := range errs {
		b.Fatal(err)
	}
	// Wait until the scheduler can see them all: a pod that arrives first must not find a partial cluster.
	ctx := context.Background()
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		l, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{ResourceVersion: "0"})
		return err == nil && len(l.Items) == len(order), nil
	})
	if err != nil {
		b.Fatalf("nodes not listed: %v", err)
	}
	time.Sleep(2 * time.Second) // informers of the scheduler and the extender catch up
	return states
}

func createBenchNode(client kubernetes.Interface, name string, pos int, n simulate.Node, withDRA bool) (*placement.NodeState, error) {
	inv := &api.NodeInventory{APIVersion: api.Version, Node: name, DriverVersion: "sim", SharesPerGPU: 100}
	memory := int64(benchGPUMemory)
	if withDRA {
		memory = draBenchGPUMemory
	}
	for i := 0; i < n.GPUs; i++ {
		inv.GPUs = append(inv.GPUs, api.GPU{UUID: fmt.Sprintf("GPU-%08x-0000-4000-8000-%012x", pos, i), Index: i, Model: n.Model, MemoryBytes: memory,
			SMCount: 80, NUMANode: 0, PCIBusID: fmt.Sprintf("0000:%02x:00.0", i+1), Minor: i, Healthy: true})
	}
	data, err := api.EncodeInventory(inv)
	if err != nil {
		return nil, fmt.Errorf("node %s inventory: %w", name, err)
	}
	ctx := context.Background()
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name,
		Labels:      map[string]string{"kubernetes.io/hostname": name, api.LabelGPUModel: n.Model},
		Annotations: map[string]string{api.AnnotationInventory: string(data)}}}
	if _, err := client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		return nil, fmt.Errorf("create node %s: %w", name, err)
	}
	res := corev1.ResourceList{
		corev1.ResourceCPU:    *resource.NewMilliQuantity(n.CPUMilli, resource.DecimalSI),
		corev1.ResourceMemory: *resource.NewQuantity(n.MemMiB<<20, resource.BinarySI),
		corev1.ResourcePods:   resource.MustParse("1000"),
		api.ResourceGPU:       *resource.NewQuantity(int64(n.GPUs), resource.DecimalSI),
		api.ResourceShare:     *resource.NewQuantity(int64(n.GPUs*100), resource.DecimalSI),
	}
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if len(cur.Spec.Taints) > 0 {
			cur.Spec.Taints = nil
			if cur, err = client.CoreV1().Nodes().Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
				return err
			}
		}
		now := metav1.Now()
		cur.Status.Capacity, cur.Status.Allocatable = res, res
		cur.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue,
			Reason: "KubeletReady", Message: "API-only node of the placement benchmark", LastHeartbeatTime: now, LastTransitionTime: now}}
		_, err = client.CoreV1().Nodes().UpdateStatus(ctx, cur, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("node %s status: %w", name, err)
	}
	if withDRA {
		if err := createDRASlices(client, inv); err != nil {
			return nil, err
		}
	}
	ns := placement.NewNodeState(inv, nil)
	ns.CPUMilli, ns.MemMiB = n.CPUMilli, n.MemMiB
	return ns, nil
}
