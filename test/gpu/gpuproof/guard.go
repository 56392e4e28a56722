package main

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/memguard"
)

// The guard phase: the node agent's memory guard (tessera-node run, internal/memguard) on this
// machine's NVML kills a share container that allocates past vcuda over its cap, and leaves one under
// its cap alone. No kubelet or containerd is here: the agent runs on its own with a ledger holding
// the two containers' shares (written with internal/ledger before it starts, as the NRI plugin would
// have), and the containers are runc containers in cgroups named by their container IDs, as the
// cgroupfs driver names a pod's containers. With no API server the kill is told by the agent's log
// and its kill counter, not an Event.
func runGuard(args []string) error {
	fs := flag.NewFlagSet("guard", flag.ContinueOnError)
	o := agentFlags(fs)
	capMiB := fs.Int64("cap-mib", 1024, "each share's memory cap")
	grace := fs.Duration("grace", 2*time.Second, "the guard's grace (--memory-guard-grace)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	start := time.Now()
	p := newPhase("guard", o.dry)
	capBytes := *capMiB << 20
	interval := 500 * time.Millisecond
	// The two containers' shares, half the GPU's compute each, in the ledger the agent loads.
	a, err := startAgent(p, o, fs.Args(), "guard", map[string]shareSpec{"bypass": {capBytes, 50}, "polite": {capBytes, 50}},
		"--memory-guard-interval="+interval.String(), "--memory-guard-grace="+grace.String())
	if err != nil {
		return err
	}
	if a == nil {
		return finish(p, o.out, start)
	}
	defer a.stop()
	dir, g, r, ids, readLog, listen := a.dir, a.gpu, a.runner, a.ids, a.readLog, a.listen

	gen := &cdi.Generator{Vendor: configv1.DefaultCDIVendor}
	devices := []string{gen.Name(cdi.ClassGPU, g.UUID), gen.Name(cdi.ClassShare, cdi.ShareName)}
	run := func(name string, preload bool, bytes int64) *started {
		mounts, err := shareMounts(filepath.Join(dir, "containers", name+"-vcuda"), ids[name], g.UUID, capBytes, 50, preload)
		if err != nil {
			p.check(name+": container runs", false, "nri.VCUDAMounts", "%v", err)
			return nil
		}
		c, err := r.start("guard-"+name, devices, mounts, fmt.Sprintf("exec cudaprobe hold %d 120", bytes), "/tessera-gpuproof/"+ids[name])
		if err != nil {
			p.check(name+": container runs", false, "runc run", "%v", err)
			return nil
		}
		if !c.waitLine(fmt.Sprintf("held=%d error=0", bytes), time.Minute) {
			p.check(name+": container holds its memory", false, "cudaprobe hold", "%s", lastLines(c.out.String(), 5))
		}
		return c
	}
	// Under its cap through vcuda: a quarter of it (and its context) held.
	polite := run("polite", true, capBytes/4)
	if polite == nil {
		return finish(p, o.out, start)
	}
	defer polite.stop()
	// Past vcuda (no /etc/ld.so.preload): twice the cap, straight from the driver.
	bypass := run("bypass", false, 2*capBytes)
	if bypass == nil {
		return finish(p, o.out, start)
	}
	defer bypass.stop()
	t0 := time.Now()
	// The grace, the samples either side of it, and the kill.
	exit := bypass.wait(*grace + 10*interval + 10*time.Second)
	took := time.Since(t0)
	p.check("bypass: killed (SIGKILL)", exit == 137, "runc run's exit status (137: SIGKILL)",
		"exit %d %.1f s after it held %d MiB past vcuda; cap %d MiB, grace %v, interval %v", exit, took.Seconds(), (2*capBytes)>>20, *capMiB, *grace, interval)
	f := Figure{Name: "bypass: time from holding to its end", Value: took.Seconds(), Unit: "s", MeasuredBy: "gpuproof: from cudaprobe's held line to runc run's exit"}
	if !o.dry { // a dry run's timing on a shared CPU says nothing of the agent's
		f.Goal, f.Status = fmt.Sprintf("<= grace + 3 intervals = %.1f s", (*grace+3*interval).Seconds()), passFail(exit == 137 && took <= *grace+3*interval)
	}
	p.figure(f)
	// The agent logs the kill a moment after it; a second for it to land.
	killLine := regexp.MustCompile(`(?m)^.*memory guard: GPU memory over the cap.*$`)
	var logged string
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline) && logged == ""; time.Sleep(100 * time.Millisecond) {
		for _, line := range killLine.FindAllString(readLog(), -1) {
			if strings.Contains(line, ids["bypass"]) {
				logged = line
			}
		}
	}
	p.check("bypass: the agent logs the kill ("+memguard.ReasonCapExceeded+" without an API server)", logged != "", "tessera-node run's log",
		"%s", first(logged, "no kill line naming "+ids["bypass"]))
	kills := metricValue(scrape(listen), `tessera_memory_cap_kills_total`)
	p.check("the agent counts one kill", kills == "1", "tessera-node /metrics tessera_memory_cap_kills_total", "%q", kills)
	// Both shares are capped at 50% compute, so the compute guard asked this driver for per-process
	// utilisation in every sample: an error (NOT_SUPPORTED included) is counted per GPU, and where there
	// is one, compute caps on this GPU rest on vcuda alone.
	utilErrs := metricValue(scrape(listen), `tessera_compute_guard_nvml_errors_total\{UUID="`+regexp.QuoteMeta(g.UUID)+`"\}`)
	p.check("the driver samples per-process utilisation (the compute guard's input)", utilErrs == "" || utilErrs == "0",
		"tessera-node /metrics tessera_compute_guard_nvml_errors_total", "errors %q (absent: none); on error the agent's log says which NVML answer", first(utilErrs, "0"))
	// polite was sampled in the same passes: measured (so seen, not missed), still running, never
	// named in a kill.
	time.Sleep(*grace + 2*interval)
	politeKilled := false
	for _, line := range killLine.FindAllString(readLog(), -1) {
		politeKilled = politeKilled || strings.Contains(line, ids["polite"])
	}
	measured, _ := strconv.ParseFloat(metricValue(scrape(listen), `tessera_container_gpu_memory_measured_bytes\{[^}]*pod="polite"[^}]*\}`), 64)
	p.check("polite: the agent measures it", measured >= float64(capBytes/4), "tessera-node /metrics tessera_container_gpu_memory_measured_bytes{pod=\"polite\"}",
		"%.0f MiB measured; it holds %d MiB and its context", measured/(1<<20), (capBytes/4)>>20)
	p.check("polite: under its cap, left alone", polite.running() && !politeKilled, "runc state and tessera-node run's log",
		"running %v, named in a kill line %v", polite.running(), politeKilled)
	p.Env["agent_log_tail"] = lastLines(readLog(), 8)
	return finish(p, o.out, start)
}

// newContainerID is a runtime-style container ID (64 hex digits), which the guard finds in a cgroup path.
func newContainerID() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// freePort is a loopback address nothing listens on, for the agent's /metrics.
func freePort() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// scrape is the agent's /metrics ("" when it does not answer).
func scrape(addr string) string {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get("http://" + addr + "/metrics")
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	_, _ = b.ReadFrom(resp.Body)
	return b.String()
}

// metricValue is the value of the first series matching the pattern (name and labels), "" if none.
func metricValue(metrics, series string) string {
	m := regexp.MustCompile(`(?m)^` + series + ` (\S+)$`).FindStringSubmatch(metrics)
	if m == nil {
		return ""
	}
	return m[1]
}
