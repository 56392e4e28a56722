package simulate

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestLoadPodsColumns: openb's multigpu20 trace has only name, cpu_milli, memory_mib, num_gpu and
// gpu_milli (no gpu_spec, qos or times); tessera-sim and the live benchmark must read it as they
// read the full layout, and a missing required column must be named.
func TestLoadPodsColumns(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	short := write("multigpu.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"+
		"a,12000,16384,8,1000\nb,4000,8192,1,250\n")
	pods, err := LoadPods(short)
	if err != nil {
		t.Fatalf("five-column trace: %v", err)
	}
	want := []Pod{{Name: "a", CPUMilli: 12000, MemMiB: 16384, NumGPU: 8, GPUMilli: 1000},
		{Name: "b", CPUMilli: 4000, MemMiB: 8192, NumGPU: 1, GPUMilli: 250}}
	if len(pods) != len(want) {
		t.Fatalf("got %d pods, want %d", len(pods), len(want))
	}
	for i := range want {
		if pods[i].Name != want[i].Name || pods[i].CPUMilli != want[i].CPUMilli || pods[i].MemMiB != want[i].MemMiB ||
			pods[i].NumGPU != want[i].NumGPU || pods[i].GPUMilli != want[i].GPUMilli || pods[i].Models != nil {
			t.Errorf("pod %d = %+v, want %+v", i, pods[i], want[i])
		}
	}

	full := write("spec.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"+
		"c,8000,32768,1,1000,V100M16|V100M32,LS,Running,0,1,0\n")
	pods, err = LoadPods(full)
	if err != nil {
		t.Fatalf("full trace: %v", err)
	}
	if len(pods) != 1 || !slices.Equal(pods[0].Models, []string{"V100M16", "V100M32"}) {
		t.Errorf("gpu_spec: got %+v, want models [V100M16 V100M32]", pods)
	}

	_, err = LoadPods(write("nogpu.csv", "name,cpu_milli,memory_mib,num_gpu\na,1,1,0\n"))
	if err == nil || !strings.Contains(err.Error(), `missing column "gpu_milli"`) {
		t.Errorf("trace without gpu_milli: err = %v, want it to name the missing column", err)
	}
}
