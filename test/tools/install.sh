#!/usr/bin/env bash
# Builds the upstream binaries the end-to-end tests run for real, from the Go module proxy only:
# containerd (+shim, ctr) with NRI and CDI, runc with seccomp, nerdctl, crictl; unpacks a static busybox
# for the test images. Everything lands in $1/bin (default .cache/tools/bin); a stamp per version makes
# a warm run take a second. Pitfalls are from ../shared/recipes/containerd-nri-cdi.
set -euo pipefail
TOOLS=${1:-$(cd "$(dirname "$0")/../.." && pwd)/.cache/tools}
CONTAINERD_V=v2.2.9 RUNC_V=v1.3.6 NERDCTL_V=v2.2.2 CRICTL_V=v1.36.0
BIN=$TOOLS/bin
mkdir -p "$BIN" "$TOOLS/src"
export GOBIN=$BIN GOFLAGS=-buildvcs=false GOTOOLCHAIN=local
log() { echo "[tools] $*" >&2; }
stamp() { [ -f "$TOOLS/.stamp-$1" ]; }
mark() { touch "$TOOLS/.stamp-$1"; }

need_apt=()
dpkg -s libseccomp-dev >/dev/null 2>&1 || need_apt+=(libseccomp-dev)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
if ! stamp busybox || [ ! -x "$TOOLS/busybox/bin/busybox" ]; then
  log "busybox-static"
  rm -rf "$TOOLS/busybox" "$TOOLS/debs" && mkdir -p "$TOOLS/debs"
  (cd "$TOOLS/debs" && { apt-get download -qq busybox-static 2>/dev/null || { apt-get update -qq && apt-get download -qq busybox-static; }; } && dpkg -x busybox-static_*.deb "$TOOLS/busybox")
  mark busybox
fi
# glibc for the CUDA test image (test/image): Debian's libc6, the same release as this machine's gcc
# links against, so test/image/cudaprobe.c runs inside containers as it does here.
LIBC_V=$(dpkg-query -W -f '${Version}' libc6)
if ! stamp "glibc-$LIBC_V" || [ ! -e "$TOOLS/glibc/lib64/ld-linux-x86-64.so.2" ]; then
  log "glibc $LIBC_V (libc6 from Debian)"
  rm -rf "$TOOLS/glibc" "$TOOLS/debs-libc" && mkdir -p "$TOOLS/debs-libc"
  (cd "$TOOLS/debs-libc" && { apt-get download -qq "libc6=$LIBC_V" 2>/dev/null || { apt-get update -qq && apt-get download -qq "libc6=$LIBC_V"; }; } && dpkg -x libc6_*.deb "$TOOLS/glibc")
  rm -rf "$TOOLS/glibc/usr/share"
  mark "glibc-$LIBC_V"
fi
if ! stamp "containerd-$CONTAINERD_V"; then
  log "containerd $CONTAINERD_V"
  # -X sets a real version so NRI plugins can infer the NRI API level.
  go install -ldflags "-X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_V" \
    github.com/containerd/containerd/v2/cmd/containerd@$CONTAINERD_V \
    github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$CONTAINERD_V \
    github.com/containerd/containerd/v2/cmd/ctr@$CONTAINERD_V
  mark "containerd-$CONTAINERD_V"
fi
if ! stamp "runc-$RUNC_V"; then
  log "runc $RUNC_V (seccomp)"
  # without -tags seccomp every container with a seccomp profile fails
  go install -tags seccomp github.com/opencontainers/runc@$RUNC_V
  mark "runc-$RUNC_V"
fi
if ! stamp "nerdctl-$NERDCTL_V"; then
  log "nerdctl $NERDCTL_V"
  # `go install nerdctl@v` fails (proxy 403 on @v/list, and a replace directive for mod/tigron):
  # build from a wrapper module with a one-interface tigron stub.
  W=$TOOLS/src/nerdctl-wrap; rm -rf "$W"; mkdir -p "$W/tigron-stub/tig"
  printf 'module github.com/containerd/nerdctl/mod/tigron\n\ngo 1.23\n' > "$W/tigron-stub/go.mod"
  printf 'package tig\n\ntype T interface {\n\tHelper()\n\tLog(args ...any)\n\tFail()\n\tFailNow()\n}\n' > "$W/tigron-stub/tig/tig.go"
  printf 'module tessera/nerdctlwrap\n\ngo 1.24.3\n\nrequire github.com/containerd/nerdctl/v2 %s\n\nreplace github.com/containerd/nerdctl/mod/tigron v0.0.0 => ./tigron-stub\n' "$NERDCTL_V" > "$W/go.mod"
  (cd "$W" && go get github.com/containerd/nerdctl/v2/cmd/nerdctl@$NERDCTL_V && go build -o "$BIN/nerdctl" github.com/containerd/nerdctl/v2/cmd/nerdctl)
  mark "nerdctl-$NERDCTL_V"
fi
if ! stamp "crictl-$CRICTL_V"; then
  log "crictl $CRICTL_V"
  W=$TOOLS/src/crictl-wrap; rm -rf "$W"; mkdir -p "$W"; printf 'module tessera/crictlwrap\n\ngo 1.26\n' > "$W/go.mod"
  (cd "$W" && go get sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_V && go build -ldflags "-X sigs.k8s.io/cri-tools/pkg/version.Version=$CRICTL_V" -o "$BIN/crictl" sigs.k8s.io/cri-tools/cmd/crictl)
  mark "crictl-$CRICTL_V"
fi
log "ready in $BIN"
