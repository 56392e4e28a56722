#!/usr/bin/env bash
# Runs the Go packages' tests ($1: go test's -timeout; then the packages, by default every one but
# vcuda's) as two go test processes at once, because most of the end-to-end time is waiting, not computing:
#  - apart: the multi-node cluster and the control-plane-only tests (no kubelet on the host's paths),
#  - the rest: every other package, and the single-node clusters, which take turns on the host's
#    kubelet paths (lockKubeletHost) and so cannot overlap one another.
# On 2 cores this takes the end-to-end package from ~19 to ~12 minutes. Both always run to the end;
# the apart half's output follows the other's; the exit status fails if either failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
timeout=${1:-35m}
shift || true
pkgs=("$@")
[ ${#pkgs[@]} -gt 0 ] || mapfile -t pkgs < <(go list ./... | grep -v '/vcuda')
# Top-level test names, each unique in the module (a name here skips it in every package below).
apart='^(TestMultiNode|TestExtenderPreemption|TestExtenderPlacement|TestExtenderWithoutNodeCache|TestExtenderUnschedulable|TestExtenderRestart|TestExtenderAPIServerRestart|TestControlPlane|TestClusterHelmTemplate|TestMigrationAdmission|TestSecurityLeastPrivilege)$'
log=$(mktemp /tmp/tessera-gotest-apart.XXXXXX)
trap 'rm -f "$log"' EXIT
go test -count=1 -timeout "$timeout" -run "$apart" ./test/e2e/ >"$log" 2>&1 &
apart_pid=$!
go test -count=1 -timeout "$timeout" -skip "$apart" "${pkgs[@]}"
rest=$?
wait "$apart_pid"
apart_rc=$?
echo "--- test/e2e, run apart: ${apart}"
cat "$log"
if [ "$rest" -ne 0 ] || [ "$apart_rc" -ne 0 ]; then
  echo "go test failed (the rest: exit $rest; apart: exit $apart_rc)"
  exit 1
fi
