package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	api "github.com/tessera-gpu/tessera/api/v1"
)

func pendingCommand(o *options) *cobra.Command {
	var all bool
	cmd := &cobra.Command{
		Use:   "pending",
		Short: "GPU pods that are not running, and why",
		Long: `pending lists the pods asking for Tessera's resources that are not running, in the namespace
of -n or the kubeconfig's context (-A: all namespaces), each with the scheduler's message, its
latest Warning Events (reason and message, one line each) and its waiting containers' reasons.
Long lines are wrapped to $COLUMNS (100 when unset); -o wide does not wrap.`,
		Example: `  kubectl tessera pending -A
  kubectl tessera pending -n team-a -o yaml`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			client, ns, err := o.client()
			if err != nil {
				return err
			}
			if all {
				ns = metav1.NamespaceAll
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			pods, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{
				FieldSelector: fields.AndSelectors(fields.OneTermNotEqualSelector("status.phase", string(corev1.PodRunning)),
					fields.OneTermNotEqualSelector("status.phase", string(corev1.PodSucceeded))).String()})
			if err != nil {
				return fmt.Errorf("list pods: %w", err)
			}
			events, err := client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("involvedObject.kind", "Pod").String()})
			if err != nil {
				return fmt.Errorf("list events: %w", err)
			}
			var views []podView
			for i := range pods.Items {
				if asksForGPU(&pods.Items[i]) {
					views = append(views, viewPod(&pods.Items[i], events.Items))
				}
			}
			return printPods(o.out(), o.output, views, "no GPU pod is waiting")
		},
	}
	cmd.Flags().BoolVarP(&all, "all-namespaces", "A", false, "List pods in all namespaces")
	return cmd
}

func whyCommand(o *options) *cobra.Command {
	return &cobra.Command{
		Use:     "why POD",
		Short:   "Why one pod is not running: the scheduler's message, Warning Events, waiting containers",
		Example: `  kubectl tessera why trainer-0 -n team-a`,
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			client, ns, err := o.client()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			pod, err := client.CoreV1().Pods(ns).Get(ctx, args[0], metav1.GetOptions{})
			if err != nil {
				return fmt.Errorf("pod %s/%s: %w", ns, args[0], err)
			}
			events, err := client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: fields.AndSelectors(
				fields.OneTermEqualSelector("involvedObject.kind", "Pod"), fields.OneTermEqualSelector("involvedObject.name", pod.Name)).String()})
			if err != nil {
				return fmt.Errorf("list events: %w", err)
			}
			return printPods(o.out(), o.output, []podView{viewPod(pod, events.Items)}, "")
		},
	}
}

// podView is one pod as pending and why print it (-o json|yaml print it as is).
type podView struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	Phase     string `json:"phase"`
	Node      string `json:"node,omitempty"`
	// AsksForGPU is false for a pod asking for none of Tessera's resources (why shows any pod).
	AsksForGPU bool `json:"asksForGPU"`
	// Scheduler is the PodScheduled condition's message while the pod is not scheduled.
	Scheduler string `json:"scheduler,omitempty"`
	// Events are the pod's latest distinct Warning Events, oldest first.
	Events     []eventView `json:"events,omitempty"`
	Containers []waitView  `json:"waitingContainers,omitempty"`
}

type eventView struct {
	Reason    string `json:"reason"`
	Component string `json:"component,omitempty"`
	Count     int32  `json:"count"`
	Message   string `json:"message"`
}

type waitView struct {
	Name    string `json:"name"`
	Reason  string `json:"reason"`
	Message string `json:"message"`
}

// eventsPerPod is how many distinct Warning Events a pod shows (the latest).
const eventsPerPod = 3

// viewPod gathers what says why pod waits. Events match by UID when they carry one, so a pod made
// again under the same name does not show its predecessor's.
func viewPod(p *corev1.Pod, events []corev1.Event) podView {
	v := podView{Namespace: p.Namespace, Name: p.Name, Phase: string(p.Status.Phase), Node: p.Spec.NodeName, AsksForGPU: asksForGPU(p)}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status != corev1.ConditionTrue && c.Message != "" {
			v.Scheduler = oneLine(c.Message)
		}
	}
	at := map[string]int{} // reason and message -> index in v.Events
	var last []metav1.Time // when each of v.Events last happened
	for _, e := range events {
		o := e.InvolvedObject
		if e.Type != corev1.EventTypeWarning || o.Kind != "Pod" || o.Namespace != p.Namespace || o.Name != p.Name || (o.UID != "" && p.UID != "" && o.UID != p.UID) {
			continue
		}
		msg, t := oneLine(e.Message), eventTime(&e)
		count := max(e.Count, 1)
		if e.Series != nil {
			count = max(e.Series.Count, count)
		}
		k := e.Reason + "\x00" + msg
		if i, ok := at[k]; ok {
			v.Events[i].Count += count
			if last[i].Before(&t) {
				last[i] = t
			}
			continue
		}
		at[k] = len(v.Events)
		v.Events = append(v.Events, eventView{Reason: e.Reason, Component: cmp.Or(e.Source.Component, e.ReportingController), Count: count, Message: msg})
		last = append(last, t)
	}
	order := make([]int, len(v.Events))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return last[a].Compare(last[b].Time) })
	if len(order) > eventsPerPod {
		order = order[len(order)-eventsPerPod:]
	}
	evs := make([]eventView, len(order))
	for i, j := range order {
		evs[i] = v.Events[j]
	}
	v.Events = evs
	for _, cs := range p.Status.ContainerStatuses {
		if w := cs.State.Waiting; w != nil && w.Message != "" {
			v.Containers = append(v.Containers, waitView{Name: cs.Name, Reason: w.Reason, Message: oneLine(w.Message)})
		}
	}
	return v
}

// eventTime is when an Event last happened, whichever API wrote it.
func eventTime(e *corev1.Event) metav1.Time {
	switch {
	case e.Series != nil && !e.Series.LastObservedTime.IsZero():
		return metav1.Time{Time: e.Series.LastObservedTime.Time}
	case !e.LastTimestamp.IsZero():
		return e.LastTimestamp
	case !e.EventTime.IsZero():
		return metav1.Time{Time: e.EventTime.Time}
	case !e.FirstTimestamp.IsZero():
		return e.FirstTimestamp
	}
	return e.CreationTimestamp
}

// oneLine folds a message's line breaks, tabs and runs of spaces into single spaces: Events and
// scheduler messages often carry newlines that break a listing.
func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// printPods prints the views, one block per pod, or as a List (-o json|yaml).
func printPods(w io.Writer, output string, views []podView, none string) error {
	if output == "json" || output == "yaml" {
		return printList(w, output, "PendingPod", views, func(v podView) (string, string) { return v.Namespace, v.Name })
	}
	if len(views) == 0 {
		_, err := fmt.Fprintln(w, none)
		return err
	}
	width := 0
	if output != "wide" {
		width = columns()
	}
	var b strings.Builder
	for _, v := range views {
		fmt.Fprintf(&b, "%s/%s\t%s\t%s\n", v.Namespace, v.Name, v.Phase, cmp.Or(v.Node, "(not scheduled)"))
		if !v.AsksForGPU {
			b.WriteString("  asks for none of Tessera's resources\n")
		}
		if v.Scheduler != "" {
			wrap(&b, "scheduler: "+v.Scheduler, width)
		}
		for _, e := range v.Events {
			head := e.Reason
			switch {
			case e.Component != "" && e.Count > 1:
				head += fmt.Sprintf(" (%s, x%d)", e.Component, e.Count)
			case e.Component != "":
				head += " (" + e.Component + ")"
			case e.Count > 1:
				head += fmt.Sprintf(" (x%d)", e.Count)
			}
			wrap(&b, head+": "+e.Message, width)
		}
		for _, c := range v.Containers {
			wrap(&b, "container "+c.Name+": "+c.Reason+": "+c.Message, width)
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// columns is the width pending wraps to: $COLUMNS, or 100.
func columns() int {
	if n, err := strconv.Atoi(os.Getenv("COLUMNS")); err == nil && n >= 40 {
		return n
	}
	return 100
}

// wrap writes s indented by two spaces, broken at spaces into lines of at most width (0: no
// limit); continuation lines are indented by four. A word longer than a line stays whole.
func wrap(b *strings.Builder, s string, width int) {
	const indent, more = "  ", "    "
	line := indent
	for i, word := range strings.Fields(s) {
		switch {
		case i == 0:
			line += word
		case width > 0 && len(line)+1+len(word) > width:
			b.WriteString(line + "\n")
			line = more + word
		default:
			line += " " + word
		}
	}
	b.WriteString(line + "\n")
}

func asksForGPU(p *corev1.Pod) bool {
	for _, c := range append(slices.Clone(p.Spec.InitContainers), p.Spec.Containers...) {
		for name := range c.Resources.Limits {
			if api.IsTesseraResource(string(name)) {
				return true
			}
		}
	}
	return false
}
