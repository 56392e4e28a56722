#!/usr/bin/env bash
# Builds the upstream Kubernetes control plane the end-to-end tests run for real, from the Go module proxy
# only: etcd, kube-apiserver, kube-scheduler, kube-controller-manager, kubelet and kubectl. Everything lands
# in $1/bin (default .cache/tools/bin); a stamp per version makes a warm run take a second.
# Pitfalls are from ../shared/recipes/k8s-local-control-plane:
#   - k8s.io/kubernetes replaces every k8s.io/<staging> module with ./staging/src/...: `go install` cannot
#     build it; a helper module maps each staging module to its published v0.<minor>.<patch> tag instead.
#   - `go install go.etcd.io/etcd/server/v3@v` fails (replace directives): build from a helper module too.
#   - the -X version stamps make `--version`, discovery and node.status.nodeInfo report the real version.
#   - CGO_ENABLED and -trimpath are part of Go's cache key: keep them fixed so a warm cache is hit.
# Cold: ~6 min on 2 cores (module download + compile); warm: ~1 s.
set -euo pipefail
TOOLS=${1:-$(cd "$(dirname "$0")/../.." && pwd)/.cache/tools}
K8S_V=v1.37.2 ETCD_V=v3.6.4
K8S_CMDS=(kube-apiserver kube-scheduler kube-controller-manager kubelet kubectl)
BIN=$TOOLS/bin
mkdir -p "$BIN" "$TOOLS/src"
export GOFLAGS=-buildvcs=false GOTOOLCHAIN=local CGO_ENABLED=0
log() { echo "[tools] $*" >&2; }
stamp() { [ -f "$TOOLS/.stamp-$1" ]; }
mark() { touch "$TOOLS/.stamp-$1"; }
have_all() { local b; for b in "$@"; do [ -x "$BIN/$b" ] || return 1; done; }

need_apt=()
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if ! stamp "etcd-$ETCD_V" || ! have_all etcd; then
  log "etcd $ETCD_V"
  W=$TOOLS/src/etcd-build; rm -rf "$W"; mkdir -p "$W"
  printf 'module tessera/etcdbuild\n\ngo 1.24\n' > "$W/go.mod"
  (cd "$W" && go get "go.etcd.io/etcd/server/v3@$ETCD_V" &&
    go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3)
  mark "etcd-$ETCD_V"
fi

if ! stamp "k8s-$K8S_V" || ! have_all "${K8S_CMDS[@]}"; then
  log "kubernetes $K8S_V: ${K8S_CMDS[*]}"
  W=$TOOLS/src/k8s-build-$K8S_V
  SV="v0.${K8S_V#v1.}"   # staging modules' version, e.g. v0.34.4
  if [ ! -f "$W/go.sum" ]; then
    rm -rf "$W"; mkdir -p "$W"
    KMOD=$(go mod download -json "k8s.io/kubernetes@$K8S_V" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
    [ -f "$KMOD" ] || { log "cannot download k8s.io/kubernetes@$K8S_V's go.mod"; exit 1; }
    {
      printf 'module tessera/k8sbuild\n\ngo 1.24.0\n\ngodebug default=go1.24\n\nrequire k8s.io/kubernetes %s\n\nreplace (\n' "$K8S_V"
      # "k8s.io/x => ./staging/src/k8s.io/x" becomes "k8s.io/x => k8s.io/x v0.N.M"; the sample-* modules are not in
      # the build graph and the proxy does not serve them for every patch release.
      sed -n '/^replace (/,/^)/p' "$KMOD" | awk -v sv="$SV" '/=> \.\/staging/ {
          if ($1 ~ /sample-(cli-plugin|controller)$/) next;
          printf "\t%s => %s %s\n", $1, $1, sv }'
      printf ')\n'
    } > "$W/go.mod.tmp"
    mv "$W/go.mod.tmp" "$W/go.mod"
    (cd "$W" && go get $(for c in "${K8S_CMDS[@]}"; do echo "k8s.io/kubernetes/cmd/$c@$K8S_V"; done)) ||
      { rm -f "$W/go.sum"; exit 1; }
  fi
  MINOR=$(echo "$K8S_V" | cut -d. -f2)
  X=""
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    X="$X -X $p.gitVersion=$K8S_V -X $p.gitMajor=1 -X $p.gitMinor=$MINOR -X $p.gitTreeState=clean -X $p.buildDate=2000-01-01T00:00:00Z"
  done
  # one invocation: shared package loading, parallel links
  (cd "$W" && go build -trimpath -ldflags "-s -w $X" -o "$BIN/" $(for c in "${K8S_CMDS[@]}"; do echo "k8s.io/kubernetes/cmd/$c"; done))
  mark "k8s-$K8S_V"
fi
log "kubernetes $K8S_V + etcd $ETCD_V ready in $BIN"
