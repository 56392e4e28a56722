#!/usr/bin/env bash
# Real-GPU checks of vcuda (the container GPU limiter) with PyTorch.
#
# Needs: an NVIDIA GPU with its driver (libcuda.so.1, libnvidia-ml.so.1,
# nvidia-smi), gcc + make, python3 with a CUDA build of PyTorch. Run from any
# directory:  test/gpu/run.sh
#
# Environment (all optional):
#   GPU_INDEX    which GPU (nvidia-smi index) to test; default 0
#   CAP_MIB      memory cap written into the limits file; default 4096
#   CORES        compute percent for the limiter check; default 30
#   SECONDS_RUN  length of each matmul measurement; default 10
#   OUT          directory for the build, logs and results; default a temp dir
#
# Checks (each prints PASS/FAIL; the script exits 1 if any failed):
#   0. with no limits file vcuda is a pass-through (PyTorch sees the whole GPU).
#   1. PyTorch, default caching allocator: OOM at the cap and not before;
#      torch.cuda.mem_get_info reports the cap.
#   2. the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (cuMemCreate).
#   3. the same with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync (pools).
#   4. nvidia-smi (NVML) under vcuda reports total = cap and the container's use.
#   5. two processes share one cap: together they never pass it.
#   6. the compute limiter at CORES% holds a matmul loop near CORES% of its
#      unlimited rate (within +-20% relative).
# vcuda counts what the process allocates; the CUDA context's own memory is
# outside the cap, hence "within the context's own overhead" below.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
GPU_INDEX=${GPU_INDEX:-0}
CAP_MIB=${CAP_MIB:-4096}
CORES=${CORES:-30}
SECONDS_RUN=${SECONDS_RUN:-10}
OUT=${OUT:-$(mktemp -d /tmp/vcuda-gpu-XXXXXX)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

log() { echo "[$(date +%H:%M:%S)] $*"; }
die() { echo "run.sh: $*" >&2; exit 2; }

command -v nvidia-smi >/dev/null || die "nvidia-smi not found: no NVIDIA driver here"
command -v make >/dev/null && command -v gcc >/dev/null || die "need gcc and make"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || die "python3 with a CUDA build of PyTorch is required"
if [[ -e /etc/tessera/vcuda/limits ]]; then
  die "/etc/tessera/vcuda/limits exists here; vcuda would use it instead of this script's limits"
fi

log "building vcuda into $OUT/build"
make -s -C "$ROOT/vcuda" BUILD="$OUT/build" "$OUT/build/libvcuda.so" >/dev/null
LIB="$OUT/build/libvcuda.so"

UUID=$(nvidia-smi -i "$GPU_INDEX" --query-gpu=uuid --format=csv,noheader | tr -d ' ')
TOTAL_MIB=$(nvidia-smi -i "$GPU_INDEX" --query-gpu=memory.total --format=csv,noheader,nounits | tr -d ' ')
[[ $UUID == GPU-* ]] || die "cannot read the UUID of GPU $GPU_INDEX: $UUID"
(( CAP_MIB < TOTAL_MIB )) || die "CAP_MIB=$CAP_MIB must be below the GPU's ${TOTAL_MIB} MiB"
CAP=$(( CAP_MIB * 1024 * 1024 ))
log "GPU $GPU_INDEX $UUID (${TOTAL_MIB} MiB); cap ${CAP_MIB} MiB"

# CUDA_VISIBLE_DEVICES by UUID: the process sees exactly the GPU we limit.
export CUDA_VISIBLE_DEVICES=$UUID
unset PYTORCH_CUDA_ALLOC_CONF

n=0
# write_limits <name> <cores>: a fresh limits file + region per check.
write_limits() {
  n=$((n + 1))
  local dir="$OUT/$1"
  rm -rf "$dir"; mkdir -p "$dir"
  cat >"$dir/limits" <<LIMITS
# written by test/gpu/run.sh
tessera-vcuda-limits 1
container gpu-check-$1
region $dir/region
gpu $UUID $CAP $2
LIMITS
  echo "$dir"
}

# vc <dir> <cmd...>: run under vcuda with that directory's limits.
vc() {
  local dir=$1; shift
  LD_PRELOAD="$LIB" TESSERA_VCUDA_LIMITS="$dir/limits" "$@"
}

RESULTS=()
record() { # record <name> <PASS|FAIL> <detail>
  RESULTS+=("$2 $1: $3")
  log "$2 $1: $3"
}

# 0: vcuda loaded but no limits file: a host process, untouched.
passthrough_check() {
  local out
  if out=$(LD_PRELOAD="$LIB" env -u TESSERA_VCUDA_LIMITS "$PY" -c '
import torch
x = torch.randn(4096, 4096, device="cuda"); y = x @ x; torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info()
print(total)' 2>"$OUT/passthrough.stderr") && (( out / 1048576 > TOTAL_MIB * 9 / 10 )); then
    record passthrough PASS "no limits file: PyTorch sees the whole GPU (${out} bytes)"
  else
    record passthrough FAIL "$out $(tail -3 "$OUT/passthrough.stderr" | tr '\n' ' ')"
  fi
}
passthrough_check

# 1-3: OOM at the cap with each PyTorch allocator.
oom_check() { # name alloc_conf slack_mib
  local name=$1 conf=$2 slack=$3 dir out
  dir=$(write_limits "$name" 100)
  local setconf=(env -u PYTORCH_CUDA_ALLOC_CONF)
  if [[ -n $conf ]]; then setconf=(env PYTORCH_CUDA_ALLOC_CONF="$conf"); fi
  if out=$(vc "$dir" "${setconf[@]}" "$PY" "$HERE/torch_checks.py" oom "$CAP" "$slack" 2>"$dir/stderr"); then
    record "$name" PASS "$out"
  else
    record "$name" FAIL "$out $(tail -5 "$dir/stderr" | tr '\n' ' ')"
  fi
}
oom_check torch-default "" 8
# expandable segments grow in 20 MiB steps for large blocks
oom_check torch-expandable "expandable_segments:True" 24
oom_check torch-async "backend:cudaMallocAsync" 8

# 4: nvidia-smi inside the share while a process holds 1 GiB.
smi_check() {
  local dir hold=$((1024 * 1024 * 1024)) total used pid
  dir=$(write_limits nvidia-smi 100)
  vc "$dir" "$PY" "$HERE/torch_checks.py" hold "$hold" "$dir/ready" "$dir/release" >"$dir/hold.out" 2>&1 &
  pid=$!
  for _ in $(seq 600); do [[ -e $dir/ready ]] && break; kill -0 $pid 2>/dev/null || break; sleep 0.1; done
  if [[ ! -e $dir/ready ]]; then
    record nvidia-smi FAIL "holder did not start: $(tail -3 "$dir/hold.out" | tr '\n' ' ')"
    return
  fi
  total=?; used=?
  read -r total used < <(vc "$dir" nvidia-smi -i "$GPU_INDEX" --query-gpu=memory.total,memory.used \
    --format=csv,noheader,nounits | tr -d ',') || true
  touch "$dir/release"; wait $pid || true
  # nvidia-smi prints MiB; used is the container's use (the 1 GiB tensor plus
  # what PyTorch allocated besides, e.g. its RNG state: allow 64 MiB).
  if [[ $total == "$CAP_MIB" && $used =~ ^[0-9]+$ ]] && (( used >= 1024 && used <= 1024 + 64 )); then
    record nvidia-smi PASS "total ${total} MiB used ${used} MiB"
  else
    record nvidia-smi FAIL "total ${total} MiB (want $CAP_MIB) used ${used} MiB (want ~1024)"
  fi
}
smi_check

# 5: two processes, one cap.
share_check() {
  local dir p1 p2 r1 r2 sum
  dir=$(write_limits share 100)
  vc "$dir" "$PY" "$HERE/torch_checks.py" share "$CAP" "$dir/ready1" "$dir/start" "$dir/r1" >"$dir/p1.out" 2>&1 & p1=$!
  vc "$dir" "$PY" "$HERE/torch_checks.py" share "$CAP" "$dir/ready2" "$dir/start" "$dir/r2" >"$dir/p2.out" 2>&1 & p2=$!
  for _ in $(seq 1200); do  # both contexts up (first CUDA init can be slow)
    [[ -e $dir/ready1 && -e $dir/ready2 ]] && break
    kill -0 $p1 2>/dev/null && kill -0 $p2 2>/dev/null || break
    sleep 0.1
  done
  touch "$dir/start"
  wait $p1 || true; wait $p2 || true
  r1=$(cat "$dir/r1" 2>/dev/null || echo -1); r2=$(cat "$dir/r2" 2>/dev/null || echo -1)
  sum=$(( r1 + r2 ))
  # each process ends when less than one 2 MiB small-pool segment is left,
  # possibly with its last segment partly used: at most ~6 MiB short
  if (( r1 >= 0 && r2 >= 0 && sum <= CAP && sum >= CAP - 8 * 1024 * 1024 )); then
    record two-processes PASS "process 1 ${r1} + process 2 ${r2} = ${sum} of cap ${CAP}"
  else
    record two-processes FAIL "process 1 ${r1} + process 2 ${r2} = ${sum}, cap ${CAP}; $(tail -2 "$dir/p1.out" "$dir/p2.out" | tr '\n' ' ')"
  fi
}
share_check

# 6: the compute limiter.
limiter_check() {
  local dir full part rate_full rate_part ratio
  dir=$(write_limits matmul-100 100)
  full=$(vc "$dir" "$PY" "$HERE/torch_checks.py" matmul "$SECONDS_RUN" 2>"$dir/stderr") \
    || { record limiter FAIL "unlimited run failed: $(tail -3 "$dir/stderr" | tr '\n' ' ')"; return; }
  dir=$(write_limits "matmul-$CORES" "$CORES")
  part=$(vc "$dir" "$PY" "$HERE/torch_checks.py" matmul "$SECONDS_RUN" 2>"$dir/stderr") \
    || { record limiter FAIL "limited run failed: $(tail -3 "$dir/stderr" | tr '\n' ' ')"; return; }
  rate_full=$("$PY" -c 'import json,sys; print(json.loads(sys.argv[1])["rate"])' "$full")
  rate_part=$("$PY" -c 'import json,sys; print(json.loads(sys.argv[1])["rate"])' "$part")
  ratio=$("$PY" -c 'import sys; print("%.3f" % (float(sys.argv[2]) / float(sys.argv[1])))' "$rate_full" "$rate_part")
  local throttled
  throttled=$("$PY" "$HERE/torch_checks.py" region "$dir/region" 2>/dev/null || true)
  if "$PY" -c 'import sys; r=float(sys.argv[1]); c=float(sys.argv[2])/100; sys.exit(0 if c*0.8 <= r <= c*1.2 else 1)' "$ratio" "$CORES"; then
    record limiter PASS "matmul rate at ${CORES}% = ${ratio} of unlimited (${rate_part}/s vs ${rate_full}/s) ${throttled}"
  else
    record limiter FAIL "matmul rate at ${CORES}% = ${ratio} of unlimited (${rate_part}/s vs ${rate_full}/s), want ${CORES}% +-20% ${throttled}"
  fi
}
limiter_check

echo
echo "vcuda real-GPU checks on $UUID (results and logs in $OUT):"
failed=0
for r in "${RESULTS[@]}"; do
  echo "  $r"
  [[ $r == FAIL* ]] && failed=1
done
exit $failed
