package extender

import (
	"fmt"
	"log/slog"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	schedcorev1 "k8s.io/component-helpers/scheduling/corev1"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
)

// infeasible says why the pod must not run on node ("" when it may), by the rules of kube-scheduler's
// NodeUnschedulable, TaintToleration and NodeAffinity filters (their component-helpers, not a copy):
// Bind binds what it is asked to, so it checks what the scheduler's own filters would have, and a
// bind call naming a node the pod may not use (a tainted control-plane node, a node outside its
// nodeSelector) is refused whoever sent it.
func infeasible(pod *corev1.Pod, node *corev1.Node, log *slog.Logger) string {
	lg := logr.FromSlogHandler(log.Handler())
	// Comparison operators (Lt, Gt) in a toleration were admitted by the API server, so their gate is on.
	const comparisons = true
	if node.Spec.Unschedulable {
		t := corev1.Taint{Key: corev1.TaintNodeUnschedulable, Effect: corev1.TaintEffectNoSchedule}
		if !schedcorev1.TolerationsTolerateTaint(lg, pod.Spec.Tolerations, &t, comparisons) {
			return "the node is unschedulable (cordoned) and the pod does not tolerate " + corev1.TaintNodeUnschedulable
		}
	}
	if t, ok := schedcorev1.FindMatchingUntoleratedTaint(lg, node.Spec.Taints, pod.Spec.Tolerations, func(t *corev1.Taint) bool {
		return t.Effect == corev1.TaintEffectNoSchedule || t.Effect == corev1.TaintEffectNoExecute
	}, comparisons); ok {
		return fmt.Sprintf("the node has taint %s that the pod does not tolerate", t.ToString())
	}
	match, err := nodeaffinity.GetRequiredNodeAffinity(pod).Match(node)
	switch {
	case err != nil:
		return fmt.Sprintf("the pod's required node affinity cannot be evaluated: %v", err)
	case !match:
		return "the node does not match the pod's nodeSelector or required node affinity"
	}
	return ""
}
