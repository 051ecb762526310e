#!/usr/bin/env bash
# Build (once) and cache go-containerregistry's crane from its Go module, pinned: scripts/release
# pushes the images with it (`crane push` of an OCI layout, no container engine needed) and the
# kind tier serves its release registry with it (`crane registry serve`).
#
#   deploy/build-crane.sh        # prints the path of the crane binary on its last line
#
# Cached as deploy/go-program.sh says.
set -euo pipefail
# shellcheck source=deploy/go-program.sh
source "$(dirname "${BASH_SOURCE[0]}")/go-program.sh"

CRANE_VERSION="${CRANE_VERSION:-v0.22.1}"
mod=github.com/google/go-containerregistry
go_program crane "$CRANE_VERSION" "crane-build-1"
go_program_resolve "$mod" "$mod/cmd/crane"
go build -p "$GO_P" -trimpath -ldflags="-s -w -X $mod/cmd/crane/cmd.Version=$CRANE_VERSION" \
  -o "$GO_PROGRAM_OUT.tmp/crane" "$mod/cmd/crane"
go_program_done
