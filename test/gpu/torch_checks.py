#!/usr/bin/env python3
"""vcuda with PyTorch on a real GPU: the torch and compute phases of test/gpu/run.sh.

  torch_checks.py torch   --lib L --uuid U --cap-gib N --work DIR --out F [--confs C,...]
  torch_checks.py compute --lib L --uuid U --cap-gib N --work DIR --seconds S --out F
  torch_checks.py cases compute     (the phase's case names: what run.sh lists as not run without a GPU)
  torch_checks.py selftest          (no GPU, no torch: the helpers; run by the dry-run test)

The orchestrators run without vcuda and start one child process per case ("child-oom",
"child-compute") with vcuda preloaded (LD_PRELOAD, the host stand-in for a container's
/etc/ld.so.preload) and a limits file given by TESSERA_VCUDA_LIMITS. Results are one JSON file
in gpuproof's Phase shape: checks (pass/fail/not_checked) and figures, each naming what measured
it. Nothing is retried or smoothed: a number is what the run measured.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time

MiB = 1 << 20
GiB = 1 << 30
ALLOC_CONFS = ["", "expandable_segments:True", "backend:cudaMallocAsync"]
# gpuproof sits in the bundle's bin/ beside this script's folder
GPUPROOF = os.environ.get("GPUPROOF", os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "gpuproof"))
HOST_NVML = "nvidia-smi on the host, without vcuda (--query-compute-apps=pid,used_memory)"


# ---------------------------------------------------------------- helpers (no torch, selftest-ed)

class Phase:
    def __init__(self, name):
        self.d = dict(phase=name, dry_run=False, started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      seconds=0.0, env={}, checks=[], figures=[])
        self.t0 = time.time()

    def check(self, name, ok, measured_by, detail):
        self.d["checks"].append(dict(name=name, status="pass" if ok else "fail", detail=detail, measured_by=measured_by))

    def skip(self, name, measured_by, detail):
        self.d["checks"].append(dict(name=name, status="not_checked", detail=detail, measured_by=measured_by))

    def figure(self, name, value, unit, measured_by, goal="", ok=None):
        f = dict(name=name, value=float(value), unit=unit, measured_by=measured_by)
        if goal:
            f["goal"] = goal
            f["status"] = "pass" if ok else "fail"
        self.d["figures"].append(f)

    def failed(self):
        return sum(c["status"] == "fail" for c in self.d["checks"]) + sum(f.get("status") == "fail" for f in self.d["figures"])

    def write(self, path, quiet=False):
        self.d["seconds"] = time.time() - self.t0
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(self.d, f, indent=2)
        os.replace(path + ".tmp", path)
        if quiet:
            return
        for c in self.d["checks"]:
            print("%-11s %s: %s" % (c["status"], c["name"], c["detail"]), flush=True)
        for f in self.d["figures"]:
            print("%-11s %s = %.4g %s (%s)" % (f.get("status", "-"), f["name"], f["value"], f["unit"], f["measured_by"]), flush=True)


def write_limits(dirpath, uuid, cap, cores):
    """A vcuda limits file, written by gpuproof (api/v1's encoder: one writer of the format)."""
    out = subprocess.run([GPUPROOF, "limits", "-dir", dirpath, "-uuid", uuid, "-cap", str(cap), "-cores", str(cores)],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError("gpuproof limits: " + out.stderr)
    return out.stdout.strip()


def parse_apps(csv_text):
    """nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -> {pid: MiB}."""
    apps = {}
    for line in csv_text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            apps[int(parts[0])] = int(parts[1])
    return apps


def parse_confs(text):
    """--confs: allocator settings to check, comma-separated ("default" is PyTorch's own); all if empty."""
    if not text:
        return list(ALLOC_CONFS)
    confs = ["" if c == "default" else c for c in text.split(",")]
    unknown = [c for c in confs if c not in ALLOC_CONFS]
    if unknown:
        raise SystemExit("torch_checks.py: unknown --confs %s (known: default, %s)" % (unknown, ", ".join(ALLOC_CONFS[1:])))
    return confs


def busy_share(iterations, gpu_s_per_iter, wall_s):
    """Share of wall time the GPU spent on this process's work."""
    return iterations * gpu_s_per_iter / wall_s if wall_s > 0 else 0.0


def within(measured, target, rel):
    return abs(measured - target) <= rel * target


def child_env(lib, limits, conf=None):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TESSERA_VCUDA_LIMITS", "PYTORCH_CUDA_ALLOC_CONF")}
    if lib:
        env["LD_PRELOAD"] = lib
        env["TESSERA_VCUDA_LIMITS"] = limits
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    return env


def host_env():
    return {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TESSERA_VCUDA_LIMITS")}


def smi(args, env, prefix=()):
    return subprocess.run(list(prefix) + ["nvidia-smi"] + args, env=env, capture_output=True, text=True, timeout=60).stdout


def in_pidns(cmd, pidns):
    """The child in its own PID namespace, as a pod's process is (NVML then reports its host pid,
    not the one it knows itself by: the pod path vcuda must get right)."""
    return (["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "--"] + cmd) if pidns else cmd


def host_pid(proc, pidns):
    """The host pid of the child: unshare's only child when it runs in its own PID namespace."""
    if not pidns:
        return proc.pid
    try:
        with open("/proc/%d/task/%d/children" % (proc.pid, proc.pid)) as f:
            kids = f.read().split()
        return int(kids[0]) if kids else None
    except (OSError, ValueError):
        pass
    # a kernel without /proc/<pid>/task/<tid>/children (gVisor, say): the process whose parent it is
    for d in os.listdir("/proc"):
        try:
            with open("/proc/%s/stat" % d) as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == proc.pid:
                    return int(d)
        except (OSError, ValueError, IndexError):
            continue
    return None


def device_used():
    """The GPU's memory.used in MiB as the host's NVML sees it (None if unreadable)."""
    q = smi(["--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0")], host_env())
    return int(q.strip()) if q.strip().isdigit() else None


def physical(r, idle):
    """A child's physical use in MiB and how it was measured: its own line in the host's process list,
    or, where NVML reports pids of another PID namespace (this machine is itself a container), the
    device's use minus its use before the children started (nothing else may run meanwhile)."""
    if r["pid"] in r.get("host_apps", {}):
        return r["host_apps"][r["pid"]], HOST_NVML
    if idle is not None and r.get("device_used") is not None:
        return r["device_used"] - idle, "host NVML memory.used of the GPU minus its idle use (the process's pid is not in NVML's list: another PID namespace)"
    return None, HOST_NVML


def wait_for(path, proc, seconds):
    end = time.time() + seconds
    while time.time() < end:
        if os.path.exists(path):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.1)
    return False


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return dict(error="no result (%s)" % e)


def versions(phase):
    import ctypes
    e = phase.d["env"]
    try:
        import torch
        e["torch_version"] = torch.__version__
        e["torch_cuda"] = str(torch.version.cuda)
    except Exception as ex:  # reported, not fatal: the checks say what failed
        e["torch_version"] = "import failed: %s" % ex
    q = smi(["--query-gpu=name,driver_version", "--format=csv,noheader", "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0")], host_env())
    if "," in q:
        e["gpu_model"], e["driver_version"] = [s.strip() for s in q.strip().split(",", 1)]
    v = ctypes.c_int(0)
    try:
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v))
        e["cuda_driver_version"] = "%d.%d" % (v.value // 1000, v.value % 1000 // 10)
    except OSError as ex:
        e["cuda_driver_version"] = "unknown (%s)" % ex
    e["python"] = sys.version.split()[0]


# ---------------------------------------------------------------- torch phase: memory caps

def child_oom(a):
    """One case: optional CUDA graph holding memory, then fill to OOM; hold until released."""
    import torch
    res = dict(pid=os.getpid(), alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), graphs=a.graphs)
    x = torch.randn(1024, 1024, device="cuda")
    (x @ x).sum().item()  # cuBLAS loaded, as in any real job
    free0, total0 = torch.cuda.mem_get_info()
    res.update(free_before=free0, total_before=total0, total_memory=torch.cuda.get_device_properties(0).total_memory)
    keep = []
    if a.graphs:
        # 256 matmul outputs of 4 MiB allocated inside a capture: the graph's private pool (graph
        # memory nodes with backend:cudaMallocAsync) holds 1 GiB while the fill runs
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                x @ x
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = [x @ x for _ in range(256)]
        g.replay()
        torch.cuda.synchronize()
        keep += [g, outs]
        res["graph_bytes"] = 256 * 4 * MiB
    reached, err = 0, ""
    for size in () if a.no_fill else (64 * MiB, 2 * MiB, 256 * 1024):
        while True:
            try:
                keep.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
                reached += size
            except torch.cuda.OutOfMemoryError as e:
                err = "OutOfMemoryError: " + str(e).split("\n")[0][:200]
                break
            except Exception as e:  # anything else is a finding, not an OOM
                err = "%s: %s" % (type(e).__name__, str(e)[:200])
                break
        if not err.startswith("OutOfMemoryError"):
            break
    free1, total1 = torch.cuda.mem_get_info()
    res.update(reached=reached, error=err, free_at_oom=free1, total_at_oom=total1, reserved=torch.cuda.memory_reserved())
    with open(a.ready + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(a.ready + ".tmp", a.ready)  # the orchestrator reads it as soon as it exists
    while not os.path.exists(a.release):
        time.sleep(0.05)
    print("held", len(keep))


def run_case(a, name, conf, graphs, lib, limits, fill=True):
    """Starts a child, measures it from outside while it holds memory at the cap."""
    d = os.path.join(a.work, name)
    os.makedirs(d, exist_ok=True)
    ready, release = os.path.join(d, "ready.json"), os.path.join(d, "release")
    for p in (ready, release):
        if os.path.exists(p):
            os.remove(p)
    cmd = [sys.executable, os.path.abspath(__file__), "child-oom", "--ready", ready, "--release", release] + (["--graphs"] if graphs else []) + ([] if fill else ["--no-fill"])
    log = open(os.path.join(d, "child.log"), "w")
    pidns = getattr(a, "pidns", False)
    proc = subprocess.Popen(in_pidns(cmd, pidns), env=child_env(lib, limits, conf), stdout=log, stderr=subprocess.STDOUT)
    out = dict(ok=wait_for(ready, proc, 110))
    if out["ok"]:
        out.update(read_json(ready))
        out["ns_pid"], out["pid"] = out["pid"], host_pid(proc, pidns)
        out["pidns"] = pidns
        out["host_apps"] = parse_apps(smi(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"], host_env()))
        out["device_used"] = device_used()
        if lib:
            env = child_env(lib, limits)
            # nvidia-smi inside the share: the child's PID and mount namespaces, vcuda preloaded
            inside = ["nsenter", "-t", str(out["pid"]), "-p", "-m", "--"] if pidns and out["pid"] else []
            out["smi_gpu"] = smi(["--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits"], env, inside).strip()
            out["smi_apps"] = parse_apps(smi(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"], env, inside))
    open(release, "w").close()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()
    if not out["ok"]:
        with open(os.path.join(d, "child.log")) as f:
            out["log"] = f.read()[-600:]
    return out


def phase_torch(a):
    ph = Phase("torch")
    versions(ph)
    cap = int(a.cap_gib * GiB)
    ph.d["env"]["cap_bytes"] = str(cap)
    ph.d["env"]["children"] = "own PID namespace (unshare --pid --fork --mount-proc)" if a.pidns else "host processes"
    # The memory a PyTorch process uses beyond what its allocator reserved (context, modules,
    # cuBLAS), without vcuda: what vcuda must now count inside the cap.
    idle = device_used()
    ph.d["env"]["idle_device_used_mib"] = str(idle)
    base = run_case(a, "baseline", "", False, "", "", fill=False)
    overhead = None
    base_phys, base_by = physical(base, idle) if base.get("ok") else (None, "")
    if base_phys is not None:
        overhead = base_phys * MiB - base["reserved"]
        ph.figure("context overhead (PyTorch process, no vcuda)", overhead / MiB, "MiB",
                  base_by + " minus torch.cuda.memory_reserved(), after one 1024x1024 matmul")
    else:
        ph.check("baseline process", False, HOST_NVML, "no baseline: %s" % base.get("log", base)[:300])
    for conf in parse_confs(a.confs):
        for graphs in (False, True):
            # what is measured so far is on disk: a phase cut off by device-run.sh's limit keeps it
            ph.write(a.out, quiet=True)
            name = (conf.replace(":", "-") or "default") + ("+graphs" if graphs else "")
            limits = write_limits(os.path.join(a.work, name), a.uuid, cap, 100)
            r = run_case(a, name, conf, graphs, a.lib, limits)
            by = "torch_checks child-oom, PYTORCH_CUDA_ALLOC_CONF=%r%s" % (conf, ", CUDA graph holding 1 GiB" if graphs else "")
            if not r.get("ok"):
                ph.check(name + ": ran", False, by, r.get("log", "")[-300:])
                continue
            oom = r["error"].startswith("OutOfMemoryError")
            slack = 64 * MiB
            ph.check(name + ": OOM at the cap", oom and r["reached"] <= cap and r["reached"] >= r["free_before"] - (r.get("graph_bytes", 0) + slack),
                     by, "reached %d of cap %d (free at start %d), stopped by %s" % (r["reached"], cap, r["free_before"], r["error"][:120]))
            ph.check(name + ": mem_get_info total = cap", r["total_before"] == cap and r["total_at_oom"] == cap,
                     "torch.cuda.mem_get_info()", "total %d before, %d at OOM; cap %d" % (r["total_before"], r["total_at_oom"], cap))
            ph.check(name + ": total_memory = cap", r["total_memory"] == cap, "torch.cuda.get_device_properties(0).total_memory",
                     "%d; cap %d" % (r["total_memory"], cap))
            phys, phys_by = physical(r, idle)
            if phys is None:
                ph.check(name + ": physical use", False, HOST_NVML, "not measurable: host apps %s" % r["host_apps"])
            else:
                # vcuda charges contexts, modules and cuBLAS workspaces inside the cap (measured from
                # NVML per process): physical use stays within the cap plus the driver's last 2 MiB
                # page per context and 32 MiB of pool rounding.
                limit = cap / MiB + 32
                ph.figure(name + ": physical use at OOM", phys, "MiB", phys_by,
                          "<= cap + 32 MiB rounding = %.0f MiB (context overhead %s MiB counted inside the cap)"
                          % (limit, "%.0f" % (overhead / MiB) if overhead is not None else "unmeasured"), phys <= limit)
            gpu = [s.strip() for s in r.get("smi_gpu", "").split(",")]
            ph.check(name + ": nvidia-smi under vcuda shows the cap", len(gpu) == 2 and gpu[0] == str(cap // MiB),
                     "nvidia-smi --query-gpu=memory.total,memory.used with vcuda preloaded", "total,used = %s MiB; cap %d MiB" % (r.get("smi_gpu"), cap // MiB))
            apps = r.get("smi_apps", {})
            # inside its PID namespace the share may see itself by either number: say which
            ph.check(name + ": nvidia-smi under vcuda lists the process", r["pid"] in apps or r["ns_pid"] in apps,
                     "nvidia-smi --query-compute-apps with vcuda preloaded" + (", in the child's PID namespace" if r["pidns"] else ""),
                     "host pid %s, own pid %s; listed %s" % (r["pid"], r["ns_pid"], apps))
    ph.write(a.out)
    return 1 if ph.failed() else 0


# ---------------------------------------------------------------- compute phase: shares

def workloads(torch):
    """name -> (setup() -> step(), iterations per gated sample). Each step is one unit of work."""
    def matmul():
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        return lambda: a @ b

    def elementwise():
        # one tensor per grid size, from a few blocks to thousands of waves
        xs = [torch.rand(1 << k, device="cuda") for k in range(8, 27, 2)]
        def step():
            for x in xs:
                x.mul_(0.999).add_(0.001)
        return step

    def decode():
        # batch 4, hidden 4096, 32 layers of matmul + gelu + layer norm: small, launch-bound kernels
        ws = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(4)]
        h = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
        ln = torch.nn.LayerNorm(4096, device="cuda", dtype=torch.bfloat16)
        def step():
            x = h
            for i in range(32):
                x = ln(torch.nn.functional.gelu(x @ ws[i % 4]))
            return x
        return step
    def varying():
        # one kernel, one grid, its time varying per launch x0.2 or x1.8 (mean x1) in a fixed
        # random order: what attention over varying context lengths or MoE layers do to a
        # limiter that learns kernel times from samples (torch.cuda._sleep: one block, spinning
        # the given number of cycles)
        rng = random.Random(7)
        cycles = [int(1_000_000 * (0.2 if rng.random() < 0.5 else 1.8)) for _ in range(32)]
        def step():
            for c in cycles:
                torch.cuda._sleep(c)
        return step
    def decode_graph():
        # a decode step as serving stacks run it: one CUDA graph of a few small matmuls and
        # elementwise ops (batch 4, hidden 2048), captured once and replayed per token
        ws = [torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) / 45 for _ in range(4)]
        h = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
        def body():
            x = h
            for w in ws:
                x = torch.nn.functional.silu(x @ w) * 0.5 + x
            return x
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                body()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = body()
        def step():
            g.replay()
            return out
        return step
    return {"matmul": (matmul, 20), "elementwise": (elementwise, 20), "decode": (decode, 10),
            "decode-graph": (decode_graph, 50), "varying": (varying, 5)}


# the shares each workload is measured at, and the model's two shares (memory % of the GPU, compute %)
SHARES = (10, 30, 70)  # the shares; each is a child running every workload (~35 s)
MODEL_PAIR = ((40, 30), (40, 70))
WORKLOAD_NAMES = ("matmul", "elementwise", "decode", "decode-graph", "varying")


# Both sampling gates on one GPU (lib/libvcuda-hostgate.so: VCUDA_HOST_GATE_ONLY): the matmul
# pair again on the host gate, and a CUDA-graph loop at 10% beside a 70% matmul co-tenant (its
# long kernels keep the GPU's queue full: a slice boundary falls inside the graph's samples) on each
GATES = ("device gate", "host gate")
GRAPH_BESIDE = "decode-graph at 10% beside a 70% matmul co-tenant"


def compute_cases():
    """The compute phase's cases by name: what a run that could not happen lists as not run."""
    cases = ["%s at %d%%: busy share" % (w, p) for w in WORKLOAD_NAMES for p in SHARES]
    cases += ["%s, two containers: the %d%% one's busy share" % (w, p) for w in ("matmul", "varying") for p in (30, 70)]
    cases += ["matmul, two containers, host gate: the %d%% one's busy share" % p for p in (30, 70)]
    cases += ["matmul, two containers, host gate: the %d%% one's charged / its own GPU time" % p for p in (30, 70)]
    cases += ["%s, %s: busy share" % (GRAPH_BESIDE, g) for g in GATES]
    cases += ["%s, %s: charged / its own GPU time" % (GRAPH_BESIDE, g) for g in GATES]
    cases += ["model: alone, no vcuda: tokens_per_s"]
    cases += ["model: %d%% memory / %d%% compute: tokens_per_s" % mc for mc in MODEL_PAIR]
    cases += ["model: %d%% memory / %d%% compute: host NVML peak within the memory cap" % mc for mc in MODEL_PAIR]
    cases += ["model: tokens_per_s ratio, %d%% / %d%% compute" % (MODEL_PAIR[1][1], MODEL_PAIR[0][1])]
    return cases


def child_compute(a):
    import torch
    res = {}
    torch.zeros(1, device="cuda")
    for name, (setup, k) in workloads(torch).items():
        if a.only and name not in a.only.split(","):
            continue
        step = setup()
        t_end, warm = time.time() + 1.0, 0  # warm-up (and vcuda's first samples)
        while time.time() < t_end:
            step()
            warm += 1
        torch.cuda.synchronize()
        r = {"warm_steps": warm}
        if a.gate:
            # GPU time per step without launch gaps: a sleep kernel holds the stream while k steps
            # queue behind it, so the events bracket only the steps' kernels
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            best = None
            for _ in range(3):
                torch.cuda._sleep(200_000_000)
                s.record()
                for _ in range(k):
                    step()
                e.record()
                torch.cuda.synchronize()
                t = s.elapsed_time(e) / 1000 / k
                best = t if best is None else min(best, t)
            r["gpu_s_per_step"] = best
        if a.start:
            open(a.start + ".ready-%d" % os.getpid(), "w").close()
            while not os.path.exists(a.start):
                time.sleep(0.005)
        n, t0 = 0, time.time()
        while time.time() - t0 < a.seconds:
            step()
            n += 1
        torch.cuda.synchronize()
        r.update(steps=n, wall_s=time.time() - t0)
        res[name] = r
    with open(a.result + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(a.result + ".tmp", a.result)


def child_model(a):
    """GPT-2 small from a config, random weights (no download), generating greedy tokens for
    --seconds: tokens per second as a serving process sees them."""
    res = dict(pid=os.getpid())
    try:
        import torch
        import transformers
    except ImportError as e:
        res["error"] = "not_checked: cannot import transformers (%s)" % e
    else:
        res["transformers_version"] = transformers.__version__
        cfg = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12)
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg).to("cuda", dtype=torch.bfloat16).eval()
        ids = torch.randint(0, cfg.vocab_size, (MODEL_BATCH, 32), device="cuda")
        mask = torch.ones_like(ids)

        def gen(n):
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     pad_token_id=0)
            return (out.shape[1] - ids.shape[1]) * out.shape[0]
        gen(8)  # warm-up: kernels loaded, vcuda's first samples
        torch.cuda.synchronize()
        if a.start:
            open(a.start + ".ready-%d" % os.getpid(), "w").close()
            end = time.time() + 120
            while not os.path.exists(a.start) and time.time() < end:
                time.sleep(0.005)
        tokens, t0 = 0, time.time()
        while time.time() - t0 < a.seconds:
            tokens += gen(MODEL_TOKENS)
        torch.cuda.synchronize()
        wall = time.time() - t0
        res.update(tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall, batch=MODEL_BATCH)
    with open(a.result + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(a.result + ".tmp", a.result)


MODEL_BATCH, MODEL_TOKENS = 8, 32


def run_model(a, name, lib, cap, cores, start=""):
    d = os.path.join(a.work, name)
    os.makedirs(d, exist_ok=True)
    limits = write_limits(d, a.uuid, cap, cores) if lib else ""
    result = os.path.join(d, "result.json")
    if os.path.exists(result):
        os.remove(result)
    cmd = [sys.executable, os.path.abspath(__file__), "child-model", "--seconds", str(a.seconds), "--result", result]
    cmd += ["--start", start] if start else []
    log = open(os.path.join(d, "child.log"), "w")
    return subprocess.Popen(cmd, env=child_env(lib, limits), stdout=log, stderr=subprocess.STDOUT), result


def model_failed(r):
    """Why a model child gave no tokens_per_s ("" if it did), and whether that is a not_checked."""
    if "tokens_per_s" in r:
        return "", False
    why = r.get("error", "no result")
    return why, why.startswith("not_checked:")


def phase_model(a, ph):
    """The real model in two shares: alone without vcuda, then two processes side by side at
    40% memory / 30% compute and 40% / 70%; tokens_per_s of each, their ratio, and each one's
    host NVML peak against its memory cap."""
    import importlib.util
    by = "torch_checks child-model: GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12)), random weights, bf16, " \
         "batch %d, greedy generate of %d tokens repeated for %g s" % (MODEL_BATCH, MODEL_TOKENS, a.seconds)
    cases = [c for c in compute_cases() if c.startswith("model: ")]
    if importlib.util.find_spec("transformers") is None:
        for c in cases:
            ph.skip(c, by, "%s has no transformers module: the model cannot be built" % sys.executable)
        return
    total = smi(["--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0")], host_env()).strip()
    if not total.isdigit():
        for c in cases:
            ph.skip(c, by, "cannot read the GPU's memory.total from nvidia-smi: %r" % total)
        return
    pr = run_model(a, "model-alone", "", 0, 100)
    alone = finish_compute(pr, a.seconds + 120)
    why, skipped = model_failed(alone)
    if why:
        (ph.skip if skipped else (lambda n, m, d: ph.check(n, False, m, d)))(cases[0], by, why)
    else:
        ph.figure(cases[0], alone["tokens_per_s"], "tokens/s", by + ", no vcuda")
    ph.write(a.out, quiet=True)
    start = os.path.join(a.work, "model-pair-start")
    for f in os.listdir(a.work):
        if f.startswith("model-pair-start"):
            os.remove(os.path.join(a.work, f))
    caps = [int(total) * MiB * m // 100 for m, _ in MODEL_PAIR]
    procs = [run_model(a, "model-%d-%d" % mc, a.lib, cap, mc[1], start=start) for mc, cap in zip(MODEL_PAIR, caps)]
    # the host's NVML per process while both run: each one's peak against its own cap
    peak, end = {}, time.time() + a.seconds + 240
    started = False
    while time.time() < end and any(p.poll() is None for p, _ in procs):
        if not started and len([f for f in os.listdir(a.work) if f.startswith("model-pair-start.ready-")]) >= 2:
            open(start, "w").close()
            started = True
        for pid, mib in parse_apps(smi(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"], host_env())).items():
            peak[pid] = max(peak.get(pid, 0), mib)
        time.sleep(0.2 if started else 0.05)
    if not started:
        open(start, "w").close()
    got = [finish_compute(p, 10) for p in procs]
    tps = []
    for (mem, comp), cap, (proc, _), r in zip(MODEL_PAIR, caps, procs, got):
        name = "model: %d%% memory / %d%% compute" % (mem, comp)
        why, skipped = model_failed(r)
        if why:
            for c in (name + ": tokens_per_s", name + ": host NVML peak within the memory cap"):
                (ph.skip if skipped else (lambda n, m, d: ph.check(n, False, m, d)))(c, by, why)
            continue
        tps.append(r["tokens_per_s"])
        ph.figure(name + ": tokens_per_s", r["tokens_per_s"], "tokens/s", by + ", vcuda, side by side with the other share")
        if proc.pid in peak:
            ph.figure(name + ": host NVML peak within the memory cap", peak[proc.pid], "MiB", HOST_NVML + ", sampled every 200 ms",
                      "<= cap %d MiB + 32 MiB rounding" % (cap // MiB), peak[proc.pid] <= cap / MiB + 32)
        else:
            ph.skip(name + ": host NVML peak within the memory cap", HOST_NVML,
                    "pid %d not in NVML's list (NVML reports another PID namespace's pids): peaks seen %s" % (proc.pid, peak))
    ratio = cases[-1]
    if len(tps) == 2 and tps[0] > 0:
        ph.figure(ratio, tps[1] / tps[0], "x", "tokens_per_s of the %d%% share / the %d%% one's, side by side" % (MODEL_PAIR[1][1], MODEL_PAIR[0][1]))
    else:
        ph.skip(ratio, by, "needs both shares' tokens_per_s")
    ph.write(a.out, quiet=True)


def run_compute(a, name, lib, cores, gate=False, only="", start=""):
    d = os.path.join(a.work, name)
    limits = write_limits(d, a.uuid, int(a.cap_gib * GiB), cores) if lib else ""
    result = os.path.join(d, "result.json") if lib else os.path.join(a.work, name + ".json")
    os.makedirs(d, exist_ok=True)
    if os.path.exists(result):
        os.remove(result)
    cmd = [sys.executable, os.path.abspath(__file__), "child-compute", "--seconds", str(a.seconds), "--result", result]
    cmd += (["--gate"] if gate else []) + (["--only", only] if only else []) + (["--start", start] if start else [])
    log = open(os.path.join(d, "child.log"), "w")
    return subprocess.Popen(cmd, env=child_env(lib, limits), stdout=log, stderr=subprocess.STDOUT), result


def charge_ratio(r, gpu_s, region):
    """What vcuda charged a child (its region's busy_ns, read by gpuproof) over the GPU time its
    steps took alone (warm-up included: the region counts from the first launch); None if unread."""
    out = subprocess.run([GPUPROOF, "region", "-path", region], capture_output=True, text=True, timeout=60)
    busy = out.stdout.strip()
    own = (r.get("warm_steps", 0) + r["steps"]) * gpu_s
    return int(busy) / 1e9 / own if out.returncode == 0 and busy.isdigit() and own > 0 else None


def gate_used(child_dir):
    """Which sampling gate vcuda used in a child, from its log (vcuda says when it is the host's)."""
    try:
        with open(os.path.join(child_dir, "child.log")) as f:
            log = f.read()
    except OSError:
        return "unknown (no child.log)"
    i = log.find(HOST_GATE_LINE)
    return "device" if i < 0 else "host: " + log[i + len(HOST_GATE_LINE):].split(")", 1)[0]


# vcuda's line when its sampling gate is the host function's (src/hooks_launch.c, dgate_say_off)
HOST_GATE_LINE = "vcuda: sampling gate: host function ("


def run_pair(a, tag, specs, lib):
    """Children started together, each (workload, percent); their results, in order."""
    start = os.path.join(a.work, "pair-%s-start" % tag)
    for f in os.listdir(a.work):
        if f.startswith("pair-%s-start" % tag):
            os.remove(os.path.join(a.work, f))
    procs = [run_compute(a, "pair-%s-%d" % (tag, p), lib, p, only=wl, start=start) for wl, p in specs]
    end = time.time() + 120
    while time.time() < end and len([f for f in os.listdir(a.work) if f.startswith("pair-%s-start.ready-" % tag)]) < len(specs):
        time.sleep(0.05)
    open(start, "w").close()
    return [finish_compute(pr).get(wl) for (wl, _), pr in zip(specs, procs)]


def finish_compute(proc_result, timeout=120):
    proc, result = proc_result
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
    return read_json(result)


def phase_compute(a):
    ph = Phase("compute")
    versions(ph)
    ev = "CUDA events around k steps queued behind torch.cuda._sleep (no vcuda) x steps / wall time"
    base = finish_compute(run_compute(a, "none", "", 100, gate=True))
    if "error" in base:
        ph.check("unlimited run", False, "torch_checks child-compute without vcuda", base["error"])
        ph.write(a.out)
        return 1
    gpu_s = {w: r["gpu_s_per_step"] for w, r in base.items()}
    for w, r in base.items():
        ph.figure("%s: GPU time per step" % w, gpu_s[w] * 1e6, "us", "CUDA events, steps queued behind a sleep kernel (no vcuda)")
        ph.figure("%s: busy share, no vcuda" % w, 100 * busy_share(r["steps"], gpu_s[w], r["wall_s"]), "%", ev)
    full = finish_compute(run_compute(a, "vcuda-100", a.lib, 100))
    for w, r in full.items() if "error" not in full else []:
        ratio = (r["steps"] / r["wall_s"]) / (base[w]["steps"] / base[w]["wall_s"])
        ph.figure("%s: throughput at 100%% vs no vcuda" % w, 100 * ratio, "%", "steps per second under vcuda at 100% / without vcuda",
                  ">= 98%", ratio >= 0.98)
    ph.write(a.out, quiet=True)
    for p in SHARES:
        got = finish_compute(run_compute(a, "vcuda-%d" % p, a.lib, p))
        if "error" in got:
            ph.check("%d%%: ran" % p, False, "torch_checks child-compute", got["error"])
            continue
        for w, r in got.items():
            unlimited = busy_share(base[w]["steps"], gpu_s[w], base[w]["wall_s"])
            target = min(p / 100, unlimited)
            b = busy_share(r["steps"], gpu_s[w], r["wall_s"])
            ph.figure("%s at %d%%: busy share" % w, 100 * b, "%", ev,
                      "%.1f%% +-10%% (the target%s)" % (100 * target, ", capped by the unlimited run's busy share" if target < p / 100 else ""),
                      within(b, target, 0.10))
        ph.write(a.out, quiet=True)  # a phase cut off by its limit keeps what finished
    # two containers on one GPU, 30% and 70%, started together: on the matmul loop, then on the
    # varying-duration one (two processes time-slice the GPU: no MPS)
    for wl in ("matmul", "varying"):
        shares = []
        for p, r in zip((30, 70), run_pair(a, wl, [(wl, 30), (wl, 70)], a.lib)):
            if not r:
                ph.check("%s pair %d%%: ran" % (wl, p), False, "torch_checks child-compute", "no result")
                continue
            b = busy_share(r["steps"], gpu_s[wl], r["wall_s"])
            shares.append(b)
            ph.figure("%s, two containers: the %d%% one's busy share" % (wl, p), 100 * b, "%", ev, "%d%% +-10%%" % p,
                      within(b, p / 100, 0.10))
        if len(shares) == 2:
            ph.figure("%s, two containers: total busy share" % wl, 100 * sum(shares), "%", ev, "<= 100%", sum(shares) <= 1.0)
        ph.write(a.out, quiet=True)
    phase_gates(a, ph, gpu_s, ev)
    phase_model(a, ph)
    ph.write(a.out)
    return 1 if ph.failed() else 0


def phase_gates(a, ph, gpu_s, ev):
    """Both sampling gates on this GPU: the matmul pair on the host gate (its device-gate run is
    above), and a graph loop at 10% beside a 70% matmul co-tenant on each; each with what vcuda
    charged it over its own GPU time (above 1: the co-tenant's slices charged to it)."""
    charged_by = "the child's region busy_ns (vcuda's charge, gpuproof region) / ((warm-up + measured steps) x GPU time per step)"
    if not a.hostgate_lib or not os.path.exists(a.hostgate_lib):
        for c in compute_cases():
            if "host gate" in c or c.startswith(GRAPH_BESIDE):
                ph.skip(c, charged_by, "no host-gate build of vcuda (--hostgate-lib %r): both gates cannot be compared" % a.hostgate_lib)
        return
    runs = [("host gate", "matmul, two containers, host gate", "hg-matmul", [("matmul", 30), ("matmul", 70)], a.hostgate_lib)]
    runs += [(g, GRAPH_BESIDE + ", " + g, "graph-%s" % g.split()[0], [("decode-graph", 10), ("matmul", 70)], lib)
             for g, lib in zip(GATES, (a.lib, a.hostgate_lib))]
    for gate, name, tag, specs, lib in runs:
        got = run_pair(a, tag, specs, lib)
        for (wl, p), r in zip(specs, got):
            one = "%s: the %d%% one's" % (name, p) if name.startswith("matmul") else name + ":"
            if name.startswith(GRAPH_BESIDE) and wl != "decode-graph":
                continue  # the co-tenant: there to keep the GPU busy
            child = os.path.join(a.work, "pair-%s-%d" % (tag, p))
            if not r:
                ph.check(one + " busy share", False, "torch_checks child-compute", "no result")
                continue
            used = gate_used(child)
            b = busy_share(r["steps"], gpu_s[wl], r["wall_s"])
            ph.figure(one + " busy share", 100 * b, "%", ev + "; vcuda's sampling gate: " + used, "%d%% +-10%%" % p,
                      within(b, p / 100, 0.10))
            if not used.startswith(gate.split()[0]):
                ph.check(one + " the build's sampling gate", False, "the child's vcuda log", "%s, want %s" % (used, gate))
            ratio = charge_ratio(r, gpu_s[wl], os.path.join(child, "region"))
            if ratio is None:
                ph.skip(one + " charged / its own GPU time", charged_by, "the region could not be read")
            else:
                ph.figure(one + " charged / its own GPU time", ratio, "x", charged_by + "; gate: " + used)
        ph.write(a.out, quiet=True)


def print_cases(a):
    # the torch phase's cases depend on --confs: its "not run" line alone stands for them
    print("\n".join(compute_cases() if a.phase == "compute" else []))


# ---------------------------------------------------------------- selftest (no GPU, no torch)

def selftest(_):
    assert parse_apps("1234, 500\n 77, 12\n[N/A], x\n") == {1234: 500, 77: 12}
    assert parse_confs("") == ALLOC_CONFS and parse_confs("default,expandable_segments:True") == ["", "expandable_segments:True"]
    try:
        parse_confs("expandable_segments:true")
        raise AssertionError("an unknown allocator setting must be refused")
    except SystemExit:
        pass
    assert abs(busy_share(100, 0.003, 1.0) - 0.3) < 1e-9 and busy_share(1, 1, 0) == 0.0
    assert within(0.32, 0.30, 0.10) and not within(0.34, 0.30, 0.10)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        with open(write_limits(os.path.join(d, "c"), "GPU-00000000-0000-0000-0000-000000000000", 10 * GiB, 30)) as f:
            lines = f.read().splitlines()
    assert lines[0] == "tessera-vcuda-limits 1" and lines[-1] == "gpu GPU-00000000-0000-0000-0000-000000000000 10737418240 30", lines
    env = child_env("/lib/v.so", "/l", "backend:cudaMallocAsync")
    assert env["LD_PRELOAD"] == "/lib/v.so" and env["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"
    assert "LD_PRELOAD" not in child_env("", "")
    assert physical({"pid": 5, "host_apps": {5: 100}}, 3) == (100, HOST_NVML)
    assert physical({"pid": 5, "host_apps": {9: 100}, "device_used": 700}, 200)[0] == 500
    assert physical({"pid": 5, "host_apps": {}}, None)[0] is None
    # the pod path: the child knows itself as pid 1, the host (and NVML) by another pid
    assert in_pidns(["x"], False) == ["x"]
    proc = subprocess.Popen(in_pidns(["sh", "-c", "echo $$; sleep 3"], True), stdout=subprocess.PIPE, text=True)
    own = proc.stdout.readline().strip()
    hp = host_pid(proc, True)
    with open("/proc/%d/status" % hp) as f:
        nspid = [ln.split()[1:] for ln in f if ln.startswith("NSpid:")][0]
    proc.kill()
    proc.wait()
    assert own == "1" and nspid == [str(hp), "1"], (own, hp, nspid)
    assert tuple(workloads(None)) == WORKLOAD_NAMES, list(workloads(None))  # the case list names every workload
    cases = compute_cases()
    assert len(cases) == len(set(cases)) and not any("\n" in c for c in cases), cases  # run.sh passes them one per line
    for w in ("elementwise", "decode-graph"):
        assert all("%s at %d%%: busy share" % (w, p) in cases for p in (10, 30, 70)), cases
    assert "model: 40% memory / 30% compute: tokens_per_s" in cases and "model: alone, no vcuda: tokens_per_s" in cases
    assert all("%s, %s: busy share" % (GRAPH_BESIDE, g) in cases for g in GATES), cases
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "child.log"), "w") as f:
            f.write("x\nvcuda: sampling gate: host function (built with VCUDA_HOST_GATE_ONLY)\n")
        assert gate_used(d) == "host: built with VCUDA_HOST_GATE_ONLY", gate_used(d)
        os.remove(os.path.join(d, "child.log"))
        open(os.path.join(d, "child.log"), "w").close()
        assert gate_used(d) == "device"
    assert model_failed({"tokens_per_s": 1.0}) == ("", False)
    assert model_failed({"error": "not_checked: cannot import transformers (x)"})[1] and not model_failed({})[1]
    ph = Phase("torch")
    ph.check("a", True, "m", "d")
    ph.figure("f", 1, "MiB", "m", "<= 2", False)
    assert ph.failed() == 1
    print("selftest ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("torch", "compute"):
        s = sub.add_parser(name)
        s.add_argument("--lib", required=True)
        s.add_argument("--hostgate-lib", default="", help="compute: vcuda built with VCUDA_HOST_GATE_ONLY (both gates measured)")
        s.add_argument("--uuid", required=True)
        s.add_argument("--cap-gib", type=float, default=10)
        s.add_argument("--work", required=True)
        s.add_argument("--out", required=True)
        s.add_argument("--seconds", type=float, default=4)
        s.add_argument("--pidns", action="store_true", help="run each child in its own PID namespace, as a pod's process")
        s.add_argument("--confs", default="", help="torch: allocator settings, comma-separated (default, expandable_segments:True, backend:cudaMallocAsync); all if empty")
    s = sub.add_parser("child-oom")
    s.add_argument("--ready", required=True)
    s.add_argument("--release", required=True)
    s.add_argument("--graphs", action="store_true")
    s.add_argument("--no-fill", action="store_true")
    s = sub.add_parser("child-model")
    s.add_argument("--seconds", type=float, required=True)
    s.add_argument("--result", required=True)
    s.add_argument("--start", default="")
    s = sub.add_parser("cases", help="the phase's case names, one per line (run.sh lists them as not run where the phase cannot run)")
    s.add_argument("phase", choices=("torch", "compute"))
    s = sub.add_parser("child-compute")
    s.add_argument("--seconds", type=float, required=True)
    s.add_argument("--result", required=True)
    s.add_argument("--gate", action="store_true")
    s.add_argument("--only", default="")
    s.add_argument("--start", default="")
    sub.add_parser("selftest")
    a = ap.parse_args()
    if a.cmd in ("torch", "compute"):
        os.makedirs(a.work, exist_ok=True)
    fn = dict(torch=phase_torch, compute=phase_compute, selftest=selftest, cases=print_cases)
    fn = fn.get(a.cmd) or {"child-oom": child_oom, "child-compute": child_compute, "child-model": child_model}[a.cmd]
    sys.exit(fn(a) or 0)


if __name__ == "__main__":
    main()
