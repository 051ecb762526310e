#!/usr/bin/env bash
# The kind tier: build (cached) what it needs, run e2e/tests/test_kind.py (a private Docker
# daemon, a kind cluster from e2e/kind/ on a node image built here, the user's path with the
# chart), then make sure the daemon is gone and left nothing. Root; hold the e2e lock as
# scripts/test does (the daemon adds a bridge beside the local cluster's). Its skip (not root, so
# no daemon) fails it unless declared: DRA_GPU_EXPECTED_SKIPS='e2e/tests/test_kind.py::* not root'
# (e2e/harness/skips.py).
#
#   PYTHON=.venv/bin/python bash e2e/kind/test.sh [pytest args]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
E2E="$(dirname "$HERE")"
ROOT="$(dirname "$E2E")"
PYTHON="${PYTHON:-python3}"
# Absolute (a venv's python keeps its path: no symlinks resolved), as the steps below cd.
case "$PYTHON" in */*) PYTHON="$(realpath -s "$PYTHON")" ;; esac

t0=$SECONDS
bash "$E2E/node/build.sh" all
bash "$HERE/build.sh" all
echo "[kind/test] build step: $((SECONDS - t0)) s"

rc=0
t1=$SECONDS
(cd "$ROOT" && "$PYTHON" -m pytest -m kind "$E2E/tests/test_kind.py" -p no:cacheprovider -s "$@") || rc=$?
echo "[kind/test] kind test: $((SECONDS - t1)) s (rc $rc)"

# Whatever happened: no cluster, no daemon, no bridge, no DOCKER chain, no mount.
(cd "$E2E" && "$PYTHON" -m harness.kind_engine down) || rc=1
exit "$rc"
