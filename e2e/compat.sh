#!/usr/bin/env bash
# The compatibility suite (e2e/tests/test_compat.py) on every supported Kubernetes release, with
# its default gates and with all DRA gates on, and version skew (a 1.37 control plane with a 1.34
# kubelet); then the table of docs/development.md from the records (e2e/compat_table.py).
#
#   PYTHON=.venv/bin/python e2e/compat.sh [--readme]      # --readme: rewrite that table in docs/development.md
#
# Each release is built once (e2e/node/build.sh, cached per version). Runs as root, like e2e/ci.sh.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
PYTHON="${PYTHON:-python3}"
RELEASES=(${DRA_GPU_COMPAT_RELEASES:-v1.34.4 v1.35.4 v1.36.3 v1.37.2})
OLDEST="${RELEASES[0]}"
NEWEST="${RELEASES[${#RELEASES[@]}-1]}"
RESULTS="${DRA_GPU_COMPAT_RESULTS:-$(mktemp -d)}"
export DRA_GPU_COMPAT_RESULTS="$RESULTS"
unset KUBECONFIG  # the suite brings up the local cluster

# kube version, kubelet version, gates
runs=()
for v in "${RELEASES[@]}"; do runs+=("$v $v default" "$v $v all"); done
runs+=("$NEWEST $OLDEST default")

rc=0
for run in "${runs[@]}"; do
  read -r kube kubelet gates <<<"$run"
  echo "== Kubernetes $kube, kubelet $kubelet, DRA gates: $gates"
  DRA_GPU_KUBE_VERSION="$kube" bash "$HERE/node/build.sh" kubernetes
  [ "$kubelet" = "$kube" ] || DRA_GPU_KUBE_VERSION="$kubelet" bash "$HERE/node/build.sh" kubernetes
  "$PYTHON" "$HERE/cluster" down >/dev/null 2>&1 || true
  (cd "$ROOT" && DRA_GPU_KUBE_VERSION="$kube" DRA_GPU_KUBELET_VERSION="$kubelet" DRA_GPU_E2E_DRA_GATES="$gates" \
    "$PYTHON" -m pytest -q -m e2e "$HERE/tests/test_compat.py" -p no:cacheprovider) || rc=1
done
"$PYTHON" "$HERE/cluster" down >/dev/null 2>&1 || true
echo "== records in $RESULTS"
if [ "${1:-}" = "--readme" ]; then
  "$PYTHON" "$HERE/compat_table.py" "$RESULTS" --readme "$ROOT/docs/development.md"
else
  "$PYTHON" "$HERE/compat_table.py" "$RESULTS"
fi
exit "$rc"
