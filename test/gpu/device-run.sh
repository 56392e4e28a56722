#!/usr/bin/env bash
# One call of the device tool: run phases of the real-GPU proof from the carried bundle.
#   run(command="bash test/gpu/device-run.sh node container overhead", carry=["bin/tessera-gpu-bundle.tar.gz"])
# The bundle is unpacked once under .cache/gpu-run (ignored, so it stays while the machine is warm),
# results accumulate in .cache/gpu-run/out across calls, and after every call the partial and merged
# results (and the phases' logs) are copied to $OUT, which the device tool brings back.
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
# the finished phases wrote.
collect() {
  cp -r "$RUN/out/partial" "$RUN/out/results" "$RUN/out/run.log" "$OUT_DIR/" 2>/dev/null
  cp "$RUN/out/work/inventory.json" "$OUT_DIR/" 2>/dev/null
  for f in "$RUN"/out/work/containers/*/output.txt "$RUN"/out/work/*/child.log "$RUN"/out/work/*/*/child.log; do
    [[ -f $f ]] && cp "$f" "$OUT_DIR/$(echo "${f#"$RUN"/out/work/}" | tr / _)"
  done
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
