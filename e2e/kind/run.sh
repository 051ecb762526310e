#!/usr/bin/env bash
# Run dra-gpu's e2e tier on a kind cluster (needs docker or podman, kind, kubectl, Python with
# kubernetes+pytest+pyyaml). Not runnable on the project's build machines (no container engine).
#
#   e2e/kind/run.sh [DRIVER_IMAGE_ARCHIVE]
# env: KIND_CLUSTER (default dra-gpu-e2e), KIND_NODE_IMAGE (a kindest/node 1.37 image),
#      KEEP_CLUSTER=1 to keep it afterwards.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
E2E="$(dirname "$HERE")"
NAME="${KIND_CLUSTER:-dra-gpu-e2e}"
PYTHON="${PYTHON:-python3}"
IMAGES="$(mktemp -d)"
trap 'rm -rf "$IMAGES"; [ "${KEEP_CLUSTER:-0}" = 1 ] || kind delete cluster --name "$NAME"' EXIT

kind create cluster --name "$NAME" --config "$HERE/kind-config.yaml" \
  ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"} --wait 120s
# The tests' busybox image and the examples' debian:bookworm-slim, built locally like on the
# upstream-programs cluster.
"$PYTHON" "$E2E/node/images.py" "$IMAGES" --debian
kind load image-archive --name "$NAME" "$IMAGES/busybox.tar"
kind load image-archive --name "$NAME" "$IMAGES/debian.tar"
# The driver image under test, if given (e.g. from `docker save`).
if [ $# -ge 1 ]; then kind load image-archive --name "$NAME" "$1"; fi

export KUBECONFIG="$IMAGES/kubeconfig"
kind get kubeconfig --name "$NAME" >"$KUBECONFIG"
# The peer-driver test needs its host-process driver: skipped here unless
# DRA_GPU_E2E_PEER_DRIVER=external says one was deployed.
cd "$(dirname "$E2E")" && "$PYTHON" -m pytest -m e2e "$E2E/tests"
