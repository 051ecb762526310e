#!/usr/bin/env bash
# Build (once) and cache go-containerregistry's crane from its Go module, pinned: scripts/release
# pushes the images with it (`crane push` of an OCI layout, no container engine needed) and the
# e2e serves its release registry with it (`crane registry serve`).
#
#   deploy/build-crane.sh        # prints the path of the crane binary on its last line
#
# Cached as deploy/build-helm.sh caches helm: ${DRA_GPU_CACHE:-$HOME/.cache/dra-gpu}/bin/crane-<version>/
# with a .complete marker, built from a generated go.mod outside the repository.
set -euo pipefail

CRANE_VERSION="${CRANE_VERSION:-v0.22.1}"
CACHE="${DRA_GPU_CACHE:-$HOME/.cache/dra-gpu}"
export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:--buildvcs=false}"
RECIPE="crane-build-1"
mod=github.com/google/go-containerregistry
out="$CACHE/bin/crane-$CRANE_VERSION"

log() { printf '[build-crane %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [ -f "$out/.complete" ] && [ "$(cat "$out/.complete")" = "$RECIPE" ]; then
  echo "$out/crane"; exit 0
fi
command -v go >/dev/null || { echo "build-crane: needs Go (go.dev/dl or apt-get install golang)" >&2; exit 2; }
t0=$SECONDS
ws="$CACHE/src/crane-$CRANE_VERSION"
rm -rf "$ws" && mkdir -p "$ws" && cd "$ws"
go mod init dra-gpu.local/cranebuild >/dev/null 2>&1
go mod edit -require="$mod@$CRANE_VERSION"
printf '//go:build tools\n\npackage tools\n\nimport _ "%s/cmd/crane"\n' "$mod" >tools.go
go mod tidy >tidy.log 2>&1 || { tail -30 tidy.log >&2; exit 1; }
mkdir -p "$out.tmp"
go build -p "${E2E_GO_P:-2}" -trimpath -ldflags="-s -w -X $mod/cmd/crane/cmd.Version=$CRANE_VERSION" \
  -o "$out.tmp/crane" "$mod/cmd/crane"
echo "$RECIPE" >"$out.tmp/.complete"; rm -rf "$out"; mv "$out.tmp" "$out"
log "crane $CRANE_VERSION built in $((SECONDS - t0)) s: $out/crane"
echo "$out/crane"
