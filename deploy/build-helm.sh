#!/usr/bin/env bash
# Build (once) and cache the real Helm from its Go module, pinned.
#
#   deploy/build-helm.sh        # prints the path of the helm binary on its last line
#
# Cached as deploy/go-program.sh says (bin/helm-<version>/helm under ~/.cache/dra-gpu).
set -euo pipefail
# shellcheck source=deploy/go-program.sh
source "$(dirname "${BASH_SOURCE[0]}")/go-program.sh"

HELM_VERSION="${HELM_VERSION:-v3.22.0}"
mod=helm.sh/helm/${HELM_VERSION%%.*}
# Bump when the way helm is built changes, so a cached binary built the old way is rebuilt.
go_program helm "$HELM_VERSION" "helm-build-2 (k8s version from client-go, as upstream's Makefile)"
go_program_resolve "$mod" "$mod/cmd/helm"
# As upstream's Makefile: the default Kubernetes version of `helm template` and `helm lint`
# (Capabilities.KubeVersion) is the one of the client-go it is built with, not 1.20.
kv="$(go list -m -f '{{.Version}}' k8s.io/client-go)"   # v0.37.0 -> Kubernetes 1.37
kmin="$(echo "$kv" | cut -d. -f2)"
ld="-s -w -X $mod/internal/version.version=$HELM_VERSION -X $mod/internal/version.gitTreeState=clean"
for pkg in pkg/chartutil pkg/lint/rules; do
  ld+=" -X $mod/$pkg.k8sVersionMajor=1 -X $mod/$pkg.k8sVersionMinor=$kmin"
done
go_program_log "go build -p $GO_P $mod/cmd/helm"
go build -p "$GO_P" -trimpath -ldflags="$ld" -o "$GO_PROGRAM_OUT.tmp/helm" "$mod/cmd/helm"
go_program_done
