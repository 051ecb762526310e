#!/usr/bin/env bash
# Build (once) and cache the real Helm from its Go module, pinned.
#
#   deploy/build-helm.sh        # prints the path of the helm binary on its last line
#
# The binary lands in ${DRA_GPU_CACHE:-$HOME/.cache/dra-gpu}/bin/helm-<version>/helm, built from a
# generated go.mod in .../src/helm-<version>/ (never in the repo), like e2e/node/build.sh does for the
# cluster's programs. A directory with a .complete marker is not rebuilt; changing the pin builds
# a new one. GOMODCACHE/GOCACHE are Go's defaults.
set -euo pipefail

HELM_VERSION="${HELM_VERSION:-v3.22.0}"
CACHE="${DRA_GPU_CACHE:-$HOME/.cache/dra-gpu}"
GO_P="${E2E_GO_P:-2}"
export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:--buildvcs=false}"

log() { printf '[build-helm %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# Bump when the way helm is built changes, so a cached binary built the old way is rebuilt.
RECIPE="helm-build-2 (k8s version from client-go, as upstream's Makefile)"
out="$CACHE/bin/helm-$HELM_VERSION"
if [ -f "$out/.complete" ] && [ "$(cat "$out/.complete")" = "$RECIPE" ]; then
  log "helm $HELM_VERSION cached in $out"
  echo "$out/helm"; exit 0
fi
command -v go >/dev/null || { echo "build-helm: needs Go (go.dev/dl or apt-get install golang)" >&2; exit 2; }

t0=$SECONDS
mod=helm.sh/helm/${HELM_VERSION%%.*}
ws="$CACHE/src/helm-$HELM_VERSION"
rm -rf "$ws" && mkdir -p "$ws" && cd "$ws"
go mod init dra-gpu.local/helmbuild >/dev/null 2>&1
go mod edit -require="$mod@$HELM_VERSION"
printf '//go:build tools\n\npackage tools\n\nimport _ "%s/cmd/helm"\n' "$mod" >tools.go
log "resolving $mod@$HELM_VERSION"
go mod tidy >tidy.log 2>&1 || { tail -30 tidy.log >&2; exit 1; }
mkdir -p "$out.tmp"
# As upstream's Makefile: the default Kubernetes version of `helm template` and `helm lint`
# (Capabilities.KubeVersion) is the one of the client-go it is built with, not 1.20.
kv="$(go list -m -f '{{.Version}}' k8s.io/client-go)"   # v0.37.0 -> Kubernetes 1.37
kmin="$(echo "$kv" | cut -d. -f2)"
ld="-s -w -X $mod/internal/version.version=$HELM_VERSION -X $mod/internal/version.gitTreeState=clean"
for pkg in pkg/chartutil pkg/lint/rules; do
  ld+=" -X $mod/$pkg.k8sVersionMajor=1 -X $mod/$pkg.k8sVersionMinor=$kmin"
done
log "go build -p $GO_P $mod/cmd/helm"
go build -p "$GO_P" -trimpath -ldflags="$ld" -o "$out.tmp/helm" "$mod/cmd/helm"
echo "$RECIPE" >"$out.tmp/.complete"; rm -rf "$out"; mv "$out.tmp" "$out"
log "helm $HELM_VERSION built in $((SECONDS - t0)) s: $out/helm"
echo "$out/helm"
