package e2e

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// TestControlPlane checks the harness itself: the upstream control plane comes up on loopback, the
// default scheduler binds a pod to an API-made node, the scheduler can be restarted mid-test, a
// minted kubelet identity is subject to the Node authorizer, kube-controller-manager runs its
// controllers, and teardown leaves no process behind.
func TestControlPlane(t *testing.T) {
	var pids []int
	t.Run("stack", func(t *testing.T) {
		cp := StartControlPlane(t, ControlPlaneOptions{ControllerManager: true})
		ctx := context.Background()
		node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "cp-node", Labels: map[string]string{"kubernetes.io/hostname": "cp-node"}}}
		if _, err := cp.Client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		n, err := cp.Client.CoreV1().Nodes().Get(ctx, "cp-node", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		n.Spec.Taints = nil
		if n, err = cp.Client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		res := corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("4"), corev1.ResourceMemory: resource.MustParse("8Gi"), corev1.ResourcePods: resource.MustParse("10")}
		n.Status.Capacity, n.Status.Allocatable = res, res
		n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", LastHeartbeatTime: metav1.Now()}}
		if _, err := cp.Client.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}

		schedule := func(name string) {
			t.Helper()
			pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
				Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "registry.k8s.io/pause:3.10"}}}}
			if _, err := cp.Client.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			err := waitFor(30*time.Second, 100*time.Millisecond, func() (bool, error) {
				p, err := cp.Client.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{})
				if err != nil {
					return false, err
				}
				return p.Spec.NodeName == "cp-node", fmt.Errorf("pod %s on %q, conditions %+v", name, p.Spec.NodeName, p.Status.Conditions)
			})
			if err != nil {
				t.Fatalf("%v\n%s", err, cp.Scheduler.LogTail(20))
			}
		}
		schedule("before-restart")
		cp.Scheduler.Stop(t)
		cp.Scheduler.Start(t)
		cp.WaitSchedulerReady(t)
		schedule("after-restart")

		// a kubelet identity sees its own Node and no other one
		kc := cp.KubeletKubeconfig(t, "cp-node")
		cfg, err := clientcmd.BuildConfigFromFlags("", kc)
		if err != nil {
			t.Fatal(err)
		}
		kubelet := kubernetes.NewForConfigOrDie(cfg)
		if _, err := kubelet.CoreV1().Nodes().Get(ctx, "cp-node", metav1.GetOptions{}); err != nil {
			t.Errorf("kubelet identity cannot read its node: %v", err)
		}
		if _, err := kubelet.CoreV1().Secrets("kube-system").List(ctx, metav1.ListOptions{}); err == nil || !strings.Contains(err.Error(), "forbidden") {
			t.Errorf("kubelet identity may list secrets: %v", err)
		}
		// kube-controller-manager gives a new namespace its ServiceAccount and CA ConfigMap
		if _, err := cp.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kcm-check"}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		err = waitFor(30*time.Second, 200*time.Millisecond, func() (bool, error) {
			if _, err := cp.Client.CoreV1().ServiceAccounts("kcm-check").Get(ctx, "default", metav1.GetOptions{}); err != nil {
				return false, err
			}
			_, err := cp.Client.CoreV1().ConfigMaps("kcm-check").Get(ctx, "kube-root-ca.crt", metav1.GetOptions{})
			return err == nil, err
		})
		if err != nil {
			t.Errorf("kube-controller-manager did not populate namespace kcm-check: %v\n%s", err, cp.ControllerManager.LogTail(20))
		}
		for _, p := range cp.procs {
			pids = append(pids, p.Pid())
		}
		if _, err := os.Stat(cp.Dir); err != nil {
			t.Fatal(err)
		}
	})
	for _, pid := range pids {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err == nil {
			data, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
			t.Errorf("process %d (%s) survived teardown", pid, strings.ReplaceAll(string(data), "\x00", " "))
		}
	}
}
