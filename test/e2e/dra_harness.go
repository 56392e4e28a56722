package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
	api "github.com/tessera-gpu/tessera/api/v1"
)

// draAgentConfig writes the agent's config file turning on its DRA kubelet plugin, registered with
// this cluster's kubelet (its own --root-dir); "" when the cluster runs without DRA.
func (c *Cluster) draAgentConfig(t testing.TB) string {
	t.Helper()
	if !c.dra {
		return ""
	}
	path := filepath.Join(c.Dir, "agent-dra.yaml")
	cfg := fmt.Sprintf("apiVersion: %s\nkind: %s\ndra: true\ndraRegistrarDir: %s\ndraPluginDir: %s\n", api.Version, configv1.KindNodeConfig,
		filepath.Join(c.Kubelet.RootDir, "plugins_registry"), filepath.Join(c.Kubelet.RootDir, "plugins", api.DRADriverName))
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// applyDRAChart applies the chart's DRA parts as helm renders them: the agent's RBAC for
// ResourceSlices and claims, and the DeviceClasses the tests' claims name.
func (c *Cluster) applyDRAChart(t testing.TB) {
	t.Helper()
	if !c.dra {
		return
	}
	manifest, err := helm(t, "template", "tessera", helmChart(), "--namespace", agentNamespace,
		"--show-only", "templates/dra.yaml", "--show-only", "templates/deviceclasses.yaml")
	if err != nil {
		t.Fatalf("helm template the DRA parts: %v\n%s", err, manifest)
	}
	if out, err := runStdin(t, time.Minute, manifest, tool(t, "kubectl"), "--kubeconfig", c.CP.Kubeconfig, "apply", "-f", "-"); err != nil {
		t.Fatalf("apply the chart's DRA RBAC and DeviceClasses: %v\n%s", err, out)
	}
}

// WaitResourceSlices waits until the node's slices of the Tessera driver list want devices, and
// returns them by name.
func (c *Cluster) WaitResourceSlices(t testing.TB, want int) map[string]resourceapi.Device {
	t.Helper()
	var got map[string]resourceapi.Device
	err := waitFor(time.Minute, 300*time.Millisecond, func() (bool, error) {
		l, err := c.CP.Client.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{FieldSelector: resourceapi.ResourceSliceSelectorDriver + "=" + api.DRADriverName})
		if err != nil {
			return false, err
		}
		got = map[string]resourceapi.Device{}
		for _, s := range l.Items {
			if s.Spec.NodeName == nil || *s.Spec.NodeName != c.Node {
				continue
			}
			for _, d := range s.Spec.Devices {
				got[d.Name] = d
			}
		}
		if len(got) != want {
			return false, fmt.Errorf("%d devices in the node's ResourceSlices, want %d", len(got), want)
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("%v\n%s", err, c.Agent.LogTail(30))
	}
	return got
}

// CreateClaimTemplate creates a ResourceClaimTemplate of the default namespace with one request of
// a Tessera DeviceClass, optionally asking for capacity and filtered by a CEL selector.
func (c *Cluster) CreateClaimTemplate(t testing.TB, name, class string, capacity map[string]string, selector string) {
	t.Helper()
	req := resourceapi.ExactDeviceRequest{DeviceClassName: class}
	if len(capacity) > 0 {
		req.Capacity = &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{}}
		for k, v := range capacity {
			req.Capacity.Requests[resourceapi.QualifiedName(k)] = resource.MustParse(v)
		}
	}
	if selector != "" {
		req.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: selector}}}
	}
	rct := &resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: metav1.NamespaceDefault},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &req}}}}}}
	_, err := c.CP.Client.ResourceV1().ResourceClaimTemplates(metav1.NamespaceDefault).Create(context.Background(), rct, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("create ResourceClaimTemplate %s: %v", name, err)
	}
}

// ClaimPod is TestPod whose container uses one claim made from the template.
func ClaimPod(name, template string) *corev1.Pod {
	p := TestPod(name, nil, nil)
	p.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: &template}}
	p.Spec.Containers[0].Resources.Claims = []corev1.ResourceClaim{{Name: "gpu"}}
	return p
}

// PodClaim returns the claim the pod's template made (once it exists).
func (c *Cluster) PodClaim(t testing.TB, pod string) *resourceapi.ResourceClaim {
	t.Helper()
	var claim *resourceapi.ResourceClaim
	err := waitFor(time.Minute, 200*time.Millisecond, func() (bool, error) {
		p, err := c.CP.Client.CoreV1().Pods(metav1.NamespaceDefault).Get(context.Background(), pod, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, s := range p.Status.ResourceClaimStatuses {
			if s.ResourceClaimName == nil {
				continue
			}
			claim, err = c.CP.Client.ResourceV1().ResourceClaims(metav1.NamespaceDefault).Get(context.Background(), *s.ResourceClaimName, metav1.GetOptions{})
			return err == nil, err
		}
		return false, fmt.Errorf("pod %s has no claim yet", pod)
	})
	if err != nil {
		t.Fatalf("%v\n%s", err, c.Describe(t, pod))
	}
	return claim
}

// allocatedDevice is the one device of a claim's allocation.
func allocatedDevice(t testing.TB, claim *resourceapi.ResourceClaim) resourceapi.DeviceRequestAllocationResult {
	t.Helper()
	if claim.Status.Allocation == nil || len(claim.Status.Allocation.Devices.Results) != 1 {
		t.Fatalf("claim %s: allocation %+v, want one device", claim.Name, claim.Status.Allocation)
	}
	return claim.Status.Allocation.Devices.Results[0]
}

// WaitClaimsGone waits until the default namespace has no ResourceClaims (the resourceclaim
// controller deletes a template's claim with its pod).
func (c *Cluster) WaitClaimsGone(t testing.TB) {
	t.Helper()
	err := waitFor(2*time.Minute, 300*time.Millisecond, func() (bool, error) {
		l, err := c.CP.Client.ResourceV1().ResourceClaims(metav1.NamespaceDefault).List(context.Background(), metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		var left []string
		for _, cl := range l.Items {
			left = append(left, cl.Name)
		}
		if len(left) > 0 {
			return false, fmt.Errorf("claims left: %s", strings.Join(left, ", "))
		}
		return true, nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
