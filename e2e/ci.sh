#!/usr/bin/env bash
# The e2e tier for CI: build (cached) the upstream programs, run `pytest -m e2e e2e/tests`
# (its session fixture brings the local cluster up and down), then the compatibility suite on the
# oldest supported Kubernetes release, then check nothing is left.
# Runs as root on a fresh Debian machine with Go, Python and apt. Extra args go to pytest.
# A skipped test fails it unless declared expected: e2e/expected-skips.txt, or for this machine
# DRA_GPU_EXPECTED_SKIPS='PATTERN REASON; ...' (e2e/harness/skips.py; e.g. 'e2e/tests/* not root'
# where no cluster can be started); pytest's summary names every skip.
#
#   PYTHON=path/to/python e2e/ci.sh [-x ...]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
PYTHON="${PYTHON:-python3}"

t0=$SECONDS
bash "$HERE/node/build.sh" all
bash "$HERE/node/build_promtool.sh" >/dev/null
echo "[e2e/ci] build step: $((SECONDS - t0)) s"

if ! "$PYTHON" -c 'import kubernetes, pytest, yaml' 2>/dev/null; then
  echo "[e2e/ci] installing the e2e test dependencies (kubernetes, pytest, pyyaml)"
  "$PYTHON" -m pip install -q kubernetes pytest pyyaml
fi

# The session fixture uses the local cluster only when KUBECONFIG is unset.
unset KUBECONFIG
rc=0
t1=$SECONDS
(cd "$ROOT" && "$PYTHON" -m pytest -m e2e "$HERE/tests" -p no:cacheprovider --durations=30 "$@") || rc=$?
echo "[e2e/ci] e2e tests: $((SECONDS - t1)) s (rc $rc)"

# The compatibility suite on the oldest release the driver supports (with its default gates: the
# features whose gates are off there must say why); every release: e2e/compat.sh, not the gate.
OLDEST=v1.34.4
"$PYTHON" "$HERE/cluster" down >/dev/null 2>&1 || true
t2=$SECONDS
DRA_GPU_KUBE_VERSION="$OLDEST" bash "$HERE/node/build.sh" kubernetes
(cd "$ROOT" && DRA_GPU_KUBE_VERSION="$OLDEST" DRA_GPU_E2E_DRA_GATES=default \
  "$PYTHON" -m pytest -m e2e "$HERE/tests/test_compat.py" -p no:cacheprovider "$@") || rc=1
echo "[e2e/ci] compatibility suite on Kubernetes $OLDEST: $((SECONDS - t2)) s (rc $rc)"

# Whatever happened, leave nothing running.
"$PYTHON" "$HERE/cluster" down >/dev/null 2>&1 || true
state="${DRA_GPU_E2E_STATE:-/var/lib/dra-gpu-e2e}"
cache="${DRA_GPU_CACHE:-$HOME/.cache/dra-gpu}"
left="$(ps -eo pid=,args= | grep -F -e "$cache/bin/" -e "$state/" | grep -v -e grep -e "$0" || true)"
if [ -n "$left" ]; then
  echo "[e2e/ci] processes of the cluster left running:"; echo "$left"; rc=1
fi
exit "$rc"
