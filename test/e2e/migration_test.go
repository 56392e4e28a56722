package e2e

import (
	"context"
	"fmt"
	"maps"
	"regexp"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	sigyaml "sigs.k8s.io/yaml"
)

// migrationPod is a pod manifest as a HAMi, GPUManager or Alibaba gpushare user writes it: limits
// only (the API server defaults requests from them), the default scheduler.
func migrationPod(t *testing.T, name, containers string) *corev1.Pod {
	t.Helper()
	var p corev1.Pod
	doc := "apiVersion: v1\nkind: Pod\nmetadata:\n  name: " + name + "\nspec:\n" + containers
	if err := sigyaml.UnmarshalStrict([]byte(doc), &p); err != nil {
		t.Fatalf("%s: %v\n%s", name, err, doc)
	}
	return &p
}

// limitsOnly is one container "main" with these limits.
func limitsOnly(limits string) string {
	return "  containers:\n  - name: main\n    image: registry.k8s.io/pause:3.10\n    resources:\n      limits:\n" + limits
}

// TestMigrationAdmission installs the chart on a real kube-apiserver (1.37.2, which serves
// admissionregistration.k8s.io/v1 MutatingAdmissionPolicy) and creates pods written for HAMi,
// GPUManager and Alibaba gpushare, unchanged: the stored pod asks for Tessera's resources (requests
// and limits alike) with the numbers docs/migration.md's table gives, under Tessera's scheduler; a
// pod on Tessera's resources already keeps them; what cannot be translated exactly is refused with
// its reason. A namespace's ResourceQuota on Tessera's resources counts translated pods (quota
// admission runs after the mutation), so a peer's names are no way around it.
func TestMigrationAdmission(t *testing.T) {
	// Fail closed at render: gpushare's memory unit is GiB or MiB, nothing else is guessed.
	if out, err := helm(t, "template", "tessera", helmChart(), "--api-versions", "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy",
		"--set", "admission.migration.alibabaMemoryUnit=GB"); err == nil || !strings.Contains(out, "alibabaMemoryUnit") {
		t.Errorf("admission.migration.alibabaMemoryUnit=GB rendered (want an error naming the value): %v\n%s", err, out)
	}
	cp := StartControlPlane(t, ControlPlaneOptions{NoScheduler: true})
	const ns, release, team = "tessera-system", "tessera", "team-a"
	for _, n := range []string{ns, team} {
		cp.CreateNamespace(t, n)
	}
	if out, err := helm(t, "install", release, helmChart(), "--kubeconfig", cp.Kubeconfig, "--namespace", ns); err != nil {
		t.Fatalf("helm install: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	pods := cp.Client.CoreV1().Pods(team)
	create := func(p *corev1.Pod, dry bool) (*corev1.Pod, error) {
		opts := metav1.CreateOptions{}
		if dry {
			opts.DryRun = []string{metav1.DryRunAll}
		}
		return pods.Create(ctx, p, opts)
	}

	waitMigrationPolicies(t, ctx, pods)

	const scheduler = "tessera-scheduler"
	translated := []struct {
		name, spec string
		want       map[string]string // the container's limits (and requests) after admission
		scheduler  string
	}{
		{"hami-share", limitsOnly("        nvidia.com/gpu: 1\n        nvidia.com/gpumem: 3000\n        nvidia.com/gpucores: 30\n"),
			map[string]string{"tessera.dev/vgpu": "1", "tessera.dev/vgpu-memory": "3145728000", "tessera.dev/vgpu-cores": "30"}, scheduler},
		{"hami-percent-two", limitsOnly("        nvidia.com/gpu: 2\n        nvidia.com/gpumem-percentage: 50\n"),
			map[string]string{"tessera.dev/vgpu": "2", "tessera.dev/vgpu-memory-percent": "50"}, scheduler},
		// gpucores 0 is HAMi's "no compute limit", Tessera's omitted cores; no memory: HAMi's
		// default of the whole GPU's memory.
		{"hami-cores-zero", limitsOnly("        nvidia.com/gpu: 1\n        nvidia.com/gpucores: 0\n"),
			map[string]string{"tessera.dev/vgpu": "1", "tessera.dev/vgpu-memory-percent": "100"}, scheduler},
		// No nvidia.com/gpu: HAMi's default count of 1.
		{"hami-no-count", limitsOnly("        nvidia.com/gpumem: 2048\n"),
			map[string]string{"tessera.dev/vgpu": "1", "tessera.dev/vgpu-memory": "2147483648"}, scheduler},
		{"gpumanager-share", limitsOnly("        tencent.com/vcuda-core: 50\n        tencent.com/vcuda-memory: 16\n"),
			map[string]string{"tessera.dev/vgpu": "1", "tessera.dev/vgpu-memory": "4294967296", "tessera.dev/vgpu-cores": "50"}, scheduler},
		{"gpumanager-whole", limitsOnly("        tencent.com/vcuda-core: 200\n        tencent.com/vcuda-memory: 64\n"),
			map[string]string{"nvidia.com/gpu": "2"}, scheduler},
		{"alibaba", limitsOnly("        aliyun.com/gpu-mem: 3\n"),
			map[string]string{"tessera.dev/vgpu": "1", "tessera.dev/vgpu-memory": "3221225472"}, scheduler},
		// Other resources stay as they are (cpu's request below its limit included).
		{"hami-with-cpu", "  containers:\n  - name: main\n    image: registry.k8s.io/pause:3.10\n    resources:\n      requests:\n        cpu: 100m\n      limits:\n        cpu: \"1\"\n        nvidia.com/gpumem: 1024\n",
			map[string]string{"cpu": "1", "tessera.dev/vgpu": "1", "tessera.dev/vgpu-memory": "1073741824"}, scheduler},
		// A pod naming another scheduler keeps it; its resources are still translated.
		{"hami-own-scheduler", "  schedulerName: volcano\n" + limitsOnly("        nvidia.com/gpumem: 1024\n"),
			map[string]string{"tessera.dev/vgpu": "1", "tessera.dev/vgpu-memory": "1073741824"}, "volcano"},
		// Exported from a HAMi cluster, where HAMi's webhook wrote its scheduler's name.
		{"hami-exported", "  schedulerName: hami-scheduler\n" + limitsOnly("        nvidia.com/gpumem: 1024\n"),
			map[string]string{"tessera.dev/vgpu": "1", "tessera.dev/vgpu-memory": "1073741824"}, scheduler},
		// Already Tessera's: resources untouched, Tessera's scheduler.
		{"tessera-share", limitsOnly("        tessera.dev/vgpu: 1\n        tessera.dev/vgpu-memory: 10Gi\n        tessera.dev/vgpu-cores: 30\n"),
			map[string]string{"tessera.dev/vgpu": "1", "tessera.dev/vgpu-memory": "10Gi", "tessera.dev/vgpu-cores": "30"}, scheduler},
		{"tessera-whole", limitsOnly("        nvidia.com/gpu: 1\n"),
			map[string]string{"nvidia.com/gpu": "1"}, scheduler},
		// No GPU: nothing changes.
		{"no-gpu", limitsOnly("        cpu: \"1\"\n"), map[string]string{"cpu": "1"}, "default-scheduler"},
	}
	for _, tc := range translated {
		p, err := create(migrationPod(t, tc.name, tc.spec), false)
		if err != nil {
			t.Errorf("%s: created as its users write it, refused: %v", tc.name, err)
			continue
		}
		c := p.Spec.Containers[0].Resources
		if !sameQuantities(c.Limits, tc.want) {
			t.Errorf("%s: stored limits %v, want %v", tc.name, showQuantities(c.Limits), tc.want)
		}
		wantReq := maps.Clone(tc.want)
		if tc.name == "hami-with-cpu" {
			wantReq["cpu"] = "100m"
		}
		if !sameQuantities(c.Requests, wantReq) {
			t.Errorf("%s: stored requests %v, want %v", tc.name, showQuantities(c.Requests), wantReq)
		}
		if p.Spec.SchedulerName != tc.scheduler {
			t.Errorf("%s: schedulerName %q, want %q", tc.name, p.Spec.SchedulerName, tc.scheduler)
		}
	}

	// Two containers, two projects' pods at once: each translated on its own, by index.
	two := migrationPod(t, "two-containers", "  containers:\n  - name: a\n    image: registry.k8s.io/pause:3.10\n"+
		"  - name: b\n    image: registry.k8s.io/pause:3.10\n    resources:\n      limits:\n        tencent.com/vcuda-core: 25\n        tencent.com/vcuda-memory: 4\n"+
		"  - name: c\n    image: registry.k8s.io/pause:3.10\n    resources:\n      limits:\n        aliyun.com/gpu-mem: 1\n")
	if p, err := create(two, false); err != nil {
		t.Errorf("two-containers: refused: %v", err)
	} else {
		want := []map[string]string{{}, {"tessera.dev/vgpu": "1", "tessera.dev/vgpu-memory": "1073741824", "tessera.dev/vgpu-cores": "25"},
			{"tessera.dev/vgpu": "1", "tessera.dev/vgpu-memory": "1073741824"}}
		for i, c := range p.Spec.Containers {
			if !sameQuantities(c.Resources.Limits, want[i]) {
				t.Errorf("two-containers: container %s limits %v, want %v", c.Name, showQuantities(c.Resources.Limits), want[i])
			}
		}
	}

	// by: the migration policy, or the API server's own validation (after a mutation that, by design,
	// left the pod alone: translating it would have changed what it asks for).
	const byPolicy, byAPI = "policy", "api"
	refused := []struct{ name, spec, reason, by string }{
		{"hami-both-memory", limitsOnly("        nvidia.com/gpumem: 1024\n        nvidia.com/gpumem-percentage: 50\n"), "are both set", byPolicy},
		{"hami-gpumem-suffix", limitsOnly("        nvidia.com/gpumem: 3Gi\n"), "nvidia.com/gpumem counts MiB per GPU", byPolicy},
		{"hami-fraction", limitsOnly("        nvidia.com/gpumem: 1.5\n"), "must be an integer", byAPI},
		{"hami-percent-over", limitsOnly("        nvidia.com/gpumem-percentage: 150\n"), "must be 1 to 100", byPolicy},
		{"hami-cores-over", limitsOnly("        nvidia.com/gpucores: 101\n"), "nvidia.com/gpucores is a percent", byPolicy},
		{"hami-zero-count", limitsOnly("        nvidia.com/gpu: 0\n        nvidia.com/gpumem: 1024\n"), "nvidia.com/gpu is 0", byPolicy},
		{"hami-priority", limitsOnly("        nvidia.com/gpumem: 1024\n        nvidia.com/priority: 1\n"), "nvidia.com/priority", byPolicy},
		{"hami-and-tessera", limitsOnly("        nvidia.com/gpumem: 1024\n        tessera.dev/vgpu: 1\n"), "asks for Tessera's resources and HAMi's at once", byPolicy},
		{"gpumanager-and-whole", limitsOnly("        tencent.com/vcuda-core: 50\n        tencent.com/vcuda-memory: 4\n        nvidia.com/gpu: 1\n"), "Tessera's resources and GPUManager's at once", byPolicy},
		{"gpumanager-150", limitsOnly("        tencent.com/vcuda-core: 150\n        tencent.com/vcuda-memory: 4\n"), "must be a multiple of 100", byPolicy},
		{"gpumanager-no-memory", limitsOnly("        tencent.com/vcuda-core: 50\n"), "needs tencent.com/vcuda-memory", byPolicy},
		{"gpumanager-memory-only", limitsOnly("        tencent.com/vcuda-memory: 4\n"), "without tencent.com/vcuda-core", byPolicy},
		{"alibaba-count", limitsOnly("        aliyun.com/gpu-mem: 4\n        aliyun.com/gpu-count: 2\n"), "aliyun.com/gpu-count", byPolicy},
		{"alibaba-huge", limitsOnly("        aliyun.com/gpu-mem: 4096\n"), "aliyun.com/gpu-mem counts GiB", byPolicy},
		{"two-projects", limitsOnly("        nvidia.com/gpumem: 1024\n        aliyun.com/gpu-mem: 4\n"), "mixes the resources of HAMi and Alibaba gpushare", byPolicy},
		{"requests-differ", "  containers:\n  - name: main\n    image: registry.k8s.io/pause:3.10\n    resources:\n      requests:\n        nvidia.com/gpumem: 1024\n      limits:\n        nvidia.com/gpumem: 2048\n", "must be equal to nvidia.com/gpumem limit", byAPI},
		{"init-share", "  initContainers:\n  - name: init\n    image: registry.k8s.io/pause:3.10\n    resources:\n      limits:\n        nvidia.com/gpumem: 1024\n" + limitsOnly("        cpu: \"1\"\n"), "init containers init ask for GPU shares", byPolicy},
	}
	for _, tc := range refused {
		_, err := create(migrationPod(t, tc.name, tc.spec), false)
		switch {
		case err == nil:
			t.Errorf("%s: admitted, want refused (%q)", tc.name, tc.reason)
		case !apierrors.IsInvalid(err) || strings.Contains(err.Error(), release+"-migration") != (tc.by == byPolicy) || !strings.Contains(err.Error(), tc.reason):
			t.Errorf("%s: refused with %v, want refused by the %s with a reason containing %q", tc.name, err, tc.by, tc.reason)
		}
	}

	// Quota on Tessera's resources counts translated pods: one share allowed, the second HAMi pod is
	// refused by quota, not admitted under a name the quota does not cover.
	quota := &corev1.ResourceQuota{ObjectMeta: metav1.ObjectMeta{Name: "shares"},
		Spec: corev1.ResourceQuotaSpec{Hard: corev1.ResourceList{"requests.tessera.dev/vgpu": resource.MustParse("1")}}}
	const quotaNS = "team-quota"
	cp.CreateNamespace(t, quotaNS)
	if _, err := cp.Client.CoreV1().ResourceQuotas(quotaNS).Create(ctx, quota, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	qpods := cp.Client.CoreV1().Pods(quotaNS)
	hami := func(name string) *corev1.Pod {
		return migrationPod(t, name, limitsOnly("        nvidia.com/gpu: 1\n        nvidia.com/gpumem: 1024\n"))
	}
	// Quota's status is computed asynchronously by the controller manager, which this control plane
	// does not run; the quota admission counts from status.used, so fill it in as the controller would.
	quota, err := cp.Client.CoreV1().ResourceQuotas(quotaNS).Get(ctx, quota.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	quota.Status = corev1.ResourceQuotaStatus{Hard: quota.Spec.Hard, Used: corev1.ResourceList{"requests.tessera.dev/vgpu": resource.MustParse("0")}}
	if _, err := cp.Client.CoreV1().ResourceQuotas(quotaNS).UpdateStatus(ctx, quota, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := qpods.Create(ctx, hami("first"), metav1.CreateOptions{}); err != nil {
		t.Fatalf("the first HAMi pod, within the quota of one share, refused: %v", err)
	}
	if _, err := qpods.Create(ctx, hami("second"), metav1.CreateOptions{}); err == nil || !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "exceeded quota") {
		t.Errorf("the second HAMi pod, past the namespace's quota of one tessera.dev/vgpu, got %v; want refused by quota", err)
	}
}

// sameQuantities reports whether l holds exactly the quantities of want (by value: the API server
// stores 3145728000 as 3145728k).
func sameQuantities(l corev1.ResourceList, want map[string]string) bool {
	if len(l) != len(want) {
		return false
	}
	for k, v := range want {
		got, ok := l[corev1.ResourceName(k)]
		if !ok || got.Cmp(resource.MustParse(v)) != 0 {
			return false
		}
	}
	return true
}

// showQuantities renders a ResourceList for a message.
func showQuantities(l corev1.ResourceList) map[string]string {
	out := map[string]string{}
	for k, v := range l {
		out[string(k)] = v.String()
	}
	return out
}

// waitMigrationPolicies waits until both migration policies are loaded (they load asynchronously):
// a HAMi pod comes back translated from a dry run, and an untranslatable one is refused.
func waitMigrationPolicies(t *testing.T, ctx context.Context, pods typedcorev1.PodInterface) {
	t.Helper()
	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	probe := migrationPod(t, "probe", limitsOnly("        nvidia.com/gpumem: 1024\n"))
	var last corev1.ResourceList
	if err := waitFor(30*time.Second, 200*time.Millisecond, func() (bool, error) {
		p, err := pods.Create(ctx, probe, dry)
		if err != nil {
			return false, err
		}
		last = p.Spec.Containers[0].Resources.Limits
		_, ok := last["tessera.dev/vgpu"]
		return ok, nil
	}); err != nil {
		t.Fatalf("the migration policy never translated a HAMi pod: %v (last limits: %v)", err, showQuantities(last))
	}
	refusal := migrationPod(t, "probe", limitsOnly("        tencent.com/vcuda-memory: 4\n"))
	if err := waitFor(30*time.Second, 200*time.Millisecond, func() (bool, error) {
		_, err := pods.Create(ctx, refusal, dry)
		return apierrors.IsInvalid(err), err
	}); err != nil {
		t.Fatalf("the migration policy never refused an untranslatable pod: %v", err)
	}
}

// testClusterMigration (a TestCluster step) runs pods written for HAMi, GPUManager and Alibaba
// gpushare, unchanged, on the real node: the chart's migration policies (applied on their own; the
// cluster's scheduler is the default one, so setScheduler is off) translate them, and CUDA in each
// container reports the cap the peer's request means, which vcuda enforces (checkShareCUDA); the
// compute cap reaches the limits file.
func testClusterMigration(t *testing.T, c *Cluster) {
	manifest, err := helm(t, "template", "tessera", helmChart(), "--show-only", "templates/admission-migration.yaml",
		"--api-versions", "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy", "--set", "admission.migration.setScheduler=false")
	if err != nil {
		t.Fatalf("helm template: %v\n%s", err, manifest)
	}
	if out, err := c.KubectlStdin(t, manifest, "apply", "-f", "-"); err != nil {
		t.Fatalf("kubectl apply the migration policies: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		if out, err := c.KubectlStdin(t, manifest, "delete", "-f", "-"); err != nil {
			t.Errorf("kubectl delete the migration policies: %v\n%s", err, out)
		}
	})
	ctx := context.Background()
	waitMigrationPolicies(t, ctx, c.CP.Client.CoreV1().Pods(metav1.NamespaceDefault))
	peers := []struct {
		name   string
		limits map[string]string
		mem    int64
		cores  int
	}{
		{"hami", map[string]string{"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "30"}, 3000 << 20, 30},
		{"gpumanager", map[string]string{"tencent.com/vcuda-core": "20", "tencent.com/vcuda-memory": "8"}, 8 * 256 << 20, 20},
		{"alibaba", map[string]string{"aliyun.com/gpu-mem": "1"}, 1 << 30, 100}, // no compute cap: 100 in the limits file
	}
	var names []string
	for _, p := range peers {
		c.CreatePod(t, TestPod(p.name, p.limits, nil))
		names = append(names, p.name)
	}
	c.WaitRunning(t, 3*time.Minute, names...)
	for _, p := range peers {
		out := c.MustExec(t, p.name, "cat /etc/tessera/vcuda/limits")
		if !regexp.MustCompile(fmt.Sprintf(`(?m)^gpu \S+ %d %d$`, p.mem, p.cores)).MatchString(out) {
			t.Errorf("%s: the limits file is not one GPU at %d bytes, %d%% compute:\n%s", p.name, p.mem, p.cores, out)
		}
		checkShareCUDA(t, c, p.name, p.mem)
	}
}
