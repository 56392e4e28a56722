package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/agent"
	"github.com/tessera-gpu/tessera/internal/dra"
)

// TestSecurityLeastPrivilege installs the chart on a real kube-apiserver (1.37.2, no kubelet) and
// writes with each component's own credentials: a ServiceAccount token from the TokenRequest API,
// for the node agent bound to its pod on node gpu-a (the token the kubelet projects carries the same
// node claim). Every write a component needs must pass; every one it must not make must be refused
// by the API server, by RBAC (the chart's Roles) or by the chart's ValidatingAdmissionPolicies
// (what RBAC cannot say: the agent's own Node and its keys, its own ResourceSlices, the extender's
// two pod keys). It also checks the DRA quota the chart renders from dra.quotas: a namespace cannot
// claim devices of a DeviceClass past it.
func TestSecurityLeastPrivilege(t *testing.T) {
	// The API server runs with docs/dra.md's quota admission configuration: claims only where a
	// quota covers their DeviceClass.
	cp := StartControlPlane(t, ControlPlaneOptions{NoScheduler: true, AdmissionConfig: docsQuotaAdmission(t)})
	const ns, release, team, unlimited = "tessera-system", "tessera", "team-a", "team-b"
	for _, n := range []string{ns, team, unlimited, "kube-node-lease", "kube-system"} {
		cp.CreateNamespace(t, n)
	}
	values := filepath.Join(t.TempDir(), "values.yaml")
	if err := os.WriteFile(values, []byte(`dra:
  quotas:
    - namespace: `+team+`
      claims: 3
      devices: {`+classWhole+`: 1, `+classShare+`: 0}
`), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := helm(t, "install", release, helmChart(), "--kubeconfig", cp.Kubeconfig, "--namespace", ns, "-f", values); err != nil {
		t.Fatalf("helm install: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	admin := cp.Client
	must := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	for _, n := range []string{"gpu-a", "gpu-b"} {
		_, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n,
			Labels: map[string]string{api.LabelPool: "pool-1"}}}, metav1.CreateOptions{})
		must("create node "+n, err)
	}
	no := false
	pod := func(namespace, name, sa, node string) *corev1.Pod {
		p, err := admin.CoreV1().Pods(namespace).Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
			Spec: corev1.PodSpec{ServiceAccountName: sa, NodeName: node, AutomountServiceAccountToken: &no,
				Containers: []corev1.Container{{Name: "main", Image: "registry.k8s.io/pause:3.10"}}},
		}, metav1.CreateOptions{})
		must("create pod "+namespace+"/"+name, err)
		return p
	}
	// The agent's pod, as the DaemonSet would place it on gpu-a.
	agentPod := pod(ns, release+"-node-gpu-a", release+"-node", "gpu-a")
	work := pod(team, "work", "", "gpu-a")
	pending := pod(team, "pending", "", "")

	nodeAgent := saClient(t, cp, ns, release+"-node", agentPod)
	unbound := saClient(t, cp, ns, release+"-node", nil) // no pod, so no node claim
	extender := saClient(t, cp, ns, release+"-extender", nil)

	// The premise: the bound token names gpu-a in the request's identity, as the policies read it.
	review, err := nodeAgent.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	must("SelfSubjectReview", err)
	if got := review.Status.UserInfo.Extra["authentication.kubernetes.io/node-name"]; len(got) != 1 || got[0] != "gpu-a" {
		t.Fatalf("the agent's bound token carries node-name %v, want [gpu-a]: the node policies have nothing to check", got)
	}

	// Admin-made objects the agent must not touch: gpu-b's ResourceSlice.
	otherSlice, err := admin.ResourceV1().ResourceSlices().Create(ctx, testSlice("gpu-b-slice", "gpu-b", dra.DriverName), metav1.CreateOptions{})
	must("create gpu-b's slice", err)

	// The policies load asynchronously: wait until each refuses a probe (dry runs: no side effects).
	dry := []string{metav1.DryRunAll}
	waitRefused(t, "the node restriction policy", func() error {
		_, err := unbound.CoreV1().Nodes().Patch(ctx, "gpu-a", types.MergePatchType, metaPatch("annotations", api.AnnotationInventoryHeartbeat, "probe"), metav1.PatchOptions{DryRun: dry})
		return err
	})
	waitRefused(t, "the node slices policy", func() error {
		_, err := unbound.ResourceV1().ResourceSlices().Create(ctx, testSlice("probe", "gpu-a", dra.DriverName), metav1.CreateOptions{DryRun: dry})
		return err
	})
	waitRefused(t, "the extender writes policy", func() error {
		_, err := extender.CoreV1().Pods(team).Patch(ctx, work.Name, types.MergePatchType, metaPatch("labels", "app", "probe"), metav1.PatchOptions{DryRun: dry})
		return err
	})

	// by: "" for a needed write (must pass); "rbac" or "policy" for one the API server must refuse
	// that way (the message says which: RBAC's "cannot", a policy's ValidatingAdmissionPolicy name).
	type write struct {
		name, by string
		do       func() error
	}
	var mine *resourceapi.ResourceSlice
	agentWrites := []write{
		{"patch its own Node's Tessera keys", "", func() error {
			_, err := nodeAgent.CoreV1().Nodes().Patch(ctx, "gpu-a", types.MergePatchType, []byte(`{"metadata":{"annotations":{"`+
				api.AnnotationInventory+`":"{}","`+api.AnnotationInventoryHeartbeat+`":"now","`+api.AnnotationHoldings+`":"{}"},"labels":{"`+
				api.LabelGPUModel+`":"A100","`+api.LabelGPUCount+`":"8","`+api.LabelGPUMemory+`":"40960","`+api.LabelGPUComputeMajor+`":"8","`+
				api.LabelGPUComputeMinor+`":"0","`+api.LabelMIGCapable+`":"true","`+api.LabelDriverVersion+`":"550.54.15","`+api.LabelCUDAVersion+`":"12.4","`+
				api.LabelPrefixModelCount+`NVIDIA-A100-SXM4-40GB":"8"}}}`), metav1.PatchOptions{})
			return err
		}},
		{"remove its Node's per-model GPU label", "", func() error {
			_, err := nodeAgent.CoreV1().Nodes().Patch(ctx, "gpu-a", types.MergePatchType, []byte(`{"metadata":{"labels":{"`+
				api.LabelPrefixModelCount+`NVIDIA-A100-SXM4-40GB":null}}}`), metav1.PatchOptions{})
			return err
		}},
		{"overwrite GPU Feature Discovery's label", "policy", func() error {
			_, err := nodeAgent.CoreV1().Nodes().Patch(ctx, "gpu-a", types.MergePatchType, metaPatch("labels", "nvidia.com/gpu.product", "A100"), metav1.PatchOptions{})
			return err
		}},
		{"patch another Node's Tessera keys", "policy", func() error {
			_, err := nodeAgent.CoreV1().Nodes().Patch(ctx, "gpu-b", types.MergePatchType, metaPatch("annotations", api.AnnotationInventory, "{}"), metav1.PatchOptions{})
			return err
		}},
		{"move its Node to another pool", "policy", func() error {
			_, err := nodeAgent.CoreV1().Nodes().Patch(ctx, "gpu-a", types.MergePatchType, metaPatch("labels", api.LabelPool, "pool-2"), metav1.PatchOptions{})
			return err
		}},
		{"set another annotation on its Node", "policy", func() error {
			_, err := nodeAgent.CoreV1().Nodes().Patch(ctx, "gpu-a", types.MergePatchType, metaPatch("annotations", "example.com/x", "y"), metav1.PatchOptions{})
			return err
		}},
		{"taint its Node", "policy", func() error {
			_, err := nodeAgent.CoreV1().Nodes().Patch(ctx, "gpu-a", types.MergePatchType, []byte(`{"spec":{"unschedulable":true}}`), metav1.PatchOptions{})
			return err
		}},
		{"patch its Node without a node claim", "policy", func() error {
			_, err := unbound.CoreV1().Nodes().Patch(ctx, "gpu-a", types.MergePatchType, metaPatch("annotations", api.AnnotationInventoryHeartbeat, "later"), metav1.PatchOptions{})
			return err
		}},
		{"delete a Node", "rbac", func() error { return nodeAgent.CoreV1().Nodes().Delete(ctx, "gpu-b", metav1.DeleteOptions{}) }},
		{"patch a pod on its node", "rbac", func() error {
			_, err := nodeAgent.CoreV1().Pods(team).Patch(ctx, work.Name, types.MergePatchType, metaPatch("labels", "app", "x"), metav1.PatchOptions{})
			return err
		}},
		{"write a node heartbeat Lease", "rbac", func() error {
			_, err := nodeAgent.CoordinationV1().Leases("kube-node-lease").Create(ctx, testLease("gpu-b"), metav1.CreateOptions{})
			return err
		}},
		{"read a Secret", "rbac", func() error {
			_, err := nodeAgent.CoreV1().Secrets(ns).Get(ctx, release+"-extender-tls", metav1.GetOptions{})
			return err
		}},
		{"record an Event through its recorder", "", func() error {
			// The agent's own recorder (agent.NewEventRecorder), as it records refused containers.
			rec, stop := agent.NewEventRecorder(nodeAgent, "gpu-a")
			rec.Eventf(&corev1.ObjectReference{APIVersion: "v1", Kind: "Pod", Namespace: team, Name: work.Name, UID: work.UID},
				corev1.EventTypeWarning, "GPUContainerRefused", "e2e: recorded by tessera-node")
			defer stop()
			return waitFor(30*time.Second, 200*time.Millisecond, func() (bool, error) {
				l, err := admin.CoreV1().Events(team).List(ctx, metav1.ListOptions{FieldSelector: "reason=GPUContainerRefused"})
				return err == nil && len(l.Items) > 0, err
			})
		}},
		{"record an Event as another node", "policy", func() error {
			_, err := nodeAgent.CoreV1().Events(team).Create(ctx, &corev1.Event{ObjectMeta: metav1.ObjectMeta{GenerateName: "forged-", Namespace: team},
				InvolvedObject: corev1.ObjectReference{Kind: "Pod", Namespace: team, Name: work.Name, UID: work.UID},
				Reason:         "GPUContainerRefused", Message: "test", Type: corev1.EventTypeWarning, Source: corev1.EventSource{Component: "tessera-node", Host: "gpu-b"}}, metav1.CreateOptions{})
			return err
		}},
		{"record an Event as the kubelet", "policy", func() error {
			_, err := nodeAgent.CoreV1().Events(team).Create(ctx, &corev1.Event{ObjectMeta: metav1.ObjectMeta{GenerateName: "forged-", Namespace: team},
				InvolvedObject: corev1.ObjectReference{Kind: "Pod", Namespace: team, Name: work.Name, UID: work.UID},
				Reason:         "Killing", Message: "test", Type: corev1.EventTypeNormal, Source: corev1.EventSource{Component: "kubelet", Host: "gpu-a"}}, metav1.CreateOptions{})
			return err
		}},
		{"create its own ResourceSlice", "", func() error {
			var err error
			mine, err = nodeAgent.ResourceV1().ResourceSlices().Create(ctx, testSlice("gpu-a-slice", "gpu-a", dra.DriverName), metav1.CreateOptions{})
			return err
		}},
		{"update its own ResourceSlice", "", func() error {
			if mine == nil {
				return fmt.Errorf("no slice of its own (its create failed)")
			}
			mine.Spec.Pool.Generation++
			var err error
			mine, err = nodeAgent.ResourceV1().ResourceSlices().Update(ctx, mine, metav1.UpdateOptions{})
			return err
		}},
		{"create a ResourceSlice for another node", "policy", func() error {
			_, err := nodeAgent.ResourceV1().ResourceSlices().Create(ctx, testSlice("gpu-b-forged", "gpu-b", dra.DriverName), metav1.CreateOptions{})
			return err
		}},
		{"create a ResourceSlice of another driver", "policy", func() error {
			_, err := nodeAgent.ResourceV1().ResourceSlices().Create(ctx, testSlice("gpu-a-other", "gpu-a", "other.example.com"), metav1.CreateOptions{})
			return err
		}},
		{"create a ResourceSlice without a node claim", "policy", func() error {
			_, err := unbound.ResourceV1().ResourceSlices().Create(ctx, testSlice("gpu-a-unbound", "gpu-a", dra.DriverName), metav1.CreateOptions{})
			return err
		}},
		{"update another node's ResourceSlice", "policy", func() error {
			s := otherSlice.DeepCopy()
			s.Spec.Pool.Generation++
			_, err := nodeAgent.ResourceV1().ResourceSlices().Update(ctx, s, metav1.UpdateOptions{})
			return err
		}},
		{"delete another node's ResourceSlice", "policy", func() error {
			return nodeAgent.ResourceV1().ResourceSlices().Delete(ctx, otherSlice.Name, metav1.DeleteOptions{})
		}},
		{"delete every ResourceSlice at once", "rbac", func() error {
			return nodeAgent.ResourceV1().ResourceSlices().DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
		}},
		{"delete its own ResourceSlice", "", func() error {
			return nodeAgent.ResourceV1().ResourceSlices().Delete(ctx, "gpu-a-slice", metav1.DeleteOptions{})
		}},
	}
	assign := `{"metadata":{"annotations":{"` + api.AnnotationAssignment + `":"{}"},"labels":{"` + api.LabelAssignedNode + `":"gpu-a"}}}`
	unassign := `{"metadata":{"annotations":{"` + api.AnnotationAssignment + `":null},"labels":{"` + api.LabelAssignedNode + `":null}}}`
	extenderWrites := []write{
		{"write a pod's assignment annotation and label", "", func() error {
			_, err := extender.CoreV1().Pods(team).Patch(ctx, pending.Name, types.MergePatchType, []byte(assign), metav1.PatchOptions{})
			return err
		}},
		{"remove them again", "", func() error {
			_, err := extender.CoreV1().Pods(team).Patch(ctx, pending.Name, types.MergePatchType, []byte(unassign), metav1.PatchOptions{})
			return err
		}},
		{"set another label on a pod", "policy", func() error {
			_, err := extender.CoreV1().Pods(team).Patch(ctx, pending.Name, types.MergePatchType, metaPatch("labels", "app", "x"), metav1.PatchOptions{})
			return err
		}},
		{"set another annotation on a pod", "policy", func() error {
			_, err := extender.CoreV1().Pods(team).Patch(ctx, pending.Name, types.MergePatchType, metaPatch("annotations", api.AnnotationPolicy, "spread"), metav1.PatchOptions{})
			return err
		}},
		{"change a pod's spec", "policy", func() error {
			_, err := extender.CoreV1().Pods(team).Patch(ctx, pending.Name, types.MergePatchType, []byte(`{"spec":{"activeDeadlineSeconds":5}}`), metav1.PatchOptions{})
			return err
		}},
		{"add a finalizer to a pod", "policy", func() error {
			_, err := extender.CoreV1().Pods(team).Patch(ctx, pending.Name, types.MergePatchType, []byte(`{"metadata":{"finalizers":["example.com/keep"]}}`), metav1.PatchOptions{})
			return err
		}},
		{"update a whole pod", "rbac", func() error {
			p, err := admin.CoreV1().Pods(team).Get(ctx, pending.Name, metav1.GetOptions{})
			if err != nil {
				return fmt.Errorf("admin get: %w", err)
			}
			_, err = extender.CoreV1().Pods(team).Update(ctx, p, metav1.UpdateOptions{})
			return err
		}},
		{"delete a pod", "rbac", func() error { return extender.CoreV1().Pods(team).Delete(ctx, work.Name, metav1.DeleteOptions{}) }},
		{"create a pod", "rbac", func() error {
			_, err := extender.CoreV1().Pods(team).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "made"},
				Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "main", Image: "registry.k8s.io/pause:3.10"}}}}, metav1.CreateOptions{})
			return err
		}},
		{"patch a Node", "rbac", func() error {
			_, err := extender.CoreV1().Nodes().Patch(ctx, "gpu-a", types.MergePatchType, metaPatch("labels", api.LabelPool, "pool-2"), metav1.PatchOptions{})
			return err
		}},
		{"take a bind Lease in its namespace", "", func() error {
			l, err := extender.CoordinationV1().Leases(ns).Create(ctx, testLease("tessera-bind-gpu-a"), metav1.CreateOptions{})
			if err != nil {
				return err
			}
			if l, err = extender.CoordinationV1().Leases(ns).Get(ctx, l.Name, metav1.GetOptions{}); err != nil {
				return err
			}
			_, err = extender.CoordinationV1().Leases(ns).Update(ctx, l, metav1.UpdateOptions{})
			return err
		}},
		{"write a node heartbeat Lease", "rbac", func() error {
			_, err := extender.CoordinationV1().Leases("kube-node-lease").Create(ctx, testLease("gpu-a"), metav1.CreateOptions{})
			return err
		}},
		{"write a kube-system leader Lease", "rbac", func() error {
			_, err := extender.CoordinationV1().Leases("kube-system").Create(ctx, testLease("kube-scheduler"), metav1.CreateOptions{})
			return err
		}},
		{"bind a pod", "", func() error {
			return extender.CoreV1().Pods(team).Bind(ctx, &corev1.Binding{ObjectMeta: metav1.ObjectMeta{Name: pending.Name, Namespace: team, UID: pending.UID},
				Target: corev1.ObjectReference{Kind: "Node", Name: "gpu-a"}}, metav1.CreateOptions{})
		}},
	}
	check := func(who string, writes []write) {
		for _, w := range writes {
			err := w.do()
			switch {
			case w.by == "" && err != nil:
				t.Errorf("%s: %s: refused, but the component needs it: %v", who, w.name, err)
			case w.by == "":
			case err == nil:
				t.Errorf("%s: %s: allowed; the API server must refuse it (by %s)", who, w.name, w.by)
			case !apierrors.IsForbidden(err):
				t.Errorf("%s: %s: failed, but not as Forbidden: %v", who, w.name, err)
			case w.by == "rbac" && !strings.Contains(err.Error(), "cannot"):
				t.Errorf("%s: %s: refused, but not by RBAC as expected: %v", who, w.name, err)
			case w.by == "policy" && !strings.Contains(err.Error(), "ValidatingAdmissionPolicy '"+release+"-"):
				t.Errorf("%s: %s: refused, but not by the chart's policy as expected: %v", who, w.name, err)
			default:
				t.Logf("%s: %s: refused: %v", who, w.name, err)
			}
		}
	}
	check("tessera-node", agentWrites)
	check("tessera-extender", extenderWrites)

	// The agent reads the claims it prepares.
	claimSpec := func(class string) *resourceapi.ResourceClaim {
		return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{GenerateName: "gpu-"},
			Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu",
				Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1}}}}}}
	}
	checkQuota(t, ctx, admin, team, release+"-dra", claimSpec)
	if _, err := admin.ResourceV1().ResourceClaims(unlimited).Create(ctx, claimSpec(classWhole), metav1.CreateOptions{}); err == nil ||
		!apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "insufficient quota") {
		t.Errorf("a claim in namespace %s, which no quota covers: %v, want refused for insufficient quota (limitedResources)", unlimited, err)
	} else {
		t.Logf("claim without a covering quota refused: %v", err)
	}
	claims, err := admin.ResourceV1().ResourceClaims(team).List(ctx, metav1.ListOptions{})
	must("list claims", err)
	if len(claims.Items) > 0 {
		if _, err := nodeAgent.ResourceV1().ResourceClaims(team).Get(ctx, claims.Items[0].Name, metav1.GetOptions{}); err != nil {
			t.Errorf("tessera-node cannot read a claim it would prepare: %v", err)
		}
	}
	// The extender (--dra-claims, on with DRA) lists and watches claims and their templates in every
	// namespace, and writes neither: only the scheduler's allocator writes an allocation.
	if _, err := extender.ResourceV1().ResourceClaims("").List(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("tessera-extender cannot list the claims it places: %v", err)
	}
	if _, err := extender.ResourceV1().ResourceClaimTemplates("").List(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("tessera-extender cannot list the claim templates it places: %v", err)
	}
	if len(claims.Items) > 0 {
		c := claims.Items[0].DeepCopy()
		c.Status.Allocation = &resourceapi.AllocationResult{}
		if _, err := extender.ResourceV1().ResourceClaims(team).UpdateStatus(ctx, c, metav1.UpdateOptions{}); err == nil || !apierrors.IsForbidden(err) {
			t.Errorf("tessera-extender writes a claim's allocation: %v, want refused by RBAC", err)
		}
	} else {
		t.Errorf("no claim in %s to probe the extender's writes with", team)
	}
}

// checkQuota: the chart's ResourceQuota (whole: 1 device, share: 0) refuses the claim past it. No
// controller manager runs, so the quota's status is initialised here as its controller would.
func checkQuota(t *testing.T, ctx context.Context, admin kubernetes.Interface, ns, name string, claim func(class string) *resourceapi.ResourceClaim) {
	t.Helper()
	q, err := admin.CoreV1().ResourceQuotas(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the chart's DRA quota for %s: %v", ns, err)
	}
	q.Status.Hard = q.Spec.Hard.DeepCopy()
	q.Status.Used = corev1.ResourceList{}
	for r := range q.Spec.Hard {
		q.Status.Used[r] = resource.MustParse("0")
	}
	if _, err := admin.CoreV1().ResourceQuotas(ns).UpdateStatus(ctx, q, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("initialise the quota's status: %v", err)
	}
	// Quota admission reads quotas from its informer: until it has seen the status just written it
	// answers "insufficient quota to consume" (no status yet), so only that answer is retried.
	var created error
	if err := waitFor(30*time.Second, 200*time.Millisecond, func() (bool, error) {
		_, created = admin.ResourceV1().ResourceClaims(ns).Create(ctx, claim(classWhole), metav1.CreateOptions{})
		if created != nil && strings.Contains(created.Error(), "insufficient quota to consume") {
			return false, created
		}
		return true, nil
	}); err != nil || created != nil {
		if err == nil {
			err = created
		}
		t.Errorf("the first whole-GPU claim, within the quota, was refused: %v", err)
	}
	for _, class := range []string{classWhole, classShare} {
		_, err := admin.ResourceV1().ResourceClaims(ns).Create(ctx, claim(class), metav1.CreateOptions{})
		if err == nil || !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "exceeded quota") {
			t.Errorf("a %s claim past the namespace's quota: %v, want refused for exceeded quota", class, err)
		} else {
			t.Logf("%s claim past the quota refused: %v", class, err)
		}
	}
}

// docsQuotaAdmission is the AdmissionConfiguration docs/dra.md gives operators (its yaml block of
// that kind), so the test runs what the documentation says.
func docsQuotaAdmission(t *testing.T) string {
	t.Helper()
	doc, err := os.ReadFile(filepath.Join(repoRoot(), "docs", "dra.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, block := range strings.Split(string(doc), "```yaml\n")[1:] {
		block, _, _ = strings.Cut(block, "```")
		if strings.Contains(block, "kind: AdmissionConfiguration") {
			return block
		}
	}
	t.Fatal("docs/dra.md has no yaml block with kind: AdmissionConfiguration (the quota admission configuration)")
	return ""
}

// saClient is a client with a token of ServiceAccount ns/sa from the TokenRequest API, bound to pod
// when given (the token then carries the pod's node, as the kubelet-projected one does).
func saClient(t *testing.T, cp *ControlPlane, ns, sa string, pod *corev1.Pod) *kubernetes.Clientset {
	t.Helper()
	req := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To(int64(3600))}}
	if pod != nil {
		req.Spec.BoundObjectRef = &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}
	}
	tok, err := cp.Client.CoreV1().ServiceAccounts(ns).CreateToken(context.Background(), sa, req, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("token for %s/%s: %v", ns, sa, err)
	}
	c, err := kubernetes.NewForConfig(&rest.Config{Host: cp.APIServerURL, BearerToken: tok.Status.Token,
		TLSClientConfig: rest.TLSClientConfig{CAFile: cp.PKI.CACert}})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// waitRefused waits until probe is refused as Forbidden (a new policy takes a moment to load).
func waitRefused(t *testing.T, what string, probe func() error) {
	t.Helper()
	var last error
	if err := waitFor(30*time.Second, 200*time.Millisecond, func() (bool, error) {
		last = probe()
		return apierrors.IsForbidden(last), nil
	}); err != nil {
		t.Fatalf("%s never refused its probe (last answer: %v)", what, last)
	}
}

func metaPatch(field, key, value string) []byte {
	return []byte(fmt.Sprintf(`{"metadata":{%q:{%q:%q}}}`, field, key, value))
}

func testSlice(name, node, driver string) *resourceapi.ResourceSlice {
	return &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: resourceapi.ResourceSliceSpec{Driver: driver, NodeName: &node,
			Pool:    resourceapi.ResourcePool{Name: node, ResourceSliceCount: 1},
			Devices: []resourceapi.Device{{Name: "gpu-0"}}}}
}

func testLease(name string) *coordinationv1.Lease {
	holder := "tessera-e2e"
	return &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: coordinationv1.LeaseSpec{HolderIdentity: &holder}}
}
