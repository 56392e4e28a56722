package e2e

import (
	"regexp"
	"strings"
	"testing"
	"time"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// TestNodeAgent runs the node agent on the simulated node against real containerd (NRI + CDI),
// a real API server and a fake kubelet speaking the real device-plugin and PodResources APIs.
func TestNodeAgent(t *testing.T) {
	s := startNodeStack(t)
	gpus := s.inv.GPUs
	g0, g1, g2 := gpus[0], gpus[1], gpus[2]
	// The built-in node: 6 GPUs usable whole or shared, 10 shares each, MIG on GPU 7, mdev parent GPU 6.
	s.kubelet.WaitHealthy(t, api.ResourceGPU, 6)
	s.kubelet.WaitHealthy(t, api.ResourceShare, 60)

	// Two pods share GPU 0 with different memory caps; each sees that GPU only, the preload and
	// its own limits file.
	a, err := s.run(t, agentPod{name: "share-a", limits: map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "10Gi", api.ResourceShareCores: "30"},
		assignment: s.assign(api.DeviceAssignment{UUID: g0.UUID, MemoryBytes: 10 << 30, CoresPercent: 30})})
	if err != nil {
		t.Fatal(err)
	}
	b, err := s.run(t, agentPod{name: "share-b", limits: map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "5Gi"},
		assignment: s.assign(api.DeviceAssignment{UUID: g0.UUID, MemoryBytes: 5 << 30})})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		p      *runningPod
		limits string
	}{{a, "gpu " + g0.UUID + " 10737418240 30"}, {b, "gpu " + g0.UUID + " 5368709120 100"}} {
		out := s.exec(t, c.p, "ls /dev; echo ---; cat /etc/ld.so.preload; cat /etc/tessera/vcuda/limits; ls -d /run/tessera/vcuda; cat "+api.VCUDALibraryInContainer)
		for _, want := range []string{"(?m)^nvidia0$", "(?m)^nvidiactl$", "(?m)^" + regexp.QuoteMeta(api.VCUDALibraryInContainer) + "$",
			"(?m)^" + regexp.QuoteMeta(c.limits) + "$", "(?m)^container [0-9a-f]{64}$", "stand-in for libvcuda.so"} {
			if !regexp.MustCompile(want).MatchString(out) {
				t.Errorf("%s lacks %s:\n%s", c.p.name, want, out)
			}
		}
		if regexp.MustCompile(`(?m)^nvidia[1-7]$`).MatchString(out) {
			t.Errorf("%s sees another GPU:\n%s", c.p.name, out)
		}
		// The preload and limits are read-only for the container.
		if out, err := s.ctr.Crictl(t, "exec", c.p.container, "sh", "-c", "echo x > /etc/ld.so.preload"); err == nil {
			t.Errorf("%s could overwrite /etc/ld.so.preload: %s", c.p.name, out)
		}
	}
	// GPU 0 holds shares: it is no longer offered whole.
	s.kubelet.WaitHealthy(t, api.ResourceGPU, 5)

	// A whole-GPU pod: no preload; its GPU stops offering shares.
	w, err := s.run(t, agentPod{name: "whole", limits: map[string]string{api.ResourceGPU: "1"},
		assignment: s.assign(api.DeviceAssignment{UUID: g2.UUID, Whole: true})})
	if err != nil {
		t.Fatal(err)
	}
	out := s.exec(t, w, "ls /dev; cat /etc/ld.so.preload 2>&1; ls /etc/tessera 2>&1; true")
	if !regexp.MustCompile(`(?m)^nvidia2$`).MatchString(out) || !strings.Contains(out, "can't open '/etc/ld.so.preload'") || strings.Contains(out, "vcuda") {
		t.Errorf("whole-GPU container:\n%s", out)
	}
	s.kubelet.WaitHealthy(t, api.ResourceShare, 50)

	// A MIG pod: the instance's capability nodes, no preload.
	var migName string
	for _, r := range s.kubelet.Resources() {
		if strings.HasPrefix(r, api.MIGResourcePrefix+"1g.5gb") {
			migName = r
		}
	}
	m, err := s.run(t, agentPod{name: "mig", limits: map[string]string{migName: "1"}})
	if err != nil {
		t.Fatal(err)
	}
	out = s.exec(t, m, "ls /dev /dev/nvidia-caps; cat /etc/ld.so.preload 2>&1; true")
	if n := len(regexp.MustCompile(`(?m)^nvidia-cap[0-9]+$`).FindAllString(out, -1)); n != 2 || !strings.Contains(out, "nvidia7") || !strings.Contains(out, "No such file") {
		t.Errorf("MIG container (%d cap nodes):\n%s", n, out)
	}

	// Forged assignments are refused with a reason.
	for _, f := range []struct {
		pod  agentPod
		want string
	}{
		{agentPod{name: "forged-memory", limits: map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "1Gi"},
			assignment: s.assign(api.DeviceAssignment{UUID: g1.UUID, MemoryBytes: 30 << 30})}, "memory cap 32212254720 bytes, the container requests 1073741824"},
		{agentPod{name: "forged-whole", limits: map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "1Gi"},
			assignment: s.assign(api.DeviceAssignment{UUID: g2.UUID, MemoryBytes: 1 << 30})}, "already held whole"},
		{agentPod{name: "forged-gpu", limits: map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "1Gi"},
			assignment: s.assign(api.DeviceAssignment{UUID: "GPU-00000000-0000-4000-8000-000000000000", MemoryBytes: 1 << 30})}, "is not on node node-a"},
		{agentPod{name: "forged-overcommit", limits: map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "30Gi"},
			assignment: s.assign(api.DeviceAssignment{UUID: g0.UUID, MemoryBytes: 30 << 30})}, "would over-commit it"},
	} {
		p, err := s.run(t, f.pod)
		if err == nil || !strings.Contains(err.Error(), f.want) {
			t.Errorf("%s: want refusal containing %q, got %v", f.pod.name, f.want, err)
		}
		s.remove(t, p)
	}
	// A pod that requests no GPU but carries a forged assignment gets nothing; one that also asks
	// containerd for a GPU through a CDI annotation is refused.
	nog, err := s.run(t, agentPod{name: "no-tokens", assignment: s.assign(api.DeviceAssignment{UUID: g1.UUID, Whole: true})})
	if err != nil {
		t.Fatal(err)
	}
	if out := s.exec(t, nog, "ls /dev"); regexp.MustCompile(`(?m)^nvidia[0-9]+$`).MatchString(out) {
		t.Errorf("a pod without GPU requests got a GPU:\n%s", out)
	}
	sneaky, err := s.run(t, agentPod{name: "cdi-annotation", ctrAnnotations: map[string]string{"cdi.k8s.io/sneaky": "tessera.dev/gpu=" + g1.UUID}})
	if err == nil || !strings.Contains(err.Error(), "the kubelet did not grant it") {
		t.Errorf("a pod smuggling a GPU in through a CDI annotation: %v", err)
	}
	s.remove(t, sneaky)

	// The agent is killed with pods running and restarted: the ledger is the same, nothing leaks.
	before := s.ledger(t)
	if !strings.Contains(before, a.container) || !strings.Contains(before, w.container) || strings.Contains(before, nog.container) {
		t.Fatalf("ledger before the crash:\n%s", before)
	}
	s.agent.Kill(t)
	s.agent.Start(t)
	s.waitReady(t)
	if after := s.ledger(t); after != before {
		t.Errorf("ledger changed across an agent restart:\nbefore %s\nafter %s", before, after)
	}
	s.kubelet.WaitHealthy(t, api.ResourceGPU, 5) // GPU 0 holds shares; GPU 2, held whole, stays in whole mode
	if !strings.Contains(s.metric(t), "tessera_ledger_entries 4") {
		t.Errorf("metrics after restart:\n%s", s.metric(t))
	}

	// containerd restarts: the NRI plugin reconnects and still realises assignments.
	s.ctr.Stop(t)
	s.ctr.Start(t)
	s.waitReady(t) // /healthz includes the NRI plugin being synchronized with the new containerd
	c, err := s.run(t, agentPod{name: "after-containerd", limits: map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "2Gi"},
		assignment: s.assign(api.DeviceAssignment{UUID: g1.UUID, MemoryBytes: 2 << 30})})
	if err != nil {
		t.Fatalf("after containerd restart: %v\n%s", err, s.agent.LogTail(20))
	}
	if out := s.exec(t, c, "cat /etc/tessera/vcuda/limits"); !strings.Contains(out, "gpu "+g1.UUID+" 2147483648 100") {
		t.Errorf("limits after containerd restart:\n%s", out)
	}

	// A pod scheduled without the extender (no assignment) is placed by the agent.
	local, err := s.run(t, agentPod{name: "local", limits: map[string]string{api.ResourceShare: "2", api.ResourceShareMemory: "4Gi"}})
	if err != nil {
		t.Fatal(err)
	}
	if out := s.exec(t, local, "cat /etc/tessera/vcuda/limits"); strings.Count(out, "\ngpu ") != 2 {
		t.Errorf("locally placed pod limits:\n%s", out)
	}

	// Removing pods frees the ledger and the GPUs' modes.
	for _, p := range []*runningPod{a, b, w, m, nog, c, local} {
		s.remove(t, p)
	}
	if err := waitFor(30*time.Second, 100*time.Millisecond, func() (bool, error) {
		return strings.Contains(s.metric(t), "tessera_ledger_entries 0"), nil
	}); err != nil {
		t.Errorf("ledger not empty after all pods went:\n%s\n%s", s.ledger(t), s.agent.LogTail(20))
	}
	s.kubelet.WaitHealthy(t, api.ResourceGPU, 6)
	s.kubelet.WaitHealthy(t, api.ResourceShare, 60)
}
