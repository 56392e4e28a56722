#!/usr/bin/env bash
# The real-GPU proof of Tessera (issue 13), run from the unpacked bundle (`make gpu-bundle`):
#
#   ./run.sh preflight   the sandbox (gVisor/Firecracker), cgroup2, whether runc starts a container,
#                        else the namespace fallback (gpuproof nsrunc); the other phases use what works
#   ./run.sh node        discovery + CDI specs on this machine vs nvidia-smi, CUDA, sysfs   (~1 min)
#   ./run.sh refusals    the strict simulated NVML's refusal table (realnvml test) on this NVML
#   ./run.sh container   CUDA in runc containers made only from the CDI specs (+ vcuda)       (~1 min)
#   ./run.sh memory      per-context overhead in a container's PID namespace; VMM create/map/
#                        release under a cap, NVML on the host never above it                 (~1 min)
#   ./run.sh guard       the node agent's memory guard kills a share allocating past vcuda     (~1 min)
#   ./run.sh feedback    the agent's measured compute file vs a probe's known busy schedule, and the raw
#                        NVML per-process samples it integrates (issue 29)                    (~20 s)
#   ./run.sh torch       vcuda memory caps with PyTorch: 3 allocators x CUDA graphs on/off    (~2-3 min)
#   ./run.sh compute     vcuda compute shares 10/30/70%, two containers 30+70, 100% cost,
#                        GPT-2 small in two shares (40%/30% + 40%/70%) beside it alone       (~4 min)
#   ./run.sh procaddr    cuGetProcAddress vs dlsym, every hooked symbol, 12000/12080/13000 x ptsz
#   ./run.sh overhead    ns added per intercepted call, real driver next to the fake driver   (~1 min)
#   ./run.sh timeslice   how the GPU time-slices two processes (slicebench), and vcuda's charge
#                        beside a co-tenant with each sampling gate                           (~10 s)
#   ./run.sh all         all of the above (device-run.sh runs them under one time budget)
#
# Each phase writes $OUT/partial/<phase>.json as it ends, then merges every phase so far into
# $OUT/results/<date>-<gpu model>.json; render it with `gpuproof tables` (test/gpu/README.md).
# Exit status: 0 all checks passed, 1 some check failed (results written all the same), 2 the
# phase could not run (a missing tool, a bad setting).
#
# Settings (environment): OUT (default ./out), GPU_INDEX (0), CAP_GIB (10), DRIVER_ROOT (auto),
# PYTHON (python3), COMPUTE_SECONDS (4, per measurement), TORCH_CONFS (the torch phase's allocator
# settings, comma-separated: default,expandable_segments:True,backend:cudaMallocAsync; all if empty), DRY_RUN=1 (the simulated node and the
# fake driver in this bundle: no GPU needed; torch and compute need a GPU and write "not run").
set -euo pipefail

B=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$B/out}
GPU_INDEX=${GPU_INDEX:-0}
CAP_GIB=${CAP_GIB:-10}
DRIVER_ROOT=${DRIVER_ROOT:-auto}
PYTHON=${PYTHON:-python3}
COMPUTE_SECONDS=${COMPUTE_SECONDS:-4}
TORCH_CONFS=${TORCH_CONFS:-}
DRY_RUN=${DRY_RUN:-0}
WORK=$OUT/work PARTIAL=$OUT/partial RESULTS=$OUT/results
PROOF=$B/bin/gpuproof
LIB=$B/lib/libvcuda.so
HOSTGATE_LIB=$B/lib/libvcuda-hostgate.so # VCUDA_HOST_GATE_ONLY: the host-function sampling gate only

die() { echo "run.sh: $*" >&2; exit 2; }
log() { echo "[$(date -u +%H:%M:%S)] $*"; }

PHASES="preflight node refusals container torch memory procaddr guard feedback overhead timeslice compute"
[[ $# -eq 1 ]] || die "usage: run.sh ${PHASES// /|}|all"
[[ $(id -u) -eq 0 ]] || die "run as root: runc and the device nodes need it"
for f in bin/tessera-node bin/gpuproof bin/runc bin/nsrunc bin/cudaprobe bin/callbench bin/memprobe bin/procprobe bin/slicebench bin/nvml-refusals.test \
  lib/libvcuda.so lib/libvcuda-hostgate.so lib/hooktable.txt fake/libcuda.so.1 rootfs/lib64/ld-linux-x86-64.so.2; do
  [[ -e $B/$f ]] || die "$B/$f is missing: this is not a complete bundle (make gpu-bundle)"
done
# Everything here was built against glibc 2.34+ (see MANIFEST); say so plainly instead of failing oddly.
glibc_err=$("$PROOF" 2>&1 >/dev/null || true)
[[ $glibc_err != *GLIBC_* ]] || die "this machine's glibc is older than the bundle needs: $glibc_err"
mkdir -p "$WORK" "$PARTIAL" "$RESULTS"

dry=()
if [[ $DRY_RUN == 1 ]]; then
  dry=(-dry-run)
  # The host side of the dry run sees the simulated node through the fake driver, as the real
  # host sees its GPUs through the real one: libcuda/NVML from the bundle, the node's GPU list
  # and device nodes from the simulated root tessera-node lays out under $WORK/sim.
  export LD_LIBRARY_PATH=$B/fake PATH=$B/fake:$PATH
  export FAKE_GPU_NODE_FILE=$WORK/sim/root/etc/tessera-sim/gpus FAKE_DEV_ROOT=$WORK/sim/root/dev
  # where the containers' fake driver records each process's memory (NVML's per-process list)
  export FAKE_SIM_DRIVER_DIR=$WORK/sim/root/run/tessera-sim/driver
fi
sim_flags=("--state-dir=$WORK/sim" "--sim-driver-dir=$B/fake")

# The container runtime the preflight found working (runc, or the namespace fallback); runc until
# a preflight ran. CONTAINER_RUNTIME=runc|fallback|auto (auto) is what the preflight may choose.
CONTAINER_RUNTIME=${CONTAINER_RUNTIME:-auto}
RUNC=$B/bin/runc
[[ -s $WORK/runtime ]] && RUNC=$(cat "$WORK/runtime")

# one results file: a merge before the node phase named the GPU "unknown-gpu"
merge() { rm -f "$RESULTS"/*.json && "$PROOF" merge -dir "$PARTIAL" -out-dir "$RESULTS" || true; }

phase_preflight() {
  rm -f "$WORK/runtime"
  local rc=0
  "$PROOF" preflight -runc "$B/bin/runc" -fallback "$B/bin/nsrunc" -rootfs "$B/rootfs" -work "$WORK" \
    -out "$PARTIAL/preflight.json" -runtime-file "$WORK/runtime" -runtime "$CONTAINER_RUNTIME" "${dry[@]}" || rc=$?
  [[ -s $WORK/runtime ]] && RUNC=$(cat "$WORK/runtime")
  return $rc
}

phase_refusals() {
  "$PROOF" refusals -test-binary "$B/bin/nvml-refusals.test" -out "$PARTIAL/refusals.json" -log "$WORK/refusals.log" "${dry[@]}"
}

phase_procaddr() {
  "$PROOF" procaddr -procprobe "$B/bin/procprobe" -cudaprobe "$B/bin/cudaprobe" -hook-table "$B/lib/hooktable.txt" -vcuda-library "$LIB" \
    -work "$WORK/procaddr" -out "$PARTIAL/procaddr.json" "${dry[@]}"
}

phase_node() {
  local backend=(-backend nvml -driver-root "$DRIVER_ROOT") extra=()
  if [[ $DRY_RUN == 1 ]]; then
    backend=(-backend sim)
    extra=(-- "${sim_flags[@]}")
  fi
  "$PROOF" node -tessera-node "$B/bin/tessera-node" "${backend[@]}" -work "$WORK" -out "$PARTIAL/node.json" \
    -vcuda-library "$LIB" -cudaprobe "$B/bin/cudaprobe" "${dry[@]}" "${extra[@]}"
}

phase_container() {
  need_specs || return 2
  "$PROOF" container -work "$WORK" -out "$PARTIAL/container.json" -rootfs "$B/rootfs" -runc "$RUNC" \
    -gpu-index "$GPU_INDEX" -share-mib 4096 "${dry[@]}"
}

need_specs() {
  [[ -f $WORK/inventory.json ]] || { echo "run.sh: run the node phase first (it writes the CDI specs the containers use)" >&2; return 2; }
}

phase_memory() {
  need_specs || return 2
  local nvml=auto
  [[ $DRY_RUN == 1 ]] && nvml=$B/fake/libnvidia-ml.so.1
  "$PROOF" memory -work "$WORK" -out "$PARTIAL/memory.json" -rootfs "$B/rootfs" -runc "$RUNC" \
    -gpu-index "$GPU_INDEX" -share-mib 4096 -nvml-library "$nvml" "${dry[@]}"
}

phase_guard() {
  need_specs || return 2
  local backend=(-backend nvml -driver-root "$DRIVER_ROOT") extra=()
  if [[ $DRY_RUN == 1 ]]; then
    backend=(-backend sim)
    extra=(-- "${sim_flags[@]}")
  fi
  "$PROOF" guard -work "$WORK" -out "$PARTIAL/guard.json" -rootfs "$B/rootfs" -runc "$RUNC" \
    -tessera-node "$B/bin/tessera-node" -vcuda-library "$LIB" -gpu-index "$GPU_INDEX" -cap-mib 1024 \
    "${backend[@]}" "${dry[@]}" "${extra[@]}"
}

# the agent's measured compute file beside the raw NVML samples, for a probe with a known busy
# schedule in a share container (issue 29): shorter segments in a dry run, the same checks
phase_feedback() {
  need_specs || return 2
  local backend=(-backend nvml -driver-root "$DRIVER_ROOT") extra=() sched=(-busy-s 2 -gap-s 3)
  if [[ $DRY_RUN == 1 ]]; then
    backend=(-backend sim)
    extra=(-- "${sim_flags[@]}")
    sched=(-busy-s 1 -gap-s 1.5)
  fi
  "$PROOF" feedback -work "$WORK" -out "$PARTIAL/feedback.json" -rootfs "$B/rootfs" -runc "$RUNC" \
    -tessera-node "$B/bin/tessera-node" -vcuda-library "$LIB" -gpu-index "$GPU_INDEX" "${sched[@]}" \
    "${backend[@]}" "${dry[@]}" "${extra[@]}"
}

phase_overhead() {
  local real=true
  [[ $DRY_RUN == 1 ]] && real=false
  "$PROOF" overhead -callbench "$B/bin/callbench" -vcuda-library "$LIB" -fake-dir "$B/fake" -real=$real \
    -work "$WORK/overhead" -out "$PARTIAL/overhead.json" "${dry[@]}"
}

phase_timeslice() {
  "$PROOF" timeslice -slicebench "$B/bin/slicebench" -vcuda-library "$LIB" -vcuda-hostgate "$HOSTGATE_LIB" -fake-dir "$B/fake" \
    -work "$WORK/timeslice" -out "$PARTIAL/timeslice.json" "${dry[@]}"
}

# torch and compute run the host's PyTorch with vcuda preloaded as in a share container and its
# limits given by TESSERA_VCUDA_LIMITS (honoured only where /etc/tessera/vcuda/limits is absent);
# torch's children each run in their own PID namespace (unshare --pid --fork --mount-proc), as a
# pod's process does, so NVML reports them by a pid they do not know themselves by.
torch_preflight() {
  local why=""
  if [[ $DRY_RUN == 1 ]]; then why="the $1 phase needs a GPU and PyTorch: it has no dry run (torch_checks.py is only compiled)"
  elif [[ -e /etc/tessera/vcuda/limits ]]; then why="/etc/tessera/vcuda/limits exists here; vcuda would use it instead of this script's limits"
  elif ! command -v nvidia-smi >/dev/null; then why="nvidia-smi not found"
  elif ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then why="$PYTHON has no CUDA build of PyTorch"
  else
    UUID=$(nvidia-smi -i "$GPU_INDEX" --query-gpu=uuid --format=csv,noheader | tr -d ' ')
    [[ $UUID == GPU-* ]] || why="cannot read the UUID of GPU $GPU_INDEX: $UUID"
  fi
  if [[ -n $why ]]; then
    echo "run.sh: $why" >&2
    # said in the results too, with each case the phase would have measured: a phase that did
    # not run is not a pass, and no case goes missing from the results
    local cases
    cases=$("$PYTHON" "$B/torch_checks.py" cases "$1") || cases=""
    "$PROOF" notrun -phase "$1" -reason "$why" -cases "$cases" -out "$PARTIAL/$1.json" "${dry[@]}" >/dev/null || true
    return 2
  fi
  export CUDA_VISIBLE_DEVICES=$UUID GPUPROOF=$PROOF
}

phase_torch() {
  torch_preflight torch || return 2
  "$PYTHON" "$B/torch_checks.py" torch --lib "$LIB" --uuid "$UUID" --cap-gib "$CAP_GIB" --work "$WORK/torch" \
    --confs "$TORCH_CONFS" --pidns --out "$PARTIAL/torch.json"
}

phase_compute() {
  torch_preflight compute || return 2
  "$PYTHON" "$B/torch_checks.py" compute --lib "$LIB" --hostgate-lib "$HOSTGATE_LIB" --uuid "$UUID" --cap-gib "$CAP_GIB" --work "$WORK/compute" \
    --seconds "$COMPUTE_SECONDS" --out "$PARTIAL/compute.json"
}

status=0
run_phase() {
  log "phase $1"
  local rc=0
  "phase_$1" || rc=$?
  merge
  log "phase $1: exit $rc"
  (( rc == 0 )) || status=$(( rc > status ? rc : status ))
}

case $1 in
  all) for p in $PHASES; do run_phase "$p"; done ;;
  *)
    [[ " $PHASES " == *" $1 "* ]] || die "unknown phase $1 (${PHASES// /|}|all)"
    run_phase "$1"
    ;;
esac
exit $status
