#!/usr/bin/env bash
# Builds helm (only to render deploy/helm/tessera for TestClusterHelmTemplate and the demo) from the Go
# module proxy into $1/bin (default .cache/tools/bin); a stamp makes a warm run take a second.
# `go install helm.sh/helm/v3/cmd/helm@<exact version>` works here (no replace directives in helm's
# go.mod); the version is pinned because the proxy may refuse version lists.
# Cold: ~3-5 min on 2 cores (module download + compile); warm: ~0 s.
set -euo pipefail
TOOLS=${1:-$(cd "$(dirname "$0")/../.." && pwd)/.cache/tools}
HELM_V=v3.19.0
BIN=$TOOLS/bin
mkdir -p "$BIN"
export GOBIN=$BIN GOFLAGS=-buildvcs=false GOTOOLCHAIN=local CGO_ENABLED=0
log() { echo "[tools] $*" >&2; }
if [ ! -f "$TOOLS/.stamp-helm-$HELM_V" ] || [ ! -x "$BIN/helm" ]; then
  log "helm $HELM_V"
  # -X stamps the version `helm version` prints (and the .Capabilities.HelmVersion templates see).
  go install -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_V" "helm.sh/helm/v3/cmd/helm@$HELM_V"
  touch "$TOOLS/.stamp-helm-$HELM_V"
fi
log "helm $HELM_V ready in $BIN"
