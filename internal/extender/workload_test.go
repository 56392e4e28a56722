package extender

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestWorkloadClassPrefersOlderGPUs: experiment and inference pods (tessera.dev/workload, or a
// priority class mapped to the class) go to the older GPU generation where the policy's scores
// tie, training and unlabelled pods do not. Two nodes alike but for their GPUs' compute capability:
// the newer one wins every tie by name, so only the class preference sends a pod to the older one,
// in pick-one Filter (keepBest) and in Prioritize (classWeight of the score).
func TestWorkloadClassPrefersOlderGPUs(t *testing.T) {
	newer := testInventory("a-h100", 1, 2, "NVIDIA H100 80GB HBM3")
	for i := range newer.GPUs {
		newer.GPUs[i].ComputeCapability = "9.0"
	}
	older := testInventory("b-v100", 2, 2, "Tesla V100-SXM2-16GB") // compute capability 7.0
	names := []string{"a-h100", "b-v100"}
	pod := func(class, priorityClass string) *corev1.Pod {
		p := sharePod("p-"+class+priorityClass, 1, 2, 20)
		if class != "" {
			p.Labels = map[string]string{api.LabelWorkload: class}
		}
		p.Spec.PriorityClassName = priorityClass
		return p
	}
	cases := []struct {
		name, class, priorityClass, want string
	}{
		{"experiment", api.WorkloadExperiment, "", "b-v100"},
		{"inference", api.WorkloadInference, "", "b-v100"},
		{"experiment by priority class", "", "batch-experiments", "b-v100"},
		{"training", api.WorkloadTraining, "", "a-h100"},
		{"unlabelled", "", "", "a-h100"},
	}
	for _, pickOne := range []bool{true, false} {
		x := newTestExtender(t, api.PolicyTessera)
		x.Class.Experiment = []string{"batch-experiments"}
		x.PickOne = pickOne
		x.State.UpsertNode(testNode(newer, nil))
		x.State.UpsertNode(testNode(older, nil))
		for _, c := range cases {
			p := pod(c.class, c.priorityClass)
			if pickOne {
				res := x.Filter(&extenderv1.ExtenderArgs{Pod: p, NodeNames: &names})
				if res.NodeNames == nil || strings.Join(*res.NodeNames, ",") != c.want {
					t.Errorf("pick-one Filter, %s pod: kept %v, want %s (error %q)", c.name, res.NodeNames, c.want, res.Error)
				}
				continue
			}
			list, err := x.Prioritize(&extenderv1.ExtenderArgs{Pod: p, NodeNames: &names})
			if err != nil {
				t.Fatal(err)
			}
			score := map[string]int64{}
			for _, h := range *list {
				score[h.Host] = h.Score
			}
			other := "a-h100"
			if c.want == other {
				other = "b-v100"
			}
			// Without a class preference the scores tie (the kube-scheduler then picks either).
			if score[c.want] < score[other] || c.want == "b-v100" && score[c.want] == score[other] {
				t.Errorf("Prioritize, %s pod: scores %v, want %s ahead (older GPUs only for experiment and inference)", c.name, score, c.want)
			}
		}
	}
}
