package e2e

import (
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"syscall"
	"testing"
	"text/tabwriter"
	"time"

	corev1 "k8s.io/api/core/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestDemo is `make demo` (test/demo runs it): it brings up the cluster, applies
// deploy/examples, waits, prints what happened and tears everything down. It runs only with
// TESSERA_DEMO=1. With TESSERA_DEMO_KEEP=1 it leaves the cluster up after the report, writes
// how to reach it to $TESSERA_DEMO_STATE/env and waits for SIGTERM or SIGINT before tearing down.
func TestDemo(t *testing.T) {
	if os.Getenv("TESSERA_DEMO") != "1" {
		t.Skip("the demo runs only with TESSERA_DEMO=1 (make demo, go run ./test/demo)")
	}
	keep := os.Getenv("TESSERA_DEMO_KEEP") == "1"
	out := os.Stdout
	t0 := time.Now()
	say := func(format string, a ...any) { fmt.Fprintf(out, format+"\n", a...) }
	// SIGINT and SIGTERM end the demo through the test's cleanups (which tear the cluster down)
	// instead of killing it mid-way and leaving containerd, mounts and host paths behind.
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	defer signal.Stop(sig)
	interrupted := func() bool {
		select {
		case s := <-sig:
			say("== %s: stopping the demo, tearing down", s)
			return true
		default:
			return false
		}
	}
	say("== bringing up the cluster: containerd 2.2 (NRI + CDI), etcd, kube-apiserver, kube-scheduler + tessera-extender, kubelet v1.37, tessera-node --backend=sim")
	c := StartCluster(t, ClusterOptions{})
	say("   up in %.0fs: node %q, API server %s", time.Since(t0).Seconds(), c.Node, c.CP.APIServerURL)
	inv := c.Inventory
	say("   %s", describeNode(inv))
	say("   node allocatable: %s", allocatable(c.Allocatable(t)))
	if interrupted() {
		return
	}

	say("\n== kubectl apply -f deploy/examples/")
	t1 := time.Now()
	ApplyExamples(t, c)
	pods := map[string]*corev1.Pod{}
	for i, p := range c.WaitRunning(t, 3*time.Minute, examplePods...) {
		pods[examplePods[i]] = p
	}
	pending := c.WaitUnschedulable(t, "too-big")
	say("   %d pods Running and too-big Pending after %.0fs", len(examplePods), time.Since(t1).Seconds())
	if interrupted() {
		return
	}

	say("\n== which pod got which GPU (pod annotation %s, written by tessera-extender at bind)", api.AnnotationAssignment)
	entries := map[string][]string{} // pod -> MIG UUIDs, from tessera-node's ledger
	for _, e := range c.LedgerEntries(t) {
		entries[e.Pod] = append(entries[e.Pod], e.MIG...)
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "   POD\tASKS FOR\tGPU\tCAP")
	for _, name := range examplePods {
		p := pods[name]
		asks := limitsOf(p)
		a := c.Assignment(t, p)
		if a == nil {
			for _, id := range entries[name] {
				fmt.Fprintf(tw, "   %s\t%s\t%s\t%s\n", name, asks, migLabel(inv, id), "whole MIG instance (no assignment: the kubelet hands out the instance itself)")
			}
			continue
		}
		for i, d := range a.Container("main").Devices {
			n := name
			if i > 0 {
				n, asks = "", ""
			}
			g := c.GPU(d.UUID)
			cp := "whole GPU, exclusive"
			if !d.Whole {
				cores := "compute not capped"
				if d.CoresPercent > 0 {
					cores = fmt.Sprintf("%d%% of the SMs", d.CoresPercent)
				}
				cp = fmt.Sprintf("share: %s of %s memory, %s", gibs(d.MemoryBytes), gibs(g.MemoryBytes), cores)
			}
			fmt.Fprintf(tw, "   %s\t%s\tGPU %d %s\t%s\n", n, asks, g.Index, d.UUID, cp)
		}
	}
	fmt.Fprintf(tw, "   %s\t%s\t%s\t%s\n", "too-big", limitsOf(c.Pod(t, "too-big")), "-", "Pending")
	tw.Flush()
	if sa, sb := c.Assignment(t, pods["share-a"]), c.Assignment(t, pods["share-b"]); sa != nil && sb != nil &&
		sa.Container("main").Devices[0].UUID == sb.Container("main").Devices[0].UUID {
		say("   share-a and share-b share GPU %d, each with its own memory and compute cap", c.GPU(sa.Container("main").Devices[0].UUID).Index)
	}

	say("\n== what each container sees (kubectl exec)")
	for _, name := range examplePods {
		sees := c.MustExec(t, name, `echo "device nodes: $(find /dev -name 'nvidia*' -type c | sed 's#^/dev/##' | sort | tr '\n' ' ')"; `+
			`if [ -e /etc/ld.so.preload ]; then echo "/etc/ld.so.preload: $(cat /etc/ld.so.preload)"; else echo "/etc/ld.so.preload: (none)"; fi; `+
			`if [ -e /etc/tessera/vcuda/limits ]; then sed 's#^#limits: #' /etc/tessera/vcuda/limits; else echo "limits: (none)"; fi`)
		say("   %s", name)
		for _, l := range strings.Split(sees, "\n") {
			say("      %s", limitsLine(l))
		}
	}

	say("\n== a real CUDA program in the containers (test/image/cudaprobe.c, linked against libcuda.so.1; in")
	say("   share containers /etc/ld.so.preload loads libvcuda.so first; the driver is the simulated one")
	say("   nvcdi mounted from the simulated driver root)")
	for _, name := range []string{"share-a", "share-b", "whole"} {
		out := c.MustExec(t, name, fmt.Sprintf("cudaprobe info | grep '^device='; cudaprobe fill %d; "+
			"cudaprobe hold 1073741824 6 >/dev/null & sleep 2; nvidia-smi | grep -E 'memory:|pid'; wait", cudaGranule))
		say("   %s", name)
		for _, l := range strings.Split(out, "\n") {
			say("      %s", l)
		}
	}

	say("\n== why too-big is Pending (PodScheduled condition, from tessera-extender's filter)")
	say("   %s", pending)
	// The kubelet reports the device plugins' new health with its next status update.
	c.WaitAllocatable(t, c.ExpectedAllocatable(t))
	say("\n== node allocatable now: %s", allocatable(c.Allocatable(t)))
	say("   (GPUs holding shares are not offered whole; the GPU held whole offers no shares)")

	if _, err := os.Stat(filepath.Join(toolsDir(), "bin", "helm")); err == nil {
		res, n := HelmDryRun(t, c.Kubeconfig)
		say("\n== helm template deploy/helm/tessera | kubectl apply --dry-run=server -f -: %d of %d objects accepted", strings.Count(res, "(server dry run)"), n)
	} else {
		say("\n== helm is not built (bash test/tools/install-helm.sh): skipping the chart's server-side dry run")
	}

	if !keep {
		say("\n== tearing down (demo took %.0fs before teardown)", time.Since(t0).Seconds())
		return
	}
	state := os.Getenv("TESSERA_DEMO_STATE")
	if state == "" {
		state = c.Dir
	}
	kubectl := tool(t, "kubectl")
	env := fmt.Sprintf("export KUBECONFIG=%s\nexport PATH=%s:$PATH\nexport CONTAINER_RUNTIME_ENDPOINT=unix://%s\n# test binary pid %d\n",
		c.Kubeconfig, filepath.Dir(kubectl), c.Ctr.Socket, os.Getpid())
	if err := os.MkdirAll(state, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(state, "env"), []byte(env), 0o644); err != nil {
		t.Fatal(err)
	}
	say("\n== KEEP=1: the cluster stays up")
	say("   source %s   # KUBECONFIG=%s, kubectl from %s", filepath.Join(state, "env"), c.Kubeconfig, filepath.Dir(kubectl))
	say("   kubectl get pods -o wide; kubectl exec share-a -- cat /etc/tessera/vcuda/limits")
	say("   logs: %s/logs (control plane, kubelet, tessera-node, tessera-extender), %s/containerd.log", c.CP.Dir, c.Dir)
	say("   tear down: make demo-down (or kill -TERM %d)", os.Getpid())
	// The demo launcher waits for this file before it returns to the shell.
	if err := os.WriteFile(filepath.Join(state, "ready"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	say("== %s: tearing down", <-sig)
	os.Remove(filepath.Join(state, "env"))
	os.Remove(filepath.Join(state, "ready"))
}

// describeNode summarises the simulated node's GPUs.
func describeNode(inv *api.NodeInventory) string {
	var shareable []string
	var other []string
	model := ""
	for _, g := range inv.GPUs {
		model = g.Model
		switch {
		case g.MIG != nil:
			profiles := map[string]int{}
			for _, m := range g.MIG.Instances {
				profiles[m.Profile]++
			}
			var ps []string
			for p, n := range profiles {
				ps = append(ps, fmt.Sprintf("%d x %s", n, p))
			}
			sort.Strings(ps)
			other = append(other, fmt.Sprintf("GPU %d in MIG mode (%s)", g.Index, strings.Join(ps, ", ")))
		case len(g.Mdev) > 0:
			other = append(other, fmt.Sprintf("GPU %d an mdev parent (%d vGPU types)", g.Index, len(g.Mdev)))
		default:
			shareable = append(shareable, fmt.Sprint(g.Index))
		}
	}
	return fmt.Sprintf("simulated %d x %s: GPUs %s whole or shared (%d shares each); %s", len(inv.GPUs), model,
		strings.Join(shareable, ","), inv.SharesPerGPU, strings.Join(other, "; "))
}

// allocatable prints the GPU resources of a Node's allocatable.
func allocatable(a map[string]int64) string {
	var out []string
	for r, v := range a {
		if strings.HasPrefix(r, "nvidia.com/") || r == api.ResourceShare {
			out = append(out, fmt.Sprintf("%s=%d", r, v))
		}
	}
	sort.Strings(out)
	return strings.Join(out, " ")
}

// limitsOf prints a pod's GPU limits compactly.
func limitsOf(p *corev1.Pod) string {
	var out []string
	for _, c := range p.Spec.Containers {
		for r, q := range c.Resources.Limits {
			if strings.Contains(string(r), "gpu") || strings.Contains(string(r), "mig") {
				out = append(out, fmt.Sprintf("%s=%s", strings.TrimPrefix(strings.TrimPrefix(string(r), "tessera.dev/"), "nvidia.com/"), q.String()))
			}
		}
	}
	sort.Strings(out)
	return strings.Join(out, " ")
}

// migLabel names a MIG instance by profile and parent GPU.
func migLabel(inv *api.NodeInventory, uuid string) string {
	for _, g := range inv.GPUs {
		if g.MIG == nil {
			continue
		}
		for _, m := range g.MIG.Instances {
			if m.UUID == uuid {
				return fmt.Sprintf("GPU %d MIG %s %s", g.Index, m.Profile, uuid)
			}
		}
	}
	return uuid
}

func gibs(b int64) string {
	if b%(1<<30) == 0 {
		return fmt.Sprintf("%d GiB", b>>30)
	}
	return fmt.Sprintf("%.1f GiB", float64(b)/(1<<30))
}

// limitsLine annotates a vcuda limits line ("gpu <uuid> <bytes> <percent>") with GiB.
func limitsLine(l string) string {
	m := regexp.MustCompile(`^limits: gpu (\S+) ([0-9]+) ([0-9]+)$`).FindStringSubmatch(l)
	if m == nil {
		return l
	}
	var b int64
	fmt.Sscan(m[2], &b)
	return fmt.Sprintf("%s   (%s, %s%% compute)", l, gibs(b), m[3])
}
