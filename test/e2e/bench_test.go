package e2e

import (
	"context"
	"encoding/json"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	cri "k8s.io/cri-api/pkg/apis/runtime/v1"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// BenchmarkNodeAgentCreateContainer measures, on the real containerd in one run, CRI CreateContainer
// without the NRI plugin, then with it for a container without GPUs and for a share container whose
// assignment is verified (PodResources, the API server, the ledger) and realised (limits file,
// mounts). It reports medians and what the plugin adds; the goal is an added median under 1 ms.
func BenchmarkNodeAgentCreateContainer(b *testing.B) {
	s := startNodeStack(b)
	conn, err := grpc.NewClient("unix://"+s.ctr.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	rt := cri.NewRuntimeServiceClient(conn)
	ctx := context.Background()
	g0 := s.inv.GPUs[0]

	// One API pod holding one share; its sandbox is reused for every created container.
	share, err := s.run(b, agentPod{name: "bench-share", limits: map[string]string{api.ResourceShare: "1", api.ResourceShareMemory: "1Gi"},
		assignment: s.assign(api.DeviceAssignment{UUID: g0.UUID, MemoryBytes: 1 << 30})})
	if err != nil {
		b.Fatal(err)
	}
	ann := map[string]string{}
	raw, _ := json.Marshal(s.assign(api.DeviceAssignment{UUID: g0.UUID, MemoryBytes: 1 << 30}))
	ann[api.AnnotationAssignment] = string(raw)
	sandboxConfig := func(name, uid string, ann map[string]string) *cri.PodSandboxConfig {
		return &cri.PodSandboxConfig{Metadata: &cri.PodSandboxMetadata{Name: name, Namespace: "default", Uid: uid},
			LogDirectory: filepath.Join(s.dir, "podlogs", name), Annotations: ann,
			Linux: &cri.LinuxPodSandboxConfig{SecurityContext: &cri.LinuxSandboxSecurityContext{NamespaceOptions: &cri.NamespaceOption{Network: cri.NamespaceMode_NODE}}}}
	}
	shareCfg := sandboxConfig("bench-share", share.uid, ann)
	plainCfg := sandboxConfig("bench-plain", "bench-plain-uid", nil)
	plain, err := rt.RunPodSandbox(ctx, &cri.RunPodSandboxRequest{Config: plainCfg})
	if err != nil {
		b.Fatal(err)
	}
	// The kubelet names the share container "main" (the grant is for it) and passes the token's CDI name.
	create := func(sandbox string, cfg *cri.PodSandboxConfig, cdi []string) time.Duration {
		c := &cri.ContainerConfig{Metadata: &cri.ContainerMetadata{Name: "main", Attempt: 1}, Image: &cri.ImageSpec{Image: "docker.io/library/bbox:latest"},
			Command: []string{"true"}, LogPath: "main.log", Linux: &cri.LinuxContainerConfig{}}
		for _, n := range cdi {
			c.CDIDevices = append(c.CDIDevices, &cri.CDIDevice{Name: n})
		}
		start := time.Now()
		resp, err := rt.CreateContainer(ctx, &cri.CreateContainerRequest{PodSandboxId: sandbox, Config: c, SandboxConfig: cfg})
		d := time.Since(start)
		if err != nil {
			b.Fatalf("CreateContainer: %v", err)
		}
		if _, err := rt.RemoveContainer(ctx, &cri.RemoveContainerRequest{ContainerId: resp.ContainerId}); err != nil {
			b.Fatalf("RemoveContainer: %v", err)
		}
		return d
	}
	// The share pod's own container holds its grant; remove it so each benchmark container can.
	s.ctr.Crictl(b, "rm", "-f", share.container)
	measure := func(sandbox string, cfg *cri.PodSandboxConfig, cdi []string) time.Duration {
		ds := make([]time.Duration, 0, b.N)
		for i := 0; i < b.N; i++ {
			ds = append(ds, create(sandbox, cfg, cdi))
		}
		slices.Sort(ds)
		return ds[len(ds)/2]
	}

	b.ResetTimer()
	n0, t0 := s.createStats(b)
	withPlain := measure(plain.PodSandboxId, plainCfg, nil)
	n1, t1 := s.createStats(b)
	withShare := measure(share.sandbox, shareCfg, []string{"tessera.dev/vgpu=share"})
	n2, t2 := s.createStats(b)
	s.agent.Stop(b) // containerd drops the plugin; the same calls now run without it
	waitFor(10*time.Second, 50*time.Millisecond, func() (bool, error) { return !s.healthz(), nil })
	without := measure(plain.PodSandboxId, plainCfg, nil)
	b.StopTimer()

	// The plugin's own time per CreateContainer, from its counters: what it adds without containerd's noise.
	b.ReportMetric((t1-t0)/(n1-n0)*1e6, "µs-in-plugin-no-gpu")
	b.ReportMetric((t2-t1)/(n2-n1)*1e6, "µs-in-plugin-share")
	b.ReportMetric(float64(without.Microseconds()), "µs-median-without-plugin")
	b.ReportMetric(float64(withPlain.Microseconds()), "µs-median-plugin-no-gpu")
	b.ReportMetric(float64(withShare.Microseconds()), "µs-median-plugin-share")
	b.ReportMetric(float64((withPlain - without).Microseconds()), "µs-added-no-gpu")
	b.ReportMetric(float64((withShare - without).Microseconds()), "µs-added-share")
	b.Logf("time in the plugin per CreateContainer: %.0fµs (no GPU), %.0fµs (share)", (t1-t0)/(n1-n0)*1e6, (t2-t1)/(n2-n1)*1e6)
	b.Logf("CreateContainer median: without plugin %v, with plugin %v (no GPU), %v (share); added %v / %v",
		without, withPlain, withShare, withPlain-without, withShare-without)
}

// createStats reads the plugin's CreateContainer counters from /metrics.
func (s *nodeStack) createStats(tb testing.TB) (n, seconds float64) {
	tb.Helper()
	m := s.metric(tb)
	for _, line := range strings.Split(m, "\n") {
		f := strings.Fields(line)
		if len(f) != 2 {
			continue
		}
		v, _ := strconv.ParseFloat(f[1], 64)
		// The histogram has one series per result (ok, refused); sum them.
		switch name, _, _ := strings.Cut(f[0], "{"); name {
		case "tessera_nri_create_container_duration_seconds_count":
			n += v
		case "tessera_nri_create_container_duration_seconds_sum":
			seconds += v
		}
	}
	return n, seconds
}
