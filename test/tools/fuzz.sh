#!/usr/bin/env bash
# Runs every Go fuzz target in the module for $1 each (default 10000x inputs; a count avoids Go 1.26's
# fuzztime deadline race, golang/go#75804).
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${1:-10000x}
for pkg in $(go list ./...); do
  dir=$(go list -f '{{.Dir}}' "$pkg")
  for f in $(grep -ho '^func Fuzz[A-Za-z0-9_]*' "$dir"/*_test.go 2>/dev/null | sed 's/^func //' | sort -u); do
    echo "fuzz $pkg $f ($T)"
    go test -run '^$' -fuzz "^$f\$" -fuzztime "$T" "$pkg" >/tmp/tessera-fuzz.log 2>&1 || { cat /tmp/tessera-fuzz.log; exit 1; }
  done
done
