// Command kubectl-tessera shows who holds which GPU and why pods wait, installed as a kubectl plugin
// (put it on $PATH; kubectl finds kubectl-<name> binaries):
//
//	kubectl tessera nodes [node...]   GPUs per node: mode, holders (pod/container, whole, share memory and
//	                                  cores, MIG, mdev) and what is free, per GPU
//	kubectl tessera pending [-n ns]   pods asking for GPUs that are not running, with the scheduler's
//	                                  and Tessera's reasons
//
// It reads only the API server: the node agents' inventory annotations, the extender's assignment
// annotations and Events.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/telemetry"
)

const usage = `usage: kubectl tessera <command> [flags]

commands:
  nodes [node...]   GPUs per node: mode, who holds what, what is free
  pending           GPU pods that are not running, and why
  version           the version

flags:
`

func main() {
	err := run(context.Background(), os.Args[1:], os.Stdout, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kubectl-tessera:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kubectl-tessera", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, usage); fs.PrintDefaults() }
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
	kubecontext := fs.String("context", "", "kubeconfig context")
	namespace := fs.String("n", "", "pending: only this namespace (default: all)")
	version := telemetry.AddVersionFlag(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	cmd, rest := "nodes", fs.Args()
	if len(rest) > 0 {
		cmd, rest = rest[0], rest[1:]
		if err := fs.Parse(rest); err != nil { // flags may follow the command
			return err
		}
		rest = fs.Args()
	}
	if *version || cmd == "version" {
		telemetry.PrintVersion(stdout, "kubectl-tessera")
		return nil
	}
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = *kubeconfig
	rc, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{CurrentContext: *kubecontext}).ClientConfig()
	if err != nil {
		return fmt.Errorf("kubeconfig: %w", err)
	}
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	switch cmd {
	case "nodes":
		nodes, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return fmt.Errorf("list nodes: %w", err)
		}
		pods, err := client.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
		if err != nil {
			return fmt.Errorf("list pods: %w", err)
		}
		return writeNodes(stdout, nodes.Items, pods.Items, rest)
	case "pending":
		pods, err := client.CoreV1().Pods(*namespace).List(ctx, metav1.ListOptions{
			FieldSelector: fields.AndSelectors(fields.OneTermNotEqualSelector("status.phase", "Running"),
				fields.OneTermNotEqualSelector("status.phase", "Succeeded")).String()})
		if err != nil {
			return fmt.Errorf("list pods: %w", err)
		}
		events, err := client.CoreV1().Events(*namespace).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.kind=Pod"})
		if err != nil {
			return fmt.Errorf("list events: %w", err)
		}
		return writePending(stdout, pods.Items, events.Items)
	}
	fs.Usage()
	return fmt.Errorf("unknown command %q", cmd)
}

// holder is one container's hold on a GPU.
type holder struct {
	pod, container string
	whole          bool
	memory         int64 // a share's memory cap
	cores          int   // a share's compute cap, percent
	what           string
}

// writeNodes prints, per node with an inventory, each GPU's mode, holders and free capacity.
func writeNodes(w io.Writer, nodes []corev1.Node, pods []corev1.Pod, only []string) error {
	byGPU := map[string][]holder{}    // GPU UUID -> holders
	hardware := map[string][]holder{} // node -> MIG/mdev holders (the kubelet picks the instance)
	for i := range pods {
		p := &pods[i]
		if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		key := p.Namespace + "/" + p.Name
		if raw := p.Annotations[api.AnnotationAssignment]; raw != "" {
			if a, err := api.DecodeAssignment([]byte(raw)); err == nil {
				for _, c := range a.Containers {
					for _, d := range c.Devices {
						h := holder{pod: key, container: c.Name, whole: d.Whole, memory: d.MemoryBytes, cores: d.CoresPercent, what: "whole"}
						if !d.Whole {
							h.what = "share " + gib(d.MemoryBytes)
							if d.CoresPercent > 0 {
								h.what += fmt.Sprintf(" %d%% cores", d.CoresPercent)
							}
						}
						byGPU[d.UUID] = append(byGPU[d.UUID], h)
					}
				}
			}
		}
		if p.Spec.NodeName == "" {
			continue
		}
		for _, c := range p.Spec.Containers {
			for name, q := range c.Resources.Limits {
				n := string(name)
				switch {
				case strings.HasPrefix(n, api.MIGResourcePrefix):
					hardware[p.Spec.NodeName] = append(hardware[p.Spec.NodeName], holder{pod: key, container: c.Name, what: fmt.Sprintf("%s x MIG %s", q.String(), strings.TrimPrefix(n, api.MIGResourcePrefix))})
				case strings.HasPrefix(n, api.MdevResourcePrefix):
					hardware[p.Spec.NodeName] = append(hardware[p.Spec.NodeName], holder{pod: key, container: c.Name, what: fmt.Sprintf("%s x mdev %s", q.String(), strings.TrimPrefix(n, api.MdevResourcePrefix))})
				}
			}
		}
	}
	sort.Slice(nodes, func(i, j int) bool { return nodes[i].Name < nodes[j].Name })
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	shown := 0
	for _, n := range nodes {
		if len(only) > 0 && !slices.Contains(only, n.Name) {
			continue
		}
		raw := n.Annotations[api.AnnotationInventory]
		if raw == "" {
			continue
		}
		inv, err := api.DecodeInventory([]byte(raw))
		if err != nil {
			fmt.Fprintf(tw, "NODE %s\tinventory unreadable: %v\n", n.Name, err)
			continue
		}
		shown++
		fmt.Fprintf(tw, "NODE %s\t%d GPUs, %d shares per GPU\n", n.Name, len(inv.GPUs), inv.SharesPerGPU)
		fmt.Fprintln(tw, "  GPU\tUUID\tMODEL\tMEMORY\tMODE\tFREE\tHELD BY")
		for _, g := range inv.GPUs {
			hs := byGPU[g.UUID]
			mode, free := gpuState(&g, hs, inv.SharesPerGPU)
			if !g.Healthy {
				mode += " (unhealthy)"
			}
			held := "-"
			if len(hs) > 0 {
				var parts []string
				for _, h := range hs {
					parts = append(parts, h.pod+"/"+h.container+" "+h.what)
				}
				held = strings.Join(parts, "; ")
			}
			fmt.Fprintf(tw, "  %d\t%s\t%s\t%s\t%s\t%s\t%s\n", g.Index, g.UUID, g.Model, gib(g.MemoryBytes), mode, free, held)
		}
		for _, h := range hardware[n.Name] {
			fmt.Fprintf(tw, "  -\t\t\t\thardware\t\t%s/%s %s\n", h.pod, h.container, h.what)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if shown == 0 {
		return errors.New("no node carries a Tessera inventory (annotation " + api.AnnotationInventory + "): is the node agent running?")
	}
	return nil
}

// gpuState is a GPU's mode and what is free on it.
func gpuState(g *api.GPU, hs []holder, sharesPerGPU int) (mode, free string) {
	switch {
	case g.MIG != nil:
		return "mig", fmt.Sprintf("%d instances", len(g.MIG.Instances))
	case len(g.Mdev) > 0:
		avail := 0
		for _, t := range g.Mdev {
			avail += t.Available
		}
		return "mdev", fmt.Sprintf("%d mdev", avail)
	case len(hs) == 0:
		return "free", "whole or shares"
	case hs[0].whole:
		return "whole", "-"
	}
	var mem int64
	cores := 0
	for _, h := range hs {
		mem, cores = mem+h.memory, cores+h.cores
	}
	return "shared", fmt.Sprintf("%s, %d%% cores, %d shares", gib(g.MemoryBytes-mem), 100-cores, sharesPerGPU-len(hs))
}

// writePending prints the pods asking for GPUs that are not running, with the scheduler's message
// and the latest Warning Events (the extender's per-node reasons, refusals by the node agent).
func writePending(w io.Writer, pods []corev1.Pod, events []corev1.Event) error {
	reasons := map[string][]corev1.Event{}
	for _, e := range events {
		if e.Type == corev1.EventTypeWarning {
			k := e.InvolvedObject.Namespace + "/" + e.InvolvedObject.Name
			reasons[k] = append(reasons[k], e)
		}
	}
	n := 0
	for _, p := range pods {
		if !asksForGPU(&p) {
			continue
		}
		n++
		key := p.Namespace + "/" + p.Name
		node := p.Spec.NodeName
		if node == "" {
			node = "(not scheduled)"
		}
		fmt.Fprintf(w, "%s\t%s\t%s\n", key, p.Status.Phase, node)
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status != corev1.ConditionTrue && c.Message != "" {
				fmt.Fprintf(w, "  scheduler: %s\n", c.Message)
			}
		}
		evs := reasons[key]
		sort.Slice(evs, func(i, j int) bool { return evs[i].LastTimestamp.Before(&evs[j].LastTimestamp) })
		if len(evs) > 3 {
			evs = evs[len(evs)-3:]
		}
		for _, e := range evs {
			fmt.Fprintf(w, "  %s (%s): %s\n", e.Reason, e.Source.Component, e.Message)
		}
		for _, cs := range p.Status.ContainerStatuses {
			if cs.State.Waiting != nil && cs.State.Waiting.Message != "" {
				fmt.Fprintf(w, "  container %s: %s: %s\n", cs.Name, cs.State.Waiting.Reason, cs.State.Waiting.Message)
			}
		}
	}
	if n == 0 {
		fmt.Fprintln(w, "no GPU pod is waiting")
	}
	return nil
}

func asksForGPU(p *corev1.Pod) bool {
	for _, c := range append(append([]corev1.Container{}, p.Spec.InitContainers...), p.Spec.Containers...) {
		for name := range c.Resources.Limits {
			if api.IsTesseraResource(string(name)) {
				return true
			}
		}
	}
	return false
}

func gib(b int64) string { return resource.NewQuantity(b, resource.BinarySI).String() }
