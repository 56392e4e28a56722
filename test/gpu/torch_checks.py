#!/usr/bin/env python3
"""Real-GPU checks of vcuda with PyTorch; driven by run.sh (see there).

Every mode prints one JSON line with what it measured and exits non-zero if a
check failed. vcuda must already be preloaded (LD_PRELOAD) with a limits file.
"""
import json
import os
import sys
import time

MiB = 1 << 20


def fail(msg, **kw):
    print(json.dumps(dict(ok=False, error=msg, **kw)), flush=True)
    sys.exit(1)


def torch_cuda():
    import torch
    if not torch.cuda.is_available():
        fail("torch.cuda.is_available() is False")
    torch.cuda.init()
    return torch


def fill(torch, sizes):
    """Allocates tensors of each size in turn until OOM; returns (held, bytes)."""
    held, reached = [], 0
    for size in sizes:
        while True:
            try:
                held.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.cuda.OutOfMemoryError:
                break
            reached += size
    return held, reached


def mode_oom(cap, slack_mib):
    """OOM at the cap and not before; mem_get_info reports the cap."""
    torch = torch_cuda()
    free0, total0 = torch.cuda.mem_get_info()
    # 32 MiB blocks get segments of their own size, 2 MiB ones come from
    # 20 MiB segments, 256 KiB ones from 2 MiB segments: the last step stops
    # within ~4 MiB of the cap
    held, reached = fill(torch, [32 * MiB, 2 * MiB, 256 * 1024])
    free1, total1 = torch.cuda.mem_get_info()
    res = dict(mode="oom", alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), cap=cap,
               reached=reached, free_before=free0, total_before=total0, free_at_oom=free1,
               reserved=torch.cuda.memory_reserved())
    if total0 != cap or total1 != cap:
        fail("mem_get_info total is not the cap", **res)
    if free0 > cap:
        fail("mem_get_info free above the cap", **res)
    if reached > cap:
        fail("allocated past the cap", **res)
    if reached < cap - slack_mib * MiB:
        fail("OOM before the cap (more than %d MiB short)" % slack_mib, **res)
    if free1 > slack_mib * MiB:
        fail("mem_get_info free at OOM is not ~0", **res)
    print(json.dumps(dict(ok=True, **res)), flush=True)


def mode_hold(nbytes, ready, release):
    """Holds nbytes until the file `release` exists; creates `ready` first."""
    torch = torch_cuda()
    t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    open(ready, "w").close()
    while not os.path.exists(release):
        time.sleep(0.05)
    del t
    print(json.dumps(dict(ok=True, mode="hold", bytes=nbytes)), flush=True)


def mode_share(cap, ready, start, out):
    """One of two processes filling the same cap at the same time."""
    torch = torch_cuda()
    torch.empty(1, device="cuda")  # context up before the race starts
    open(ready, "w").close()
    while not os.path.exists(start):
        time.sleep(0.01)
    # 16 MiB blocks get segments of their own size; 256 KiB ones come from
    # 2 MiB small-pool segments, so each process stops < 2 MiB from the cap
    held, reached = fill(torch, [16 * MiB, 256 * 1024])
    with open(out, "w") as f:
        f.write(str(reached))
    # hold until the other process is done too
    time.sleep(3)
    print(json.dumps(dict(ok=True, mode="share", reached=reached)), flush=True)


def mode_matmul(seconds):
    """Matmul loop rate (iterations per second), GPU-bound."""
    torch = torch_cuda()
    n = int(os.environ.get("MATMUL_N", "8192"))
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    t_end = time.time() + 1.0  # warm-up (and the limiter's calibration)
    while time.time() < t_end:
        c = a @ b
    torch.cuda.synchronize()
    it, t0 = 0, time.time()
    while time.time() - t0 < seconds:
        c = a @ b
        it += 1
    torch.cuda.synchronize()
    dt = time.time() - t0
    del c
    print(json.dumps(dict(ok=True, mode="matmul", n=n, iterations=it, seconds=dt, rate=it / dt)), flush=True)


def mode_region(path):
    """The first GPU record of a vcuda region (layout: vcuda/README.md)."""
    import struct
    with open(path, "rb") as f:
        b = f.read(4096 + 256)
    magic, version = struct.unpack_from("<QI", b, 0)
    if magic != 0x31414455435653 or version != 1:
        fail("not a vcuda region v1: %s" % path)
    g = 4096
    used, = struct.unpack_from("<Q", b, g + 64)
    throttled_ns, events, ooms, reclaims = struct.unpack_from("<QQQQ", b, g + 192)
    print(json.dumps(dict(used=used & ~(1 << 63), throttled_s=throttled_ns / 1e9, throttle_events=events,
                          oom_events=ooms, reclaims=reclaims)))


def main():
    m = sys.argv[1]
    if m == "oom":
        mode_oom(int(sys.argv[2]), int(sys.argv[3]))
    elif m == "hold":
        mode_hold(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    elif m == "share":
        mode_share(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
    elif m == "region":
        mode_region(sys.argv[2])
    elif m == "matmul":
        mode_matmul(float(sys.argv[2]))
    else:
        fail("unknown mode " + m)


if __name__ == "__main__":
    main()
