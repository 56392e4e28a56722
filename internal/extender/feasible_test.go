package extender

import (
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestSecurityBindChecksNodeFeasibility: Bind binds a pod only to a node its own filters would pass
// as kube-scheduler's do (taints it does not tolerate, a cordoned node, nodeSelector and required
// node affinity), for GPU pods and pods without GPUs alike; a refused bind writes nothing (no
// nodeName, no assignment, no reservation) and says why.
func TestSecurityBindChecksNodeFeasibility(t *testing.T) {
	controlPlane := corev1.Taint{Key: "node-role.kubernetes.io/control-plane", Effect: corev1.TaintEffectNoSchedule}
	noExec := corev1.Taint{Key: "dedicated", Value: "infra", Effect: corev1.TaintEffectNoExecute}
	prefer := corev1.Taint{Key: "soft", Effect: corev1.TaintEffectPreferNoSchedule}
	tolerateAll := []corev1.Toleration{{Operator: corev1.TolerationOpExists}}
	required := &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
		NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{
			{Key: "zone", Operator: corev1.NodeSelectorOpIn, Values: []string{"a"}},
		}}},
	}}}
	for _, tc := range []struct {
		name          string
		taints        []corev1.Taint
		unschedulable bool
		nodeLabels    map[string]string
		tolerations   []corev1.Toleration
		selector      map[string]string
		affinity      *corev1.Affinity
		want          string // "" when the bind must land
	}{
		{name: "feasible"},
		{name: "control-plane taint", taints: []corev1.Taint{controlPlane}, want: "taint node-role.kubernetes.io/control-plane:NoSchedule that the pod does not tolerate"},
		{name: "NoExecute taint", taints: []corev1.Taint{noExec}, want: "taint dedicated=infra:NoExecute"},
		{name: "taint tolerated", taints: []corev1.Taint{controlPlane, noExec}, tolerations: tolerateAll},
		{name: "PreferNoSchedule is no filter", taints: []corev1.Taint{prefer}},
		{name: "wrong toleration value", taints: []corev1.Taint{noExec}, tolerations: []corev1.Toleration{{Key: "dedicated", Value: "gpu", Effect: corev1.TaintEffectNoExecute}}, want: "dedicated=infra:NoExecute"},
		{name: "cordoned", unschedulable: true, want: "unschedulable (cordoned)"},
		{name: "cordoned, tolerated", unschedulable: true, tolerations: []corev1.Toleration{{Key: corev1.TaintNodeUnschedulable, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}}},
		{name: "nodeSelector not matched", selector: map[string]string{"pool": "training"}, nodeLabels: map[string]string{"pool": "inference"}, want: "nodeSelector or required node affinity"},
		{name: "nodeSelector matched", selector: map[string]string{"pool": "training"}, nodeLabels: map[string]string{"pool": "training"}},
		{name: "required affinity not matched", affinity: required, nodeLabels: map[string]string{"zone": "b"}, want: "nodeSelector or required node affinity"},
		{name: "required affinity matched", affinity: required, nodeLabels: map[string]string{"zone": "a"}},
	} {
		for _, pod := range []*corev1.Pod{wholePod("w", 1), testPod("cpu", corev1.ResourceList{})} {
			t.Run(tc.name+"/"+pod.Name, func(t *testing.T) {
				node := testNode(testInventory("n1", 1, 1, "T4"), tc.nodeLabels)
				node.Spec.Taints, node.Spec.Unschedulable = tc.taints, tc.unschedulable
				pod.Spec.Tolerations, pod.Spec.NodeSelector, pod.Spec.Affinity = tc.tolerations, tc.selector, tc.affinity
				x, got, err := bindAndRead(t, node, pod)
				if tc.want == "" {
					if err != nil || got.Spec.NodeName != "n1" {
						t.Fatalf("bind to a feasible node: err %v, node %q", err, got.Spec.NodeName)
					}
					return
				}
				if err == nil || !strings.Contains(err.Error(), "to node n1 refused") || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("bind to an infeasible node: err %v, want a refusal saying %q", err, tc.want)
				}
				if got.Spec.NodeName != "" || got.Annotations[api.AnnotationAssignment] != "" || x.State.Holds(pod.UID) {
					t.Fatalf("refused bind left node %q assignment %q holds=%v", got.Spec.NodeName, got.Annotations[api.AnnotationAssignment], x.State.Holds(pod.UID))
				}
			})
		}
	}
	// A node the API server does not have is no target either.
	pod := testPod("cpu", corev1.ResourceList{})
	cs, _ := fakeAPI(t, pod)
	x := newBinder(t, cs, "a", testNode(testInventory("n1", 1, 1, "T4"), nil))
	if err := x.Bind(context.Background(), &extenderv1.ExtenderBindingArgs{PodName: pod.Name, PodNamespace: "default", PodUID: pod.UID, Node: "gone"}); err == nil || !strings.Contains(err.Error(), "get node gone") {
		t.Fatalf("bind to a node the API server lacks: err %v", err)
	}
}

// TestSecurityInitContainerWholeGPURefused: a pod whose init container asks for whole GPUs, which no
// assignment can name (it lists regular containers only) and the node would refuse at create, is
// refused by Filter on every node, unresolvably, with the reason; a MIG instance in an init container
// is the kubelet's to pass on and is not refused.
func TestSecurityInitContainerWholeGPURefused(t *testing.T) {
	x := newTestExtender(t, api.PolicyTessera)
	x.State.UpsertNode(testNode(testInventory("n1", 1, 2, "T4"), nil))
	names := []string{"n1"}
	pod := wholePod("staged", 1)
	pod.Spec.InitContainers = []corev1.Container{{Name: "init", Resources: pod.Spec.Containers[0].Resources}}
	res := x.Filter(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names})
	if why := res.FailedAndUnresolvableNodes["n1"]; !strings.Contains(why, `init container "init": nvidia.com/gpu is not supported in init containers`) {
		t.Errorf("filter of a pod with a whole GPU in its init container: fit %v, unresolvable %v, failed %v", res.NodeNames, res.FailedAndUnresolvableNodes, res.FailedNodes)
	}
	pod.Spec.InitContainers[0].Resources.Limits = corev1.ResourceList{corev1.ResourceName(api.MIGResource("1g.5gb")): resource.MustParse("1")}
	pod.UID = "uid-staged-mig"
	if res := x.Filter(&extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names}); len(res.FailedAndUnresolvableNodes) != 0 {
		t.Errorf("a MIG instance in an init container refused: %v", res.FailedAndUnresolvableNodes)
	}
}
