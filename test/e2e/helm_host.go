package e2e

// The chart's install on a cluster of this harness (TestHelmInstall, TestHelmUpgrade, the
// multi-node cluster): in a non-test file because the multi-node harness (multinode.go) uses it.

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	sigyaml "sigs.k8s.io/yaml"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// chartNamespace is the release namespace the chart's extender objects are rendered for.
const chartNamespace = "tessera-system"

// The chart's pods by component (its app.kubernetes.io/name label).
const (
	chartAgentSelector    = "app.kubernetes.io/name=tessera-node"
	chartExtenderSelector = "app.kubernetes.io/name=tessera-extender"
)

// helmHost is the node's side of the install: the private host paths and ports the values name.
type helmHost struct {
	c                          *Cluster
	dataDir, runDir, libDir    string
	agentAddr, extenderAddr    string
	agentMetrics, extenderPort int
	extenderMetrics            int
	set                        map[string]string // the chart values (--set), by key
	chart                      string            // the chart directory installed (helmChart() unless a test names another)
	tlsDir                     string            // the scheduler's client certificate, CA and key (scheduler.tls.dir)
	cdiDir                     string
}

func newHelmHost(t *testing.T, c *Cluster) *helmHost {
	t.Helper()
	h := &helmHost{c: c, dataDir: filepath.Join(c.Dir, "tessera-data"), runDir: filepath.Join(c.Dir, "tessera-run"),
		libDir: filepath.Join(c.Dir, "tessera-lib"), cdiDir: c.Ctr.CDIDir, tlsDir: filepath.Join(c.Dir, "scheduler-tls"),
		agentMetrics: freePort(t), extenderPort: freePort(t), extenderMetrics: freePort(t)}
	// The agent mounts each container's region (a tmpfs) under the run dir, and the mount must
	// reach the host: a Bidirectional volume, which containerd allows only on a shared mount (as
	// /run is on systemd hosts). containerd's teardown unmounts everything under c.Dir.
	if err := os.MkdirAll(h.runDir, 0o755); err != nil {
		t.Fatal(err)
	}
	mustRun(t, time.Minute, "mount", "-t", "tmpfs", "-o", "size=64m,mode=0755", "tessera-run", h.runDir)
	mustRun(t, time.Minute, "mount", "--make-shared", h.runDir)
	h.agentAddr = fmt.Sprintf("127.0.0.1:%d", h.agentMetrics)
	h.extenderAddr = fmt.Sprintf("127.0.0.1:%d", h.extenderPort)
	c.AgentAddr, c.AgentDataDir = h.agentAddr, h.dataDir
	apiPort, err := urlPort(c.CP.APIServerURL)
	if err != nil {
		t.Fatal(err)
	}
	set := map[string]string{
		"image.node.tag": "e2e", "image.extender.tag": "e2e", "image.pullPolicy": "Never",
		"apiServer.host": "127.0.0.1", "apiServer.port": apiPort,
		"node.backend": "sim", "node.hostNetwork": "true", "node.listenHost": "127.0.0.1",
		"node.metricsPort": strconv.Itoa(h.agentMetrics),
		"node.cdiDir":      c.Ctr.CDIDir, "node.nriSocket": c.Ctr.NRISocket,
		"node.podResourcesDir": filepath.Dir(c.Kubelet.PodResourcesSocket),
		"node.dataDir":         h.dataDir, "node.runDir": h.runDir, "node.libDir": h.libDir,
		"extender.hostNetwork": "true", "extender.listenHost": "127.0.0.1",
		"extender.port": strconv.Itoa(h.extenderPort), "extender.metricsPort": strconv.Itoa(h.extenderMetrics),
		"scheduler.mode": "default", "scheduler.extenderURL": "https://" + h.extenderAddr, "scheduler.tls.dir": h.tlsDir,
		"extender.networkPolicy.extraFrom[0].ipBlock.cidr": "127.0.0.1/32",
	}
	h.set, h.chart = set, helmChart()
	return h
}

// values are the --set flags of h.set, in key order.
func (h *helmHost) values() []string {
	var out []string
	for _, k := range slices.Sorted(maps.Keys(h.set)) {
		out = append(out, "--set", k+"="+h.set[k])
	}
	return out
}

// run runs helm against the cluster in namespace ns, with the values unless it uninstalls;
// flags in args come before the values, so h.set wins over them.
func (h *helmHost) run(t *testing.T, ns string, args ...string) string {
	t.Helper()
	args = append(args, "--kubeconfig", h.c.Kubeconfig, "--namespace", ns)
	if args[0] != "uninstall" {
		args = append(args, h.values()...)
	}
	out, err := helm(t, args...)
	if err != nil {
		t.Fatalf("helm %s: %v\n%s\n%s", args[0], err, out, h.diagnose(t, ns))
	}
	return out
}

// checkAgentWrites: the agent's writes pass the chart's policies with the token the kubelet projects
// into its pod (TestSecurityLeastPrivilege refuses everything else): its Node's holdings annotation
// lists the running pods, and its node's ResourceSlices are published.
func (h *helmHost) checkAgentWrites(t *testing.T, c *Cluster, ns string, pods []*corev1.Pod) {
	t.Helper()
	ctx := context.Background()
	err := waitFor(time.Minute, 300*time.Millisecond, func() (bool, error) {
		node, err := c.CP.Client.CoreV1().Nodes().Get(ctx, c.Node, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		held, err := api.DecodeHoldings([]byte(node.Annotations[api.AnnotationHoldings]))
		if err != nil {
			return false, fmt.Errorf("holdings annotation: %w", err)
		}
		for _, p := range pods {
			if !slices.ContainsFunc(held.Pods, func(h api.PodHolding) bool { return h.UID == string(p.UID) }) {
				return false, fmt.Errorf("pod %s not in the Node's holdings", p.Name)
			}
		}
		l, err := c.CP.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: resourceapi.ResourceSliceSelectorNodeName + "=" + c.Node})
		if err != nil {
			return false, err
		}
		if len(l.Items) == 0 {
			return false, fmt.Errorf("no ResourceSlices of node %s", c.Node)
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("the agent's own writes did not land: %v\n%s", err, h.diagnose(t, ns))
	}
}

func urlPort(u string) (string, error) {
	i := strings.LastIndex(u, ":")
	if i < 0 {
		return "", fmt.Errorf("no port in %s", u)
	}
	return u[i+1:], nil
}

// buildImages runs `make images` (the same build operators run) with the tag the test installs,
// into a build directory of its own; Go's build cache makes repeated runs quick. The directory is
// shared by every test process on the machine, and `make test` runs two at once (test/tools/gotest.sh:
// TestMultiNode beside TestHelmInstall), and make rewrites the tars on every run: an exclusive
// flock on the directory serialises the builds, and each caller imports copies of the tars taken
// under the lock, which the other's build cannot tear.
func buildImages(t testing.TB) []string {
	t.Helper()
	bin := filepath.Join(os.TempDir(), "tessera-e2e-images")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	lock, err := os.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close() // closing the last descriptor releases the lock
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatalf("lock %s: %v", bin, err)
	}
	cache := filepath.Dir(toolsDir())
	out, err := runCmd(t, 8*time.Minute, "make", "-C", repoRoot(), "images", "BIN="+bin, "CACHE="+cache, "IMAGE_TAG=e2e")
	if err != nil {
		t.Fatalf("make images: %v\n%s", err, out)
	}
	var tars []string
	for _, name := range []string{"tessera-node.tar", "tessera-extender.tar"} {
		dst := filepath.Join(t.TempDir(), name)
		if out, err := runCmd(t, time.Minute, "cp", filepath.Join(bin, "images", name), dst); err != nil {
			t.Fatalf("copy %s: %v\n%s", name, err, out)
		}
		tars = append(tars, dst)
	}
	return tars
}

// waitAgent waits until the agent pod's /healthz is ok and the node offers every GPU and share.
func (h *helmHost) waitAgent(t *testing.T, c *Cluster) {
	t.Helper()
	err := waitFor(90*time.Second, 200*time.Millisecond, func() (bool, error) {
		if !c.AgentHealthy() {
			return false, fmt.Errorf("tessera-node /healthz at %s not ok", h.agentAddr)
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("%v\n%s", err, h.diagnose(t, "tessera-system"))
	}
}

// waitAllocatable waits until the Node's allocatable whole GPUs and shares are want.
func (h *helmHost) waitAllocatable(t *testing.T, c *Cluster, want map[string]int64) {
	t.Helper()
	var got map[string]int64
	err := waitFor(60*time.Second, 200*time.Millisecond, func() (bool, error) {
		got = c.Allocatable(t)
		for r, n := range want {
			if got[r] != n {
				return false, fmt.Errorf("allocatable %s = %d, want %d", r, got[r], n)
			}
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("node %s after the upgrade: %v\n%s", c.Node, err, h.diagnose(t, "tessera-system"))
	}
}

// checkGPULabels: the agent's GPU labels, published with its inventory, passed the chart's
// -node-restriction policy on a real API server: one per model present, GFD's set under tessera.dev/.
func checkGPULabels(t *testing.T, c *Cluster) {
	t.Helper()
	n, err := c.CP.Client.CoreV1().Nodes().Get(context.Background(), c.Node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	models := map[string]int{}
	for _, g := range c.Inventory.GPUs {
		models[api.GPUModelLabelValue(g.Model)]++
	}
	want := map[string]string{api.LabelGPUCount: fmt.Sprint(len(c.Inventory.GPUs)), api.LabelMIGCapable: "true", api.LabelCUDAVersion: c.Inventory.CUDAVersion}
	if c.Inventory.CUDAVersion == "" {
		t.Error("the agent's inventory has no CUDA version (the simulated driver reports 13.0)")
	}
	for m, k := range models {
		want[api.LabelPrefixModelCount+m] = fmt.Sprint(k)
		if len(models) == 1 {
			want[api.LabelGPUModel] = m
		}
	}
	for k, v := range want {
		if n.Labels[k] != v {
			t.Errorf("node label %s = %q, want %q (labels %v)", k, n.Labels[k], v, n.Labels)
		}
	}
}

// inventory reads what the agent published on the Node.
func (h *helmHost) inventory(t *testing.T, c *Cluster) *api.NodeInventory {
	t.Helper()
	n, err := c.CP.Client.CoreV1().Nodes().Get(context.Background(), c.Node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	inv, err := api.DecodeInventory([]byte(n.Annotations[api.AnnotationInventory]))
	if err != nil {
		t.Fatalf("the agent published no inventory: %v", err)
	}
	return inv
}

// startScheduler runs kube-scheduler on the host with the KubeSchedulerConfiguration the chart
// ships (its ConfigMap, rendered with the install's values), adding only what a host process
// needs: the kubeconfig and no leader election (one scheduler). It returns the chart's config.
func (h *helmHost) startScheduler(t *testing.T, c *Cluster, ns, release string) string {
	t.Helper()
	out, err := helm(t, append([]string{"template", release, h.chart, "--namespace", ns, "--show-only", "templates/scheduler.yaml"}, h.values()...)...)
	if err != nil {
		t.Fatalf("helm template the scheduler configuration: %v\n%s", err, out)
	}
	var cm corev1.ConfigMap
	if err := sigyaml.Unmarshal([]byte(strings.Split(out, "\n---")[0]), &cm); err != nil || cm.Kind != "ConfigMap" {
		t.Fatalf("the chart's scheduler ConfigMap: %v\n%s", err, out)
	}
	var cfg map[string]any
	if err := sigyaml.Unmarshal([]byte(cm.Data["config.yaml"]), &cfg); err != nil {
		t.Fatalf("the chart's KubeSchedulerConfiguration: %v\n%s", err, cm.Data["config.yaml"])
	}
	if !strings.Contains(cm.Data["config.yaml"], "urlPrefix: https://"+h.extenderAddr) || !strings.Contains(cm.Data["config.yaml"], "enableHTTPS: true") {
		t.Fatalf("the chart's scheduler configuration does not call the extender at scheduler.extenderURL:\n%s", cm.Data["config.yaml"])
	}
	kc := c.CP.MintKubeconfig(t, "scheduler", CertSpec{CommonName: "system:kube-scheduler"})
	cfg["clientConnection"] = map[string]any{"kubeconfig": kc}
	cfg["leaderElection"] = map[string]any{"leaderElect": false}
	raw, err := sigyaml.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(c.CP.Dir, "scheduler-config.yaml")
	if err := os.WriteFile(path, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	c.CP.Scheduler = c.CP.StartProcess(t, "kube-scheduler", tool(t, "kube-scheduler"), "--config="+path,
		"--authentication-kubeconfig="+kc, "--authorization-kubeconfig="+kc,
		"--bind-address=127.0.0.1", "--secure-port="+strconv.Itoa(port), "-v=2")
	c.CP.waitHealthz(t, c.CP.Scheduler, port, "/readyz")
	return cm.Data["config.yaml"]
}

// agentPod returns the name of the agent's pod (the DaemonSet's one pod on the node).
func (h *helmHost) agentPod(t *testing.T, c *Cluster, ns string) string {
	t.Helper()
	l, err := c.CP.Client.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{LabelSelector: chartAgentSelector})
	if err != nil || len(l.Items) != 1 {
		t.Fatalf("want one tessera-node pod: %v %d\n%s", err, len(l.Items), h.diagnose(t, ns))
	}
	return l.Items[0].Name
}

// waitNewAgent waits until the agent pod that runs is not old (the DaemonSet rolled it).
func (h *helmHost) waitNewAgent(t *testing.T, c *Cluster, ns, old string) {
	t.Helper()
	err := waitFor(90*time.Second, 200*time.Millisecond, func() (bool, error) {
		l, err := c.CP.Client.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{LabelSelector: chartAgentSelector})
		if err != nil {
			return false, err
		}
		for _, p := range l.Items {
			if p.Name == old {
				return false, fmt.Errorf("the old agent pod %s is still there", old)
			}
			if p.Status.Phase == corev1.PodRunning {
				return true, nil
			}
		}
		return false, fmt.Errorf("no new agent pod running")
	})
	if err != nil {
		t.Fatalf("helm upgrade did not replace the agent pod: %v\n%s", err, h.diagnose(t, ns))
	}
}

// waitNoAgent waits until the agent's pod is gone (it has finished its cleanup then).
func (h *helmHost) waitNoAgent(t *testing.T, c *Cluster, ns string) {
	t.Helper()
	err := waitFor(90*time.Second, 200*time.Millisecond, func() (bool, error) {
		l, err := c.CP.Client.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		if len(l.Items) > 0 {
			return false, fmt.Errorf("%d pods left in %s (first %s)", len(l.Items), ns, l.Items[0].Name)
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("after helm uninstall: %v\n%s", err, h.diagnose(t, ns))
	}
}

// leftovers lists what Tessera left on the node: CDI specs, device-plugin sockets, files in its
// data, run and lib dirs (the folders themselves were the pods' hostPath volumes: the kubelet
// made them, and the agent cannot remove a folder mounted into its own pod).
func (h *helmHost) leftovers(t *testing.T, c *Cluster) []string {
	t.Helper()
	var left []string
	globs := []string{filepath.Join(h.cdiDir, "*"), filepath.Join(KubeletDevicePluginDir, "tessera*")}
	for _, d := range []string{h.dataDir, h.runDir, h.libDir} {
		globs = append(globs, filepath.Join(d, "*"), filepath.Join(d, ".*"))
	}
	for _, g := range globs {
		m, _ := filepath.Glob(g)
		left = append(left, m...)
	}
	for _, m := range mountsUnder(h.runDir) {
		left = append(left, "mount "+m)
	}
	return left
}

// extenderReplica is one extender pod as its own metrics port shows it.
type extenderReplica struct {
	pod, url string
	leader   bool
	binds    map[string]int
	filters  int
}

// extenderReplicas reads each extender pod's metrics through its peer port, found in its log.
func (h *helmHost) extenderReplicas(t *testing.T, c *Cluster, ns string) []extenderReplica {
	t.Helper()
	l, err := c.CP.Client.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{LabelSelector: chartExtenderSelector})
	if err != nil {
		t.Fatal(err)
	}
	var out []extenderReplica
	advertise := regexp.MustCompile(`advertise"?[=:]"?(https://[0-9.:]+)`)
	client := h.tlsClient(t, true)
	for _, p := range l.Items {
		logs, _ := c.Kubectl(t, "-n", ns, "logs", p.Name)
		m := advertise.FindStringSubmatch(logs)
		if m == nil {
			t.Fatalf("extender %s logged no advertised URL:\n%s", p.Name, logs)
		}
		r := extenderReplica{pod: p.Name, url: m[1], binds: map[string]int{}}
		resp, err := client.Get(r.url + "/metrics")
		if err != nil {
			t.Fatalf("extender %s metrics at %s: %v", p.Name, r.url, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for _, line := range strings.Split(string(body), "\n") {
			var verb, result string
			var n int
			if k, err := fmt.Sscanf(line, `tessera_extender_request_duration_seconds_count{result=%q,verb=%q} %d`, &result, &verb, &n); err == nil && k == 3 {
				if verb == "bind" {
					r.binds[result] += n
				} else if verb == "filter" {
					r.filters += n
				}
			}
			if line == "tessera_extender_leader 1" {
				r.leader = true
			}
		}
		out = append(out, r)
	}
	return out
}

// bindsOnBoth reports whether each extender replica has answered a bind.
func (h *helmHost) bindsOnBoth(t *testing.T, c *Cluster, ns string) bool {
	t.Helper()
	rs := h.extenderReplicas(t, c, ns)
	for _, r := range rs {
		if r.binds["ok"]+r.binds["error"] == 0 {
			return false
		}
	}
	return len(rs) == 2
}

// diagnose summarises the release's pods, their events and logs, for failure messages.
func (h *helmHost) diagnose(t *testing.T, ns string) string {
	t.Helper()
	var b strings.Builder
	out, _ := h.c.Kubectl(t, "-n", ns, "get", "pods,daemonsets,deployments", "-o", "wide")
	fmt.Fprintf(&b, "--- kubectl -n %s get pods,daemonsets,deployments\n%s\n", ns, out)
	out, _ = h.c.Kubectl(t, "-n", ns, "get", "events", "--sort-by=.lastTimestamp")
	fmt.Fprintf(&b, "--- events\n%s\n", tail(out, 30))
	l, err := h.c.CP.Client.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{})
	if err == nil {
		for _, p := range l.Items {
			out, _ := h.c.Kubectl(t, "-n", ns, "logs", p.Name, "--all-containers", "--tail=25")
			fmt.Fprintf(&b, "--- logs of %s\n%s\n", p.Name, out)
		}
	}
	return b.String()
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// preloadTLS creates the chart's generated TLS Secrets (helm template of templates/extender-tls.yaml
// with the install's values) as the release's own, and writes the scheduler's client certificate,
// key and CA into scheduler.tls.dir for the host kube-scheduler.
func (h *helmHost) preloadTLS(t *testing.T, c *Cluster, ns, release string) {
	t.Helper()
	out, err := helm(t, append([]string{"template", release, h.chart, "--namespace", ns, "--show-only", "templates/extender-tls.yaml"}, h.values()...)...)
	if err != nil {
		t.Fatalf("helm template the TLS Secrets: %v\n%s", err, out)
	}
	if err := os.MkdirAll(h.tlsDir, 0o700); err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, doc := range strings.Split(out, "\n---") {
		var s corev1.Secret
		if err := sigyaml.Unmarshal([]byte(doc), &s); err != nil || s.Kind != "Secret" {
			continue
		}
		// Helm adopts an object with its release's ownership metadata.
		s.Annotations = map[string]string{"meta.helm.sh/release-name": release, "meta.helm.sh/release-namespace": ns}
		if _, err := c.CP.Client.CoreV1().Secrets(ns).Create(context.Background(), &s, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create Secret %s: %v", s.Name, err)
		}
		if s.Name == release+"-scheduler-tls" {
			for _, k := range []string{"tls.crt", "tls.key", "ca.crt"} {
				if err := os.WriteFile(filepath.Join(h.tlsDir, k), s.Data[k], 0o600); err != nil {
					t.Fatal(err)
				}
			}
		}
		n++
	}
	if n != 2 {
		t.Fatalf("the chart rendered %d TLS Secrets, want 2:\n%s", n, out)
	}
}

// tlsClient is an HTTPS client trusting the chart's CA, presenting the scheduler's client
// certificate when withCert.
func (h *helmHost) tlsClient(t *testing.T, withCert bool) *http.Client {
	t.Helper()
	ca, err := os.ReadFile(filepath.Join(h.tlsDir, "ca.crt"))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca)
	cfg := &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	if withCert {
		pair, err := tls.LoadX509KeyPair(filepath.Join(h.tlsDir, "tls.crt"), filepath.Join(h.tlsDir, "tls.key"))
		if err != nil {
			t.Fatal(err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: cfg}}
}

// checkTLSRefusals: the extender API (the shared port and each replica's peer port) refuses a
// caller without a client certificate, and answers nothing in plain HTTP.
func (h *helmHost) checkTLSRefusals(t *testing.T, replicas []extenderReplica) {
	t.Helper()
	urls := []string{"https://" + h.extenderAddr}
	for _, r := range replicas {
		urls = append(urls, r.url)
	}
	anonymous := h.tlsClient(t, false)
	for _, u := range urls {
		if resp, err := anonymous.Post(u+"/bind", "application/json", strings.NewReader(`{"podName":"whole","podNamespace":"default","node":"x"}`)); err == nil {
			resp.Body.Close()
			t.Errorf("the extender at %s answered a bind without a client certificate: HTTP %d", u, resp.StatusCode)
		}
		if resp, err := http.Post(strings.Replace(u, "https:", "http:", 1)+"/bind", "application/json", strings.NewReader("{}")); err == nil {
			resp.Body.Close()
			if resp.StatusCode != http.StatusBadRequest {
				t.Errorf("the extender at %s answered plain HTTP with %d, want 400 (client sent HTTP to an HTTPS server)", u, resp.StatusCode)
			}
		}
	}
}

// secretData returns a Secret's tls.crt.
func (h *helmHost) secretData(t *testing.T, c *Cluster, ns, name string) string {
	t.Helper()
	s, err := c.CP.Client.CoreV1().Secrets(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("Secret %s: %v", name, err)
	}
	return string(s.Data["tls.crt"])
}
