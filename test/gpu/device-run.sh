#!/usr/bin/env bash
# The real-GPU proof in ONE call of the device tool (test/gpu/README.md):
#   run(command="bash test/gpu/device-run.sh", carry=["bin/tessera-gpu-bundle.tar.gz"], timeout_s=540)
# Every phase of run.sh, most important first, under one time budget (BUDGET_S, 480 s), each under
# its own `timeout`; a phase the budget no longer fits is recorded as not run, never as a pass.
# After every phase $OUT holds ONE results JSON (results/<date>-<gpu model>.json, every phase so
# far) and ONE tarball of everything else (logs.tar.gz), so a call cut off still returns what the
# finished phases wrote. Arguments, if any, name the phases to run instead of all of them.
#
# Settings: GPU_BUNDLE (bin/tessera-gpu-bundle.tar.gz), GPU_RUN_DIR (.cache/gpu-run: unpacked once,
# kept while the machine stays warm), BUDGET_S (480), LIMIT_S_<phase> (that phase's limit), OUT (the device tool's; else $GPU_RUN_DIR/returned),
# and run.sh's own (DRY_RUN=1: the simulated node and the fake driver, what `make test` runs).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TARBALL=${GPU_BUNDLE:-$ROOT/bin/tessera-gpu-bundle.tar.gz}
RUN=${GPU_RUN_DIR:-$ROOT/.cache/gpu-run}
BUDGET_S=${BUDGET_S:-480}
T0=$(date +%s)
[[ -f $TARBALL ]] || { echo "device-run.sh: $TARBALL missing: make gpu-bundle here and carry it" >&2; exit 2; }
for t in timeout tar unshare; do command -v $t >/dev/null || { echo "device-run.sh: $t is required" >&2; exit 2; }; done
if [[ ! -f $RUN/stamp ]] || [[ $TARBALL -nt $RUN/stamp ]]; then
  rm -rf "$RUN/tessera-gpu-bundle" "$RUN/out" && mkdir -p "$RUN" && tar -C "$RUN" -xzf "$TARBALL" && touch "$RUN/stamp" ||
    { echo "device-run.sh: cannot unpack $TARBALL" >&2; exit 2; }
fi
B=$RUN/tessera-gpu-bundle
OUT_DIR=${OUT:-$RUN/returned}
LOG=$RUN/out/device-run.log

# Each phase's own limit in seconds, in the order they run: the issue's order, most important
# first. (a) discovery, CDI, the refusal table on the real NVML; (b) CUDA in a container from the
# CDI edits alone, nvidia-smi in the share; (c) PyTorch in a share at CAP_GIB, its children in
# their own PID namespace; (d) VMM under a cap (memory); (e) cuGetProcAddress vs dlsym;
# (f) the agent's NVML per-process audit (guard); the agent's measured compute file against a
# probe's known busy schedule and the raw NVML samples (feedback, ~20 s: issue 29); then the call overhead, the time-slicing probe
# (~10 s on a GPU: before compute, whose cases it explains) and the compute shares, which only get
# what is left. The preflight picks runc or the namespace fallback for the rest.
PHASES=(preflight node refusals container torch memory procaddr guard feedback overhead timeslice compute)
declare -A LIMIT=([preflight]=30 [node]=45 [refusals]=30 [container]=45 [torch]=150 [memory]=45 [procaddr]=30
  [guard]=45 [feedback]=40 [overhead]=30 [timeslice]=30 [compute]=300)
MIN_S=20 # a phase with less than this left is not started

# One JSON (the merged results) and one tarball (everything else) to $OUT, after every phase.
collect() {
  rm -f "$OUT_DIR"/*.json
  cp "$RUN"/out/results/*.json "$OUT_DIR/" 2>/dev/null
  nvidia-smi >"$RUN/out/nvidia-smi.txt" 2>&1
  local logs
  logs=$(cd "$RUN/out" && ls -d partial device-run.log nvidia-smi.txt work/inventory.json work/refusals.log work/containers/*/output.txt \
    work/guard/tessera-node.log work/guard/containers/*/output.txt work/feedback/tessera-node.log work/feedback/containers/*/output.txt work/feedback/feedback-raw.json work/preflight/*/*/output.txt work/*/child.log work/*/*/child.log 2>/dev/null)
  # shellcheck disable=SC2086 # one path a line, none with spaces
  [[ -n $logs ]] && tar -C "$RUN/out" -czf "$OUT_DIR/logs.tar.gz.tmp" $logs && mv "$OUT_DIR/logs.tar.gz.tmp" "$OUT_DIR/logs.tar.gz"
}

# What a phase cut off by its limit may leave running: its containers (runc's, the fallback's).
reap() {
  local id
  for id in $("$B/bin/runc" list -q 2>/dev/null | grep '^gpuproof-'); do "$B/bin/runc" delete --force "$id" >/dev/null 2>&1; done
  for id in $(ls /run/gpuproof-nsrunc 2>/dev/null); do "$B/bin/nsrunc" delete --force "$id" >/dev/null 2>&1; done
}

# a phase's result saying why it did not (all) run; -keep adds it to what the phase wrote so far
notrun() {
  local dry=()
  [[ ${DRY_RUN:-0} == 1 ]] && dry=(-dry-run)
  "$B/bin/gpuproof" notrun -phase "$1" -reason "$2" -out "$RUN/out/partial/$1.json" "${@:3}" "${dry[@]}" >/dev/null
}

wanted=("$@")
if [[ ${#wanted[@]} -eq 0 ]]; then
  wanted=("${PHASES[@]}")
  rm -rf "$RUN/out" && mkdir -p "$RUN/out" # a whole run starts clean; named phases add to what is there
fi
for p in "${wanted[@]}"; do
  [[ -n ${LIMIT[$p]:-} ]] || { echo "device-run.sh: unknown phase $p (${PHASES[*]})" >&2; exit 2; }
done
mkdir -p "$RUN/out/partial" "$OUT_DIR"
status=0
for p in "${wanted[@]}"; do
  left=$((BUDGET_S - ($(date +%s) - T0)))
  ov=LIMIT_S_$p # LIMIT_S_<phase>: another limit for one phase (the dry run cuts one short)
  own=${!ov:-${LIMIT[$p]}}
  limit=$own min=$MIN_S
  ((limit > left)) && limit=$left
  ((own < min)) && min=$own
  if ((limit < min)); then
    echo "[device-run] $p: not started, ${left}s of the ${BUDGET_S}s budget left" | tee -a "$LOG"
    notrun "$p" "not started: ${left} s of device-run.sh's ${BUDGET_S} s budget left (needs ${own} s)"
    status=$((status > 1 ? status : 1))
  else
    echo "[device-run] $p: up to ${limit}s (${left}s of the budget left)" | tee -a "$LOG"
    s0=$(date +%s)
    rm -f "$RUN/out/partial/$p.json" # what this run measures, nothing older
    OUT=$RUN/out timeout -k 5 "$limit" "$B/run.sh" "$p" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    echo "[device-run] $p: exit $rc after $(($(date +%s) - s0))s" | tee -a "$LOG"
    if ((rc == 124 || rc == 137)); then
      reap
      notrun "$p" "timed out after its ${limit} s limit (device-run.sh): the checks above are what it finished; its logs are in logs.tar.gz" -keep
      rc=1
    fi
    ((rc > status)) && status=$rc
  fi
  rm -f "$RUN"/out/results/*.json
  "$B/bin/gpuproof" merge -dir "$RUN/out/partial" -out-dir "$RUN/out/results" >>"$LOG" 2>&1
  collect
done
echo "[device-run] done in $(($(date +%s) - T0))s, exit $status; results: $(ls "$OUT_DIR"/*.json 2>/dev/null)" | tee -a "$LOG"
collect
exit $status
