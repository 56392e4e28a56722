#!/usr/bin/env bash
# Unpacks the Debian packages the node image is made of into $1/<package>: libc6 (tessera-node is a
# cgo binary; the same release the binary was linked against here) and busybox-static (sh and
# install for the chart's init container). Versions are pinned to this machine's, so two builds on
# one machine take the same files.
set -euo pipefail
OUT=${1:?usage: debs.sh <dir>}
LIBC_V=$(dpkg-query -W -f '${Version}' libc6)
BB_V=$(apt-cache policy busybox-static 2>/dev/null | awk '/Candidate:/ {print $2}')
mkdir -p "$OUT"
fetch() { # package version
  local stamp="$OUT/.stamp-$1-$2"
  [ -f "$stamp" ] && return
  local w; w=$(mktemp -d)
  (cd "$w" && { apt-get download -qq "$1=$2" 2>/dev/null || { apt-get update -qq && apt-get download -qq "$1=$2"; }; })
  rm -rf "$OUT/$1" && dpkg -x "$w"/"$1"_*.deb "$OUT/$1" && rm -rf "$w" "$OUT/$1/usr/share"
  touch "$stamp"
}
[ -n "$BB_V" ] || { apt-get update -qq; BB_V=$(apt-cache policy busybox-static | awk '/Candidate:/ {print $2}'); }
fetch libc6 "$LIBC_V"
fetch busybox-static "$BB_V"
