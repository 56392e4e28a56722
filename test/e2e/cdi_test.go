package e2e

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestCDIGenerateNerdctl: `tessera-node cdi generate` on the simulated node writes specs that real
// containerd resolves for `nerdctl run --device <vendor>/gpu=<uuid>`: the container sees that GPU's
// device node (and no other GPU's), the control nodes and the env the spec sets; MIG devices bring
// their capability nodes.
func TestCDIGenerateNerdctl(t *testing.T) {
	ctr := StartContainerd(t)
	node := tesseraBinary(t, "tessera-node")
	out := mustRun(t, time.Minute, node, "cdi", "generate", "--backend=sim", "--cdi-dir="+ctr.CDIDir,
		"--state-dir="+filepath.Join(ctr.Base, "sim"), "--data-dir="+filepath.Join(ctr.Base, "data"), "--vendor=tessera.dev",
		"--sim-driver-dir="+BuildSimDriver(t).FakeDir)
	names := strings.Split(out, "\n")
	uuid := ""
	for i, n := range names {
		if n == "tessera.dev/gpu=3" && i > 0 {
			uuid = strings.TrimPrefix(names[i-1], "tessera.dev/gpu=")
		}
	}
	if !strings.HasPrefix(uuid, "GPU-") {
		t.Fatalf("cdi generate did not print GPU 3's UUID name before its index name:\n%s", out)
	}

	got, err := ctr.Nerdctl(t, "--cdi-spec-dirs", ctr.CDIDir, "run", "--rm", "--net", "none",
		"--device", "tessera.dev/gpu="+uuid, "bbox", "sh", "-c", "ls -l /dev/; env")
	if err != nil {
		t.Fatalf("nerdctl run: %v\n%s\ncontainerd log:\n%s", err, got, ctr.LogTail())
	}
	for _, want := range []string{
		`(?m)^c.* 195, +3 .* nvidia3$`,
		`(?m)^c.* 195, +255 .* nvidiactl$`,
		`(?m)^c.* nvidia-uvm$`,
		`(?m)^c.* nvidia-uvm-tools$`,
		`(?m)^NVIDIA_VISIBLE_DEVICES=void$`,
		`(?m)^TESSERA_GPU_3=` + uuid + `$`,
	} {
		if !regexp.MustCompile(want).MatchString(got) {
			t.Errorf("container output lacks %s:\n%s", want, got)
		}
	}
	for _, other := range []string{"nvidia2", "nvidia4"} {
		if regexp.MustCompile(`(?m) ` + other + `$`).MatchString(got) {
			t.Errorf("container sees %s, which it was not given:\n%s", other, got)
		}
	}

	// CUDA runs from the CDI edits alone: cudaprobe (linked against libcuda.so.1) finds the driver
	// the spec mounted from the simulated driver root, and it and nvidia-smi see exactly that GPU.
	got, err = ctr.Nerdctl(t, "--cdi-spec-dirs", ctr.CDIDir, "run", "--rm", "--net", "none",
		"--device", "tessera.dev/gpu="+uuid, "bbox", "sh", "-c", "cudaprobe info; nvidia-smi -L; ls -l /usr/lib/x86_64-linux-gnu/")
	if err != nil {
		t.Fatalf("CUDA in a CDI container: %v\n%s", err, got)
	}
	for _, want := range []string{
		`(?m)^devices=1$`,
		`(?m)^device=0 name=NVIDIA_A100-SXM4-40GB total_mem=42949672960 `,
		`(?m)^GPU 0: NVIDIA A100-SXM4-40GB \(UUID: ` + uuid + `\)$`,
		`(?m) libcuda\.so\.1 -> libcuda\.so\.580\.95\.05$`,
	} {
		if !regexp.MustCompile(want).MatchString(got) {
			t.Errorf("CUDA container output lacks %s:\n%s", want, got)
		}
	}
	if n := strings.Count(got, "\nGPU "); n != 1 {
		t.Errorf("nvidia-smi -L lists %d GPUs, want exactly the one granted:\n%s", n, got)
	}

	// A MIG instance: its parent's node and its two capability nodes.
	var mig string
	for _, n := range names {
		if strings.HasPrefix(n, "tessera.dev/mig=") {
			mig = n
			break
		}
	}
	got, err = ctr.Nerdctl(t, "--cdi-spec-dirs", ctr.CDIDir, "run", "--rm", "--net", "none", "--device", mig, "bbox",
		"sh", "-c", "ls /dev/nvidia7 /dev/nvidia-caps/; env; cudaprobe info")
	if err != nil {
		t.Fatalf("nerdctl run %s: %v\n%s", mig, err, got)
	}
	if n := len(regexp.MustCompile(`(?m)^nvidia-cap[0-9]+$`).FindAllString(got, -1)); n != 2 || !strings.Contains(got, "/dev/nvidia7") || !strings.Contains(got, "TESSERA_MIG_PROFILE=") {
		t.Errorf("MIG container sees %d capability nodes, want 2:\n%s", n, got)
	}
	// CUDA there sees the instance alone, with its memory and SMs as the node file (the simulated
	// node's record of its instances) gives them, not the GPU's.
	gpus, err := os.ReadFile(filepath.Join(ctr.Base, "sim", "root", "etc", "tessera-sim", "gpus"))
	if err != nil {
		t.Fatal(err)
	}
	inst := regexp.MustCompile(`(?m)^mig 7 ` + regexp.QuoteMeta(strings.TrimPrefix(mig, "tessera.dev/mig=")) + ` \d+ \d+ (\d+) (\d+) `).FindStringSubmatch(string(gpus))
	if inst == nil {
		t.Fatalf("the node file has no mig line for %s:\n%s", mig, gpus)
	}
	if !regexp.MustCompile(`(?m)^devices=1$`).MatchString(got) ||
		!regexp.MustCompile(`(?m)^device=0 name=\S+_MIG_\S+ total_mem=`+inst[1]+` .* sms=`+inst[2]+` `).MatchString(got) {
		t.Errorf("CUDA in the MIG container does not see the instance alone (%s bytes, %s SMs):\n%s", inst[1], inst[2], got)
	}
	// An unknown device is refused with CDI's error, not silently ignored.
	got, err = ctr.Nerdctl(t, "--cdi-spec-dirs", ctr.CDIDir, "run", "--rm", "--net", "none", "--device", "tessera.dev/gpu=99", "bbox", "true")
	if err == nil || !strings.Contains(got, "unresolvable CDI devices") {
		t.Errorf("unknown CDI device: err=%v\n%s", err, got)
	}
	t.Logf("nerdctl resolved %s and %s", uuid, mig)
}
