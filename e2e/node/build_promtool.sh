#!/usr/bin/env bash
# Build (once) and cache Prometheus's promtool from its Go module, pinned: e2e/tests/test_alerts.py
# checks the chart's alerts with it (`promtool check rules`, `promtool test rules`).
#
#   e2e/node/build_promtool.sh        # prints the path of the promtool binary on its last line
#
# The binary lands in ${DRA_GPU_CACHE:-$HOME/.cache/dra-gpu}/bin/promtool-<version>/promtool, built
# from a generated go.mod in .../src/promtool-<version>/ (never in the repo), as deploy/build-helm.sh
# builds helm. A directory with a .complete marker is not rebuilt; changing the pin builds a new one.
# GOMODCACHE/GOCACHE are Go's defaults.
#
# Built with the tag remove_all_sd: prometheus/plugins then registers only the file and http
# service discoveries (promtool imports the kubernetes one itself), so the cloud providers' SDKs
# (aws, azure, gce, oci, ...) are not compiled. `go mod tidy` still downloads the modules every tag
# could need (about 300 MB into an empty module cache); the build compiles only what it links.
set -euo pipefail

PROMETHEUS_VERSION="${PROMETHEUS_VERSION:-v0.316.0}"
CACHE="${DRA_GPU_CACHE:-$HOME/.cache/dra-gpu}"
GO_P="${E2E_GO_P:-2}"
TAGS="remove_all_sd"
export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:--buildvcs=false}"

log() { printf '[build-promtool %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# Bump when the way promtool is built changes, so a cached binary built the old way is rebuilt.
RECIPE="promtool-build-1 (tags $TAGS)"
out="$CACHE/bin/promtool-$PROMETHEUS_VERSION"
if [ -f "$out/.complete" ] && [ "$(cat "$out/.complete")" = "$RECIPE" ]; then
  log "promtool $PROMETHEUS_VERSION cached in $out"
  echo "$out/promtool"; exit 0
fi
command -v go >/dev/null || { echo "build-promtool: needs Go (go.dev/dl or apt-get install golang)" >&2; exit 2; }

t0=$SECONDS
mod=github.com/prometheus/prometheus
ws="$CACHE/src/promtool-$PROMETHEUS_VERSION"
rm -rf "$ws" && mkdir -p "$ws" && cd "$ws"
go mod init dra-gpu.local/promtoolbuild >/dev/null 2>&1
go mod edit -require="$mod@$PROMETHEUS_VERSION"
printf '//go:build tools\n\npackage tools\n\nimport _ "%s/cmd/promtool"\n' "$mod" >tools.go
log "resolving $mod@$PROMETHEUS_VERSION"
go mod tidy >tidy.log 2>&1 || { tail -30 tidy.log >&2; exit 1; }
log "modules resolved in $((SECONDS - t0)) s"
mkdir -p "$out.tmp"
# As upstream's .promu.yml: the version `promtool --version` prints.
v="${PROMETHEUS_VERSION#v0.}"   # v0.316.0 -> 3.16.0
v="${v:0:1}.${v:1}"
ld="-s -w -X github.com/prometheus/common/version.Version=$v"
ld+=" -X github.com/prometheus/common/version.Revision=$PROMETHEUS_VERSION"
ld+=" -X github.com/prometheus/common/version.Branch=module"
log "go build -p $GO_P -tags $TAGS $mod/cmd/promtool"
go build -p "$GO_P" -trimpath -tags "$TAGS" -ldflags="$ld" -o "$out.tmp/promtool" "$mod/cmd/promtool"
"$out.tmp/promtool" --version >/dev/null
echo "$RECIPE" >"$out.tmp/.complete"; rm -rf "$out"; mv "$out.tmp" "$out"
log "promtool $PROMETHEUS_VERSION built in $((SECONDS - t0)) s: $out/promtool"
echo "$out/promtool"
