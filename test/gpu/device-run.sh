#!/usr/bin/env bash
# One call of the device tool: run phases of the real-GPU proof from the carried bundle.
#   run(command="bash test/gpu/device-run.sh node container memory guard overhead", carry=["bin/tessera-gpu-bundle.tar.gz"])
# The bundle is unpacked once under .cache/gpu-run (ignored, so it stays while the machine is warm),
# results accumulate in .cache/gpu-run/out across calls, and after every call the partial and merged
# results and a tarball of the phases' logs are copied to $OUT, which the device tool brings back.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TARBALL=$ROOT/bin/tessera-gpu-bundle.tar.gz
RUN=$ROOT/.cache/gpu-run
[[ -f $TARBALL ]] || { echo "device-run.sh: $TARBALL missing: make gpu-bundle here and carry it" >&2; exit 2; }
if [[ ! -f $RUN/stamp ]] || [[ $TARBALL -nt $RUN/stamp ]]; then
  rm -rf "$RUN/tessera-gpu-bundle" && mkdir -p "$RUN" && tar -C "$RUN" -xzf "$TARBALL" && touch "$RUN/stamp"
fi
OUT_DIR=${OUT:-$RUN/returned}
mkdir -p "$RUN/out" "$OUT_DIR"
# Copied after every phase: a call cut off by the device tool's time limit still returns what
# the finished phases wrote. The tool brings back at most 8 files: the merged results, one tarball
# of the partial results and every log (the run, the containers, the agent, PyTorch's children),
# and nvidia-smi's view.
collect() {
  cp "$RUN"/out/results/*.json "$OUT_DIR/" 2>/dev/null
  local logs
  logs=$(cd "$RUN/out" && ls -d partial run.log work/inventory.json work/containers/*/output.txt work/guard/tessera-node.log \
    work/guard/containers/*/output.txt work/*/child.log work/*/*/child.log 2>/dev/null)
  # shellcheck disable=SC2086 # one path a line, none with spaces
  [[ -n $logs ]] && tar -C "$RUN/out" -czf "$OUT_DIR/logs.tar.gz" $logs
}
nvidia-smi >"$OUT_DIR/nvidia-smi.txt" 2>&1
status=0
for phase in "$@"; do
  OUT=$RUN/out "$RUN/tessera-gpu-bundle/run.sh" "$phase" 2>&1 | tee -a "$RUN/out/run.log"
  rc=${PIPESTATUS[0]}
  (( rc > status )) && status=$rc
  collect
done
exit $status
