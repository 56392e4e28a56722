package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// runPreflight says what this machine is before anything needs it: the sandbox (gVisor,
// Firecracker, another VM), whether /sys/fs/cgroup is cgroup2, and whether runc can start a
// container from the bundle's rootfs; where it cannot, whether the namespace fallback (nsrunc)
// can. It writes the chosen runtime's path to -runtime-file, which run.sh hands to the container
// phases, and says in the results which one ran.
func runPreflight(args []string) error {
	fs := flag.NewFlagSet("preflight", flag.ContinueOnError)
	runc := fs.String("runc", "runc", "runc binary")
	fallback := fs.String("fallback", "", "the namespace fallback's runc-compatible entry point (required)")
	rootfs := fs.String("rootfs", "", "the containers' root (required)")
	work := fs.String("work", "", "work folder (required)")
	out := fs.String("out", "", "phase result file (required)")
	runtimeFile := fs.String("runtime-file", "", "where to write the chosen runtime's path (required)")
	force := fs.String("runtime", "auto", "auto, runc or fallback: which to use (the dry run forces each)")
	dry := fs.Bool("dry-run", false, "the simulated node and the fake driver")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *fallback == "" || *rootfs == "" || *work == "" || *out == "" || *runtimeFile == "" {
		return fmt.Errorf("-fallback, -rootfs, -work, -out and -runtime-file are required")
	}
	start := time.Now()
	p := newPhase("preflight", *dry)
	kind, evidence := sandbox()
	p.Env["runtime"], p.Env["runtime_evidence"] = kind, evidence
	var st unix.Statfs_t
	cg2 := unix.Statfs("/sys/fs/cgroup", &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC
	ctrl, _ := os.ReadFile("/sys/fs/cgroup/cgroup.controllers")
	// reported, not held: runc and the fallback both work on cgroup v1 too; the try below decides
	p.Env["cgroup2"], p.Env["cgroup_controllers"] = fmt.Sprint(cg2), strings.TrimSpace(string(ctrl))
	fmt.Printf("runtime %s (%s); cgroup2 %v, controllers %q\n", kind, evidence, cg2, strings.TrimSpace(string(ctrl)))

	try := func(name, bin string) bool {
		r := &runner{runc: bin, rootfs: *rootfs, dir: filepath.Join(*work, "preflight", name)}
		// the last command runs as pid 1 when the container has its own PID namespace (sh execs it)
		got, err := r.run("hello", nil, nil, "echo preflight-ok; cat /proc/1/comm")
		ok := err == nil && strings.TrimSpace(got) == "preflight-ok\ncat"
		p.check(name+" starts a container", ok, name+" run (busybox rootfs, no devices; its own PID namespace: /proc/1 is its own process)",
			"%s %v", oneLine(got), errOrNone(err))
		return ok
	}
	chosen := ""
	switch *force {
	case "runc":
		if try("runc", *runc) {
			chosen = *runc
		}
	case "fallback":
		if try("fallback", *fallback) {
			chosen = *fallback
		}
	case "auto":
		// both, always: the fallback must keep working where runc does too, or it rots unseen
		runcOK, fallbackOK := try("runc", *runc), try("fallback", *fallback)
		if runcOK {
			chosen = *runc
		} else if fallbackOK {
			chosen = *fallback
		}
	default:
		return fmt.Errorf("-runtime %q: want auto, runc or fallback", *force)
	}
	name := map[string]string{*runc: "runc", *fallback: "fallback (unshare --mount --pid, bind mounts, mknod, chroot)", "": "none"}[chosen]
	p.Env["container_runtime"] = name
	p.check("a container runtime works", chosen != "", "preflight", "using %s", name)
	if err := os.WriteFile(*runtimeFile, []byte(chosen), 0o644); err != nil {
		return err
	}
	return finish(p, *out, start)
}

func errOrNone(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// sandbox names what this machine runs in, from what the kernel says of itself.
func sandbox() (string, string) {
	version, _ := os.ReadFile("/proc/version")
	cmdline, _ := os.ReadFile("/proc/cmdline")
	cpuinfo, _ := os.ReadFile("/proc/cpuinfo")
	dmesg, _ := output(10*time.Second, nil, "dmesg")
	v := strings.TrimSpace(string(version))
	evidence := "/proc/version: " + v
	switch {
	case strings.Contains(dmesg, "gVisor") || strings.Contains(v, "gVisor"):
		return "gvisor", evidence + "; dmesg: " + lastLines(dmesg, 2)
	case strings.Contains(v, "-fc-") || strings.Contains(string(cmdline), "virtio_mmio"):
		return "firecracker", evidence + "; cmdline: " + strings.TrimSpace(string(cmdline))
	case strings.Contains(string(cpuinfo), " hypervisor"):
		return "vm", evidence
	}
	return "host", evidence
}
