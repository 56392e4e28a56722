package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/dra"
	"github.com/tessera-gpu/tessera/internal/gpu"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// injectXIDs raises XID 79 on the simulated GPU every few seconds, as a GPU that keeps failing
// does (one XID would recover after a health-check interval), until the returned stop is called.
func (c *Cluster) injectXIDs(t *testing.T, uuid string) (stop func()) {
	t.Helper()
	dir := gpu.FaultsDir(c.simStateDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		for {
			if err := os.WriteFile(filepath.Join(dir, "xid-"+uuid), []byte("79"), 0o600); err != nil {
				t.Errorf("write the fault file: %v", err)
				return
			}
			select {
			case <-done:
				return
			case <-time.After(3 * time.Second):
			}
		}
	}()
	var once bool
	return func() {
		if !once {
			once = true
			close(done)
			<-stopped
			os.Remove(filepath.Join(dir, "xid-"+uuid))
		}
	}
}

// deviceTaints are the taints of one device in the node's slices.
func (c *Cluster) deviceTaints(t *testing.T, device string) []string {
	t.Helper()
	l, err := c.CP.Client.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{FieldSelector: resourceapi.ResourceSliceSelectorDriver + "=" + api.DRADriverName})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, s := range l.Items {
		for _, d := range s.Spec.Devices {
			if d.Name == device && s.Spec.NodeName != nil && *s.Spec.NodeName == c.Node {
				for _, tn := range d.Taints {
					out = append(out, tn.Key+":"+string(tn.Effect))
				}
			}
		}
	}
	return out
}

// podClaimHealth is what the pod's status says of the health of its claim "gpu"
// and why (allocatedResourcesStatus "claim:gpu", filled by the kubelet from the driver's health
// stream; the kubelet names each device by its first CDI device ID), "" when it says nothing.
func podClaimHealth(p *corev1.Pod) string {
	for _, cs := range p.Status.ContainerStatuses {
		for _, rs := range cs.AllocatedResourcesStatus {
			if rs.Name == "claim:gpu" && len(rs.Resources) > 0 {
				h := rs.Resources[0]
				return strings.TrimSpace(string(h.Health) + " " + ptr.Deref(h.Message, ""))
			}
		}
	}
	return ""
}

// testDRAHealth: a GPU that keeps raising XID 79 under a running claim pod is tainted in the slice
// (NoSchedule), the running pod keeps running and its status shows the device unhealthy (the
// kubelet's DRA health stream), and a new claim that can only use that GPU is not allocated; when
// the XIDs stop, the GPU recovers: the taint goes, the pod's status says healthy, and the waiting
// claim is allocated the GPU and runs.
func testDRAHealth(t *testing.T, c *Cluster) {
	c.CreateClaimTemplate(t, "share-10g-30", classShare, map[string]string{"memory": "10Gi", "compute": "30"}, "")
	c.CreatePod(t, ClaimPod("h-run", "share-10g-30"))
	c.WaitRunning(t, 3*time.Minute, "h-run")
	dev := allocatedDevice(t, c.PodClaim(t, "h-run")).Device
	entries := claimEntries(t, c)
	if len(entries) != 1 || len(entries[0].Devices) != 1 {
		t.Fatalf("ledger: want one claim holding one share:\n%s", c.Ledger(t))
	}
	uuid := entries[0].Devices[0].UUID
	t.Logf("before the XIDs the pod's status says %q of its claim", podClaimHealth(c.Pod(t, "h-run")))

	stop := c.injectXIDs(t, uuid)
	defer stop()
	wait := func(what string, timeout time.Duration, cond func() (bool, error)) {
		t.Helper()
		if err := waitFor(timeout, time.Second, cond); err != nil {
			t.Fatalf("%s: %v\n%s", what, err, c.Agent.LogTail(30))
		}
	}
	wait("taint on the failing GPU", 2*time.Minute, func() (bool, error) {
		got := c.deviceTaints(t, dev)
		return slices.Equal(got, []string{dra.TaintUnhealthy + ":NoSchedule"}), fmt.Errorf("%s taints %v", dev, got)
	})
	wait("the running pod's status shows the device unhealthy", 2*time.Minute, func() (bool, error) {
		got := podClaimHealth(c.Pod(t, "h-run"))
		return got == string(corev1.ResourceHealthStatusUnhealthy)+" XID 79", fmt.Errorf("h-run's status says %q of its claim: %+v", got, c.Pod(t, "h-run").Status.ContainerStatuses)
	})
	if p := c.Pod(t, "h-run"); p.Status.Phase != corev1.PodRunning {
		t.Errorf("h-run is %s under a NoSchedule taint, want Running", p.Status.Phase)
	}
	// A new claim that fits only on that GPU waits.
	c.CreateClaimTemplate(t, "pinned-sick", classShare, map[string]string{"memory": "10Gi", "compute": "30"},
		fmt.Sprintf(`device.attributes["gpu.tessera.dev"].uuid == %q`, uuid))
	c.CreatePod(t, ClaimPod("h-new", "pinned-sick"))
	msg := c.WaitUnschedulable(t, "h-new", "cannot allocate all claims")
	t.Logf("h-new while %s is tainted: %s", dev, msg)

	stop()
	wait("taint gone after recovery", 3*time.Minute, func() (bool, error) {
		got := c.deviceTaints(t, dev)
		return len(got) == 0, fmt.Errorf("%s taints %v", dev, got)
	})
	wait("the running pod's status shows the device healthy again", 2*time.Minute, func() (bool, error) {
		got := podClaimHealth(c.Pod(t, "h-run"))
		return got == string(corev1.ResourceHealthStatusHealthy), fmt.Errorf("h-run's status says %q of its claim", got)
	})
	c.WaitRunning(t, 3*time.Minute, "h-new")
	if d := allocatedDevice(t, c.PodClaim(t, "h-new")).Device; d != dev {
		t.Errorf("h-new got %s, want the recovered %s", d, dev)
	}
}

// adminAccessLabel is the namespace label the API server requires of claims with admin access.
const adminAccessLabel = "resource.kubernetes.io/admin-access"

// testDRAAdminAccess: a monitoring claim with admin access is refused by the API server in a
// namespace without the admin-access label; with it, the monitoring pod gets a GPU's device node,
// no vcuda, and no charge in the ledger: the device plugins still offer that GPU whole and shared.
func testDRAAdminAccess(t *testing.T, c *Cluster) {
	ctx := context.Background()
	template := func(name, uuid string) *resourceapi.ResourceClaimTemplate {
		req := &resourceapi.ExactDeviceRequest{DeviceClassName: classWhole, AdminAccess: ptr.To(true)}
		if uuid != "" {
			req.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: fmt.Sprintf(`device.attributes["gpu.tessera.dev"].uuid == %q`, uuid)}}}
		}
		return &resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: metav1.NamespaceDefault},
			Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
				Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: req}}}}}}
	}
	_, err := c.CP.Client.ResourceV1().ResourceClaimTemplates(metav1.NamespaceDefault).Create(ctx, template("monitor-unlabelled", ""), metav1.CreateOptions{})
	if err == nil || !strings.Contains(err.Error(), adminAccessLabel) {
		t.Fatalf("an admin-access template in a namespace without %s: %v, want a refusal naming the label", adminAccessLabel, err)
	}
	setLabel := func(value *string) {
		patch := `{"metadata":{"labels":{"` + adminAccessLabel + `":null}}}`
		if value != nil {
			patch = `{"metadata":{"labels":{"` + adminAccessLabel + `":"` + *value + `"}}}`
		}
		if out, err := c.Kubectl(t, "patch", "namespace", metav1.NamespaceDefault, "--type=merge", "-p", patch); err != nil {
			t.Fatalf("label the namespace: %v\n%s", err, out)
		}
	}
	c.CreateClaimTemplate(t, "whole", classWhole, nil, "")
	c.CreatePod(t, ClaimPod("aa-whole", "whole"))
	c.WaitRunning(t, 3*time.Minute, "aa-whole")
	held := claimEntries(t, c)
	if len(held) != 1 || len(held[0].Devices) != 1 {
		t.Fatalf("ledger: want one whole claim:\n%s", c.Ledger(t))
	}
	uuid := held[0].Devices[0].UUID
	before := c.Ledger(t)

	// The monitor watches another GPU: the 1.37.2 scheduler does not allocate an admin-access
	// request on a GPU whose capacity a claim consumes (seen here: "cannot allocate all claims").
	watched := ""
	for _, g := range c.Inventory.GPUs {
		if g.Shareable() && g.UUID != uuid && watched == "" {
			watched = g.UUID
		}
	}
	setLabel(ptr.To("true"))
	defer setLabel(nil)
	if _, err := c.CP.Client.ResourceV1().ResourceClaimTemplates(metav1.NamespaceDefault).Create(ctx, template("monitor", watched), metav1.CreateOptions{}); err != nil {
		t.Fatalf("an admin-access template in a labelled namespace: %v", err)
	}
	defer c.CP.Client.ResourceV1().ResourceClaimTemplates(metav1.NamespaceDefault).Delete(ctx, "monitor", metav1.DeleteOptions{})

	mon := ClaimPod("aa-monitor", "monitor")
	c.CreatePod(t, mon)
	c.WaitRunning(t, 3*time.Minute, "aa-monitor")
	var monEntry *ledger.Entry
	for _, e := range claimEntries(t, c) {
		if e.Claim != nil && len(e.Claim.AdminAccess) > 0 {
			monEntry = e
		}
	}
	if monEntry == nil || len(monEntry.Devices) != 0 || len(monEntry.MIG) != 0 || !slices.Equal(monEntry.Claim.AdminAccess, []string{watched}) {
		t.Fatalf("ledger: want the monitoring claim with admin access to %s and holding nothing:\nbefore %s\nafter  %s", watched, before, c.Ledger(t))
	}
	// The container gets the GPU's device node and no vcuda.
	out := c.MustExec(t, "aa-monitor", "ls /dev; test -e /etc/ld.so.preload && echo PRELOAD; cudaprobe info")
	if n := deviceNodes(out); len(n) != 1 || strings.Contains(out, "PRELOAD") {
		t.Errorf("monitoring container: GPU nodes %v, preload present=%v, want one GPU and no vcuda:\n%s", n, strings.Contains(out, "PRELOAD"), out)
	}
	// Nothing is charged: the device plugins offer exactly what they offered with the whole claim
	// alone (the watched GPU whole and its shares included).
	c.WaitAllocatable(t, map[string]int64{api.ResourceGPU: SimWholeGPUs - 1, api.ResourceShare: SimShares - 10})
}
