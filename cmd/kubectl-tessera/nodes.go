package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"

	api "github.com/tessera-gpu/tessera/api/v1"
)

func nodesCommand(o *options) *cobra.Command {
	return &cobra.Command{
		Use:   "nodes [NODE...]",
		Short: "GPUs per node: mode, who holds what (DRA claims and local placements included), what is free",
		Long: `nodes lists, per node with a Tessera inventory, each GPU's mode, its holders and what is free.
Holders are the extender's assignments and the node agent's holdings (annotation ` + api.AnnotationHoldings + `):
DRA claims and pods the agent placed itself hold GPUs too. A node whose holdings are not published
or unreadable shows its GPUs' free capacity as unknown. -o wide adds PCI bus and NUMA node.
Nodes are cluster-wide: -n does not narrow the list.`,
		Example: `  kubectl tessera nodes
  kubectl tessera nodes gpu-node-1 -o wide
  kubectl tessera nodes --context prod -o json`,
		RunE: func(cmd *cobra.Command, names []string) error {
			client, _, err := o.client()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			views, err := loadNodes(ctx, client, names)
			if err != nil {
				return err
			}
			return printNodes(o.out(), o.output, views, len(names) > 0)
		},
	}
}

// podListPerNode is the number of GPU nodes up to which nodes lists each node's pods alone (field
// selector spec.nodeName); above it, one list of the cluster's scheduled pods costs less than a
// request per node.
const podListPerNode = 16

// loadNodes reads the named nodes (all when none), and the live pods on the ones with an inventory.
func loadNodes(ctx context.Context, client kubernetes.Interface, names []string) ([]nodeView, error) {
	var nodes []corev1.Node
	if len(names) == 0 {
		l, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return nil, fmt.Errorf("list nodes: %w", err)
		}
		nodes = l.Items
	}
	for _, name := range names {
		n, err := client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("node %s: %w", name, err)
		}
		nodes = append(nodes, *n)
	}
	slices.SortFunc(nodes, func(a, b corev1.Node) int { return cmp.Compare(a.Name, b.Name) })
	var gpuNodes []string
	for _, n := range nodes {
		if n.Annotations[api.AnnotationInventory] != "" {
			gpuNodes = append(gpuNodes, n.Name)
		}
	}
	live := fields.AndSelectors(fields.OneTermNotEqualSelector("status.phase", string(corev1.PodSucceeded)),
		fields.OneTermNotEqualSelector("status.phase", string(corev1.PodFailed)))
	podsOn := map[string][]corev1.Pod{}
	if len(gpuNodes) > podListPerNode {
		l, err := client.CoreV1().Pods("").List(ctx, metav1.ListOptions{
			FieldSelector: fields.AndSelectors(fields.OneTermNotEqualSelector("spec.nodeName", ""), live).String()})
		if err != nil {
			return nil, fmt.Errorf("list pods: %w", err)
		}
		for _, p := range l.Items {
			podsOn[p.Spec.NodeName] = append(podsOn[p.Spec.NodeName], p)
		}
	} else {
		for _, name := range gpuNodes {
			l, err := client.CoreV1().Pods("").List(ctx, metav1.ListOptions{
				FieldSelector: fields.AndSelectors(fields.OneTermEqualSelector("spec.nodeName", name), live).String()})
			if err != nil {
				return nil, fmt.Errorf("list pods on node %s: %w", name, err)
			}
			podsOn[name] = l.Items
		}
	}
	views := make([]nodeView, 0, len(nodes))
	for i := range nodes {
		views = append(views, viewNode(&nodes[i], podsOn[nodes[i].Name]))
	}
	return views, nil
}

// nodeView is one node as nodes prints it (-o json|yaml print it as is).
type nodeView struct {
	Name string `json:"name"`
	// Problem says why the node's GPUs cannot be shown (no or an unreadable inventory).
	Problem      string `json:"problem,omitempty"`
	SharesPerGPU int    `json:"sharesPerGPU,omitempty"`
	// Holdings says why the agent's holdings are not known ("" when they are): the free capacity
	// of every GPU is then unknown, since a DRA claim or a local placement may hold it.
	Holdings string       `json:"holdingsUnknown,omitempty"`
	GPUs     []gpuView    `json:"gpus,omitempty"`
	Hardware []holderView `json:"hardware,omitempty"`
}

// gpuView is one GPU, its holders and what is free on it.
type gpuView struct {
	Index       int          `json:"index"`
	UUID        string       `json:"uuid"`
	Model       string       `json:"model"`
	MemoryBytes int64        `json:"memoryBytes"`
	PCIBusID    string       `json:"pciBusID"`
	NUMANode    int          `json:"numaNode"`
	Healthy     bool         `json:"healthy"`
	Mode        string       `json:"mode"` // free, whole, shared, conflict, mig, mdev
	Free        string       `json:"free"`
	Holders     []holderView `json:"holders,omitempty"`
}

// holderView is one container's (or DRA claim's) hold on a GPU.
type holderView struct {
	Namespace    string `json:"namespace"`
	Pod          string `json:"pod"`
	Container    string `json:"container"`
	Whole        bool   `json:"whole,omitempty"`
	MemoryBytes  int64  `json:"memoryBytes,omitempty"`
	CoresPercent int    `json:"coresPercent,omitempty"`
	// Source is where the hold was read: assignment (the extender's), local (the agent placed the
	// pod itself), claim (a prepared DRA ResourceClaim), holdings (the agent's ledger alone, e.g. a
	// stopped container's hold), hardware (MIG or mdev limits: the kubelet picks the instance).
	Source string `json:"source"`
	// What is a MIG profile or mdev type with its count, for hardware holds.
	What string `json:"what,omitempty"`
}

func (h holderView) String() string {
	s := h.Namespace + "/" + h.Pod + "/" + h.Container + " "
	switch {
	case h.What != "":
		s += h.What
	case h.Whole:
		s += "whole"
	default:
		s += "share " + gib(h.MemoryBytes)
		if h.CoresPercent > 0 {
			s += fmt.Sprintf(" %d%% cores", h.CoresPercent)
		}
	}
	if h.Source == "local" || h.Source == "claim" {
		s += " (" + map[string]string{"local": "local placement", "claim": "DRA claim"}[h.Source] + ")"
	}
	return s
}

// claimContainer prefixes the container name the agent's ledger gives a prepared DRA claim.
const claimContainer = "resourceclaim/"

// viewNode joins a node's inventory, its agent's holdings and its pods' assignments.
func viewNode(n *corev1.Node, pods []corev1.Pod) nodeView {
	v := nodeView{Name: n.Name}
	raw := n.Annotations[api.AnnotationInventory]
	if raw == "" {
		v.Problem = "no Tessera inventory (annotation " + api.AnnotationInventory + "): is the node agent running there?"
		return v
	}
	inv, err := api.DecodeInventory([]byte(raw))
	if err != nil {
		v.Problem = "inventory unreadable: " + err.Error()
		return v
	}
	v.SharesPerGPU = inv.SharesPerGPU
	byGPU := map[string][]holderView{}
	type key struct{ uid, container, gpu string }
	seen := map[key]bool{}
	for i := range pods {
		p := &pods[i]
		if p.Spec.NodeName != n.Name || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		if raw := p.Annotations[api.AnnotationAssignment]; raw != "" {
			// An unreadable assignment or one for another node holds nothing the agent did not
			// realise; the holdings below show what it did.
			if a, err := api.DecodeAssignment([]byte(raw)); err == nil && a.Node == n.Name {
				for _, c := range a.Containers {
					for _, d := range c.Devices {
						seen[key{string(p.UID), c.Name, d.UUID}] = true
						byGPU[d.UUID] = append(byGPU[d.UUID], holderView{Namespace: p.Namespace, Pod: p.Name, Container: c.Name,
							Whole: d.Whole, MemoryBytes: d.MemoryBytes, CoresPercent: d.CoresPercent, Source: "assignment"})
					}
				}
			}
		}
		for _, c := range p.Spec.Containers {
			for name, q := range c.Resources.Limits {
				var what string
				switch s := string(name); {
				case strings.HasPrefix(s, api.MIGResourcePrefix):
					what = fmt.Sprintf("%s x MIG %s", q.String(), strings.TrimPrefix(s, api.MIGResourcePrefix))
				case strings.HasPrefix(s, api.MdevResourcePrefix):
					what = fmt.Sprintf("%s x mdev %s", q.String(), strings.TrimPrefix(s, api.MdevResourcePrefix))
				default:
					continue
				}
				v.Hardware = append(v.Hardware, holderView{Namespace: p.Namespace, Pod: p.Name, Container: c.Name, Source: "hardware", What: what})
			}
		}
	}
	slices.SortFunc(v.Hardware, func(a, b holderView) int { return cmp.Compare(a.String(), b.String()) })
	switch raw := n.Annotations[api.AnnotationHoldings]; {
	case raw == "":
		v.Holdings = "the node agent publishes no holdings (annotation " + api.AnnotationHoldings + "): is it running there, and new enough?"
	default:
		h, err := api.DecodeHoldings([]byte(raw))
		if err == nil && h.Node != n.Name {
			err = fmt.Errorf("they name node %q", h.Node)
		}
		if err != nil {
			v.Holdings = "holdings unreadable: " + err.Error()
			break
		}
		for _, p := range h.Pods {
			source := "holdings"
			if p.Local {
				source = "local"
			}
			for _, c := range p.Containers {
				s := source
				if strings.HasPrefix(c.Name, claimContainer) {
					s = "claim"
				}
				for _, d := range c.Devices {
					if seen[key{p.UID, c.Name, d.UUID}] {
						continue // the assignment the agent realised
					}
					seen[key{p.UID, c.Name, d.UUID}] = true
					byGPU[d.UUID] = append(byGPU[d.UUID], holderView{Namespace: p.Namespace, Pod: p.Pod, Container: c.Name,
						Whole: d.Whole, MemoryBytes: d.MemoryBytes, CoresPercent: d.CoresPercent, Source: s})
				}
			}
		}
	}
	for _, g := range inv.GPUs {
		hs := byGPU[g.UUID]
		slices.SortFunc(hs, func(a, b holderView) int { return cmp.Compare(a.String(), b.String()) })
		gv := gpuView{Index: g.Index, UUID: g.UUID, Model: g.Model, MemoryBytes: g.MemoryBytes, PCIBusID: g.PCIBusID,
			NUMANode: g.NUMANode, Healthy: g.Healthy, Holders: hs}
		gv.Mode, gv.Free = gpuState(&g, hs, inv.SharesPerGPU)
		if v.Holdings != "" && gv.Mode != "mig" && gv.Mode != "mdev" {
			gv.Free = "unknown"
		}
		v.GPUs = append(v.GPUs, gv)
	}
	return v
}

// gpuState is a GPU's mode and what is free on it.
func gpuState(g *api.GPU, hs []holderView, sharesPerGPU int) (mode, free string) {
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
	}
	whole := slices.ContainsFunc(hs, func(h holderView) bool { return h.Whole })
	switch {
	case whole && len(hs) > 1:
		return "conflict", "-" // two holders where one holds it whole: the agent's logs say more
	case whole:
		return "whole", "-"
	}
	var mem int64
	cores := 0
	for _, h := range hs {
		mem, cores = mem+h.MemoryBytes, cores+h.CoresPercent
	}
	return "shared", fmt.Sprintf("%s, %d%% cores, %d shares", gib(g.MemoryBytes-mem), 100-cores, sharesPerGPU-len(hs))
}

// printNodes prints the views as a table per node, or as a List (-o json|yaml). Nodes without an
// inventory are left out unless they were asked for by name.
func printNodes(w io.Writer, output string, views []nodeView, named bool) error {
	shown := views[:0:0]
	for _, v := range views {
		if v.Problem == "" || named {
			shown = append(shown, v)
		}
	}
	if len(shown) == 0 {
		return errors.New("no node carries a Tessera inventory (annotation " + api.AnnotationInventory + "): is the node agent running?")
	}
	if output == "json" || output == "yaml" {
		return printList(w, output, "GPUNode", shown, func(v nodeView) (string, string) { return "", v.Name })
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, v := range shown {
		if v.Problem != "" {
			fmt.Fprintf(tw, "NODE %s\t%s\n", v.Name, v.Problem)
			continue
		}
		fmt.Fprintf(tw, "NODE %s\t%d GPUs, %d shares per GPU\n", v.Name, len(v.GPUs), v.SharesPerGPU)
		if v.Holdings != "" {
			fmt.Fprintf(tw, "  free capacity unknown: %s\n", v.Holdings)
		}
		wide := output == "wide"
		if wide {
			fmt.Fprintln(tw, "  GPU\tUUID\tMODEL\tMEMORY\tPCI\tNUMA\tMODE\tFREE\tHELD BY")
		} else {
			fmt.Fprintln(tw, "  GPU\tUUID\tMODEL\tMEMORY\tMODE\tFREE\tHELD BY")
		}
		for _, g := range v.GPUs {
			mode := g.Mode
			if !g.Healthy {
				mode += " (unhealthy)"
			}
			held := "-"
			if len(g.Holders) > 0 {
				parts := make([]string, len(g.Holders))
				for i, h := range g.Holders {
					parts[i] = h.String()
				}
				held = strings.Join(parts, "; ")
			}
			if wide {
				fmt.Fprintf(tw, "  %d\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", g.Index, g.UUID, g.Model, gib(g.MemoryBytes), g.PCIBusID, g.NUMANode, mode, g.Free, held)
			} else {
				fmt.Fprintf(tw, "  %d\t%s\t%s\t%s\t%s\t%s\t%s\n", g.Index, g.UUID, g.Model, gib(g.MemoryBytes), mode, g.Free, held)
			}
		}
		for _, h := range v.Hardware {
			if wide {
				fmt.Fprintf(tw, "  -\t\t\t\t\t\thardware\t\t%s\n", h)
			} else {
				fmt.Fprintf(tw, "  -\t\t\t\thardware\t\t%s\n", h)
			}
		}
	}
	return tw.Flush()
}

func gib(b int64) string { return resource.NewQuantity(b, resource.BinarySI).String() }
