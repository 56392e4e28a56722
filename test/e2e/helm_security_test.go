package e2e

import (
	"maps"
	"slices"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	networkingv1 "k8s.io/api/networking/v1"
	sigyaml "sigs.k8s.io/yaml"
)

// chartObject decodes the rendered object kind/name into out.
func chartObject(t *testing.T, objs map[string][]byte, key string, out any) {
	t.Helper()
	raw, ok := objs[key]
	if !ok {
		t.Fatalf("the chart renders no %s", key)
	}
	if err := sigyaml.Unmarshal(raw, out); err != nil {
		t.Fatalf("%s: %v", key, err)
	}
}

// TestHelmNetworkPolicyAdmitsReplicas renders the extender's NetworkPolicy (no cluster): a
// non-leader replica passes filter, bind and preempt on to the leader at its advertised URL (pod
// IP, extender.port), so an ingress rule must admit the extender's own pods on that port, or with an
// enforcing CNI half of the verbs time out; and no rule may open the API port to every pod or
// namespace (only the scheduler and the replicas call it). Both scheduler modes.
func TestHelmNetworkPolicyAdmitsReplicas(t *testing.T) {
	for _, args := range [][]string{nil, {"--set", "scheduler.mode=default", "--set", "extender.networkPolicy.extraFrom[0].ipBlock.cidr=10.0.0.0/24"}} {
		objs := chartObjects(t, args...)
		var d appsv1.Deployment
		chartObject(t, objs, "Deployment/tessera-extender", &d)
		var np networkingv1.NetworkPolicy
		chartObject(t, objs, "NetworkPolicy/tessera-extender", &np)
		own := d.Spec.Template.Labels
		if !maps.Equal(np.Spec.PodSelector.MatchLabels, d.Spec.Selector.MatchLabels) {
			t.Fatalf("%v: the NetworkPolicy selects %v, the extender's pods are %v", args, np.Spec.PodSelector.MatchLabels, d.Spec.Selector.MatchLabels)
		}
		// The port replicas forward to: the one the advertised URL names.
		const apiPort = 8888
		if !slices.Contains(d.Spec.Template.Spec.Containers[0].Args, "--advertise-url=https://$(POD_IP):8888") {
			t.Fatalf("%v: the extender no longer advertises its API port; update this test's peer port: %q", args, d.Spec.Template.Spec.Containers[0].Args)
		}
		replicas := false
		for i, r := range np.Spec.Ingress {
			onAPI := len(r.Ports) == 0 // no ports: every port
			for _, p := range r.Ports {
				if p.Port != nil && p.Port.IntValue() == apiPort {
					onAPI = true
				}
			}
			if !onAPI {
				continue
			}
			if len(r.From) == 0 {
				t.Errorf("%v: ingress rule %d admits every source on the API port: %+v", args, i, r)
			}
			for _, f := range r.From {
				switch {
				case f.NamespaceSelector != nil:
					t.Errorf("%v: ingress rule %d admits pods of other namespaces on the API port: %+v", args, i, f)
				case f.PodSelector != nil && len(f.PodSelector.MatchLabels) == 0 && len(f.PodSelector.MatchExpressions) == 0:
					t.Errorf("%v: ingress rule %d admits every pod on the API port: %+v", args, i, f)
				case f.PodSelector != nil && maps.Equal(f.PodSelector.MatchLabels, own):
					replicas = true
				}
			}
		}
		if !replicas {
			t.Errorf("%v: no ingress rule admits the extender's own pods (%v) on port %d, where replicas pass verbs on to the leader: %+v", args, own, apiPort, np.Spec.Ingress)
		}
	}
}

// TestHelmAgentListensOnHostIP renders the node agent (no cluster): under hostNetwork its /metrics
// and /healthz listen on the pod's IP (status.podIP, the node's own IP there), not on 0.0.0.0 (every
// address of the node, other networks included); the probes carry no host, so the kubelet probes
// that same IP. An explicit node.listenHost still wins (127.0.0.1: the probes follow).
func TestHelmAgentListensOnHostIP(t *testing.T) {
	var ds appsv1.DaemonSet
	chartObject(t, chartObjects(t), "DaemonSet/tessera-node", &ds)
	spec := ds.Spec.Template.Spec
	c := spec.Containers[0]
	if !spec.HostNetwork {
		t.Fatal("the agent no longer runs on the host network by default; this test assumes it does")
	}
	if !slices.Contains(c.Args, "--listen=$(POD_IP):9445") {
		t.Errorf("the agent does not listen on its pod's (the node's) IP: %q", c.Args)
	}
	ip := false
	for _, e := range c.Env {
		if e.Name == "POD_IP" {
			ip = e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "status.podIP"
		}
	}
	if !ip {
		t.Errorf("POD_IP is not the downward API's status.podIP: %+v", c.Env)
	}
	if c.ReadinessProbe.HTTPGet.Host != "" || c.LivenessProbe.TCPSocket.Host != "" {
		t.Errorf("the probes name a host (want the pod IP the agent listens on): %+v %+v", c.ReadinessProbe, c.LivenessProbe)
	}

	chartObject(t, chartObjects(t, "--set", "node.listenHost=127.0.0.1"), "DaemonSet/tessera-node", &ds)
	c = ds.Spec.Template.Spec.Containers[0]
	if !slices.Contains(c.Args, "--listen=127.0.0.1:9445") || c.ReadinessProbe.HTTPGet.Host != "127.0.0.1" || c.LivenessProbe.TCPSocket.Host != "127.0.0.1" {
		t.Errorf("node.listenHost=127.0.0.1: args %q, probes %+v %+v", c.Args, c.ReadinessProbe, c.LivenessProbe)
	}
}

// TestHelmSchedulerSecurityContext renders the chart's own kube-scheduler (scheduler.mode=second;
// no cluster): it runs as a non-root user with the RuntimeDefault seccomp profile, a read-only root
// filesystem, no privilege escalation and no capabilities, as the extender does.
func TestHelmSchedulerSecurityContext(t *testing.T) {
	objs := chartObjects(t)
	for _, name := range []string{"tessera-scheduler", "tessera-extender"} {
		var d appsv1.Deployment
		chartObject(t, objs, "Deployment/"+name, &d)
		pod := d.Spec.Template.Spec.SecurityContext
		if pod == nil || pod.RunAsNonRoot == nil || !*pod.RunAsNonRoot || pod.RunAsUser == nil || *pod.RunAsUser == 0 ||
			pod.SeccompProfile == nil || pod.SeccompProfile.Type != "RuntimeDefault" {
			t.Errorf("%s: pod securityContext %+v, want runAsNonRoot, a non-root runAsUser and seccomp RuntimeDefault", name, pod)
		}
		for _, c := range d.Spec.Template.Spec.Containers {
			sc := c.SecurityContext
			if sc == nil || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
				sc.Privileged != nil && *sc.Privileged || sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") || len(sc.Capabilities.Add) != 0 {
				t.Errorf("%s container %s: securityContext %+v, want no privilege escalation, a read-only root filesystem and all capabilities dropped", name, c.Name, sc)
			}
		}
	}
}
