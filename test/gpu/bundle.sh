#!/usr/bin/env bash
# Builds the bundle carried to a GPU machine for the real-GPU proof (test/gpu/README.md):
#   bin/   tessera-node, gpuproof, runc (static), nsrunc (the namespace fallback: gpuproof nsrunc),
#          cudaprobe, callbench, memprobe, procprobe, slicebench, nvml-refusals.test (internal/gpu's realnvml test)
#   lib/   libvcuda.so, libvcuda-hostgate.so (built with VCUDA_HOST_GATE_ONLY: both sampling gates on one GPU), hooktable.txt (vcuda's hooked symbols, from src/procaddr.c, for procprobe)
#   fake/  vcuda/test's fake driver (libcuda.so.1, libnvidia-ml.so.1, nvidia-smi): the dry run, and
#          the overhead phase's fake-driver figure taken on the GPU machine's own CPU
#   rootfs/  busybox + Debian's libc6 + cudaprobe + memprobe + slicebench: the runc containers' root
#   run.sh, torch_checks.py, README.md, MANIFEST
# usage: bundle.sh <out.tar.gz>   (needs `make tools`: busybox and glibc under $TESSERA_TOOLS)
set -euo pipefail
OUT=$1
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TOOLS=${TESSERA_TOOLS:-$ROOT/.cache/tools}
BB=$TOOLS/busybox/bin/busybox GLIBC=$TOOLS/glibc
for need in "$BB" "$GLIBC/lib64/ld-linux-x86-64.so.2"; do
  [ -e "$need" ] || { echo "bundle.sh: $need is missing: run \`make tools\` first" >&2; exit 1; }
done
for t in go gcc make tar; do command -v $t >/dev/null || { echo "bundle.sh: $t is required" >&2; exit 1; }; done
log() { echo "[gpu-bundle] $*" >&2; }

W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
B=$W/tessera-gpu-bundle
mkdir -p "$B/bin" "$B/lib" "$B/fake"

log "tessera-node, gpuproof, the realnvml test"
(cd "$ROOT" && CGO_CFLAGS="-O2 -Wno-deprecated-declarations" go build -trimpath -ldflags "-s -w" -o "$B/bin/" ./cmd/tessera-node ./test/gpu/gpuproof)
(cd "$ROOT" && CGO_CFLAGS="-O2 -Wno-deprecated-declarations" go test -c -tags realnvml -trimpath -ldflags "-s -w" -o "$B/bin/nvml-refusals.test" ./internal/gpu)
cat >"$B/bin/nsrunc" <<'EOF'
#!/bin/sh
# runc's verbs without runc: the preflight's fallback where runc cannot start a container (gpuproof/nsrunc.go)
exec "$(dirname "$0")/gpuproof" nsrunc "$@"
EOF
chmod 755 "$B/bin/nsrunc"

# runc as test/tools/install.sh pins it, linked statically: the GPU machine may lack libseccomp.
RUNC_V=$(sed -n 's/.*RUNC_V=\(v[0-9.]*\).*/\1/p' "$ROOT/test/tools/install.sh" | head -1)
# Cached beside this checkout (not under $TESSERA_TOOLS, which may be shared read-mostly).
CACHE=${GPU_CACHE:-$ROOT/.cache/gpu}
if [ ! -x "$CACHE/runc-$RUNC_V" ]; then
  log "runc $RUNC_V (static, seccomp)"
  mkdir -p "$CACHE/gobin"
  GOBIN=$CACHE/gobin GOFLAGS=-buildvcs=false GOTOOLCHAIN=local \
    go install -tags "seccomp netgo osusergo" -ldflags "-s -w -extldflags=-static" "github.com/opencontainers/runc@$RUNC_V"
  mv "$CACHE/gobin/runc" "$CACHE/runc-$RUNC_V"
fi
cp "$CACHE/runc-$RUNC_V" "$B/bin/runc"

log "vcuda, the fake driver, cudaprobe, callbench, memprobe"
V=$W/vcuda
make -s -C "$ROOT/vcuda" BUILD="$V" "$V/libvcuda.so" "$V/libvcuda-hostgate.so" "$V/fake/libcuda.so.1" "$V/fake/libnvidia-ml.so.1" "$V/fake/nvidia-smi" >/dev/null
cp "$V/libvcuda.so" "$V/libvcuda-hostgate.so" "$B/lib/"
cp "$V/fake/libcuda.so.1" "$V/fake/libnvidia-ml.so.1" "$V/fake/nvidia-smi" "$B/fake/"
# Linked against the fake's soname: at run time they load whichever libcuda.so.1 is found, the
# real driver's on a GPU machine (the driver API's ABI is stable across drivers).
gcc -O2 -Wall -Werror -o "$B/bin/cudaprobe" "$ROOT/test/image/cudaprobe.c" -L"$V/fake" -l:libcuda.so.1
gcc -O2 -Wall -Wextra -Werror -o "$B/bin/callbench" "$ROOT/test/gpu/csrc/callbench.c" -L"$V/fake" -l:libcuda.so.1 -ldl
gcc -O2 -Wall -Wextra -Werror -o "$B/bin/memprobe" "$ROOT/test/gpu/csrc/memprobe.c" -L"$V/fake" -l:libcuda.so.1 -ldl
gcc -O2 -Wall -Wextra -Werror -o "$B/bin/slicebench" "$ROOT/test/gpu/csrc/slicebench.c" -L"$V/fake" -l:libcuda.so.1 -ldl
gcc -O2 -Wall -Wextra -Werror -o "$B/bin/procprobe" "$ROOT/test/gpu/csrc/procprobe.c" -ldl
# vcuda's hook table as "<symbol> <base>" lines: the one list (src/procaddr.c), read, not copied
sed -n 's/^[[:space:]]*E(\([A-Za-z0-9_]*\), "\([A-Za-z0-9_]*\)", [0-9]*, [01]),.*/\1 \2/p' "$ROOT/vcuda/src/procaddr.c" >"$B/lib/hooktable.txt"
[ "$(wc -l <"$B/lib/hooktable.txt")" -eq "$(grep -c '^[[:space:]]*E(' "$ROOT/vcuda/src/procaddr.c")" ] ||
  { echo "bundle.sh: could not read every E(...) row of vcuda/src/procaddr.c: has its format changed?" >&2; exit 1; }

log "rootfs"
mkdir -p "$W/probe/usr/local/bin" && cp "$B/bin/cudaprobe" "$B/bin/memprobe" "$B/bin/slicebench" "$W/probe/usr/local/bin/"
ROOTFS_DIR=$B/rootfs bash "$ROOT/test/tools/make-image.sh" "$BB" /dev/null gpuproof '["/bin/sh"]' "$GLIBC" "$W/probe"

cp "$ROOT/test/gpu/run.sh" "$ROOT/test/gpu/torch_checks.py" "$ROOT/test/gpu/README.md" "$B/"
{
  echo "tessera GPU bundle"
  echo "commit: $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%FT%TZ) with $(go version | cut -d' ' -f3), gcc $(gcc -dumpversion), glibc $(ldd --version | head -1 | awk '{print $NF}')"
  echo "rootfs glibc: $(cd "$TOOLS" && ls debs-libc/*.deb 2>/dev/null || echo "$GLIBC")"
  echo "host glibc needed (newest symbol version each binary uses):"
  for f in bin/tessera-node bin/gpuproof bin/nvml-refusals.test bin/cudaprobe bin/callbench bin/memprobe bin/procprobe bin/slicebench lib/libvcuda.so lib/libvcuda-hostgate.so; do
    echo "  $f: $(objdump -T "$B/$f" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)"
  done
  echo "  bin/runc: static"
} >"$B/MANIFEST"
mkdir -p "$(dirname "$OUT")"
tar -C "$W" --owner=0 --group=0 -czf "$OUT.tmp" tessera-gpu-bundle
mv "$OUT.tmp" "$OUT"
log "wrote $OUT ($(du -h "$OUT" | cut -f1))"
