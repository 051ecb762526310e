#!/usr/bin/env bash
# Build (once) and cache the Go programs the kind path needs beyond e2e/node/build.sh's:
#
#   e2e/kind/build.sh [all|kind|kubernetes|crictl|coredns]
#
# - kind itself (sigs.k8s.io/kind, pinned below);
# - kubeadm and kube-proxy from the same k8s.io/kubernetes module as e2e/node/build.sh's programs;
# - crictl (sigs.k8s.io/cri-tools) for the node image, as kind's base image has it;
# - CoreDNS at the version kubeadm of the pinned Kubernetes deploys.
# Each lands in ${DRA_GPU_CACHE:-$HOME/.cache/dra-gpu}/bin/<component>-<version>/ with a
# .complete marker, like e2e/node/build.sh; a changed pin builds into a new directory.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
E2E="$(dirname "$HERE")"
# shellcheck source=../versions.sh
source "$E2E/node/versions.sh"
CACHE="${DRA_GPU_CACHE:-$HOME/.cache/dra-gpu}"
GO_P="${E2E_GO_P:-2}"
export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:--buildvcs=false}"

log() { printf '[kind-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# go_build OUTNAME VERSION MODULE@VERSION LDFLAGS PKG...: one workspace, one go build.
go_build() {
  local name="$1" ver="$2" modver="$3" ld="$4"; shift 4
  local out="$CACHE/bin/$name-$ver"
  if [ -f "$out/.complete" ]; then log "$name $ver cached in $out"; return; fi
  local ws="$CACHE/src/$name-$ver" t0=$SECONDS
  rm -rf "$ws" && mkdir -p "$ws" && cd "$ws"
  go mod init "e2e.local/$name" >/dev/null 2>&1
  go mod edit -require="$modver"
  { printf '//go:build tools\n\npackage tools\n\nimport (\n'
    for p in "$@"; do printf '\t_ "%s"\n' "$p"; done; printf ')\n'; } >tools.go
  go mod tidy >tidy.log 2>&1 || { tail -30 tidy.log >&2; return 1; }
  mkdir -p "$out.tmp"
  go build -p "$GO_P" -trimpath -ldflags="-s -w $ld" -o "$out.tmp/" "$@"
  touch "$out.tmp/.complete"; rm -rf "$out"; mv "$out.tmp" "$out"
  log "$name $ver built in $((SECONDS - t0)) s"
}

build_kind() {
  go_build kind "$KIND_VERSION" "sigs.k8s.io/kind@$KIND_VERSION" "" sigs.k8s.io/kind
}

build_crictl() {
  go_build crictl "$CRICTL_VERSION" "sigs.k8s.io/cri-tools@$CRICTL_VERSION" \
    "-X 'sigs.k8s.io/cri-tools/pkg/version.Version=$CRICTL_VERSION'" sigs.k8s.io/cri-tools/cmd/crictl
}

build_coredns() {
  go_build coredns "$COREDNS_VERSION" "github.com/coredns/coredns@$COREDNS_VERSION" "" github.com/coredns/coredns
}

# kubeadm and kube-proxy: in e2e/node/build.sh's kubernetes workspace (its module graph is resolved
# there and Go's build cache holds the shared packages), into their own directory.
build_kubernetes_extra() {
  local out="$CACHE/bin/kubernetes-kind-$K8S_VERSION"
  if [ -f "$out/.complete" ]; then log "kubeadm, kube-proxy $K8S_VERSION cached in $out"; return; fi
  local ws="$CACHE/src/kubernetes-$K8S_VERSION" t0=$SECONDS
  [ -f "$ws/go.mod" ] || bash "$E2E/node/build.sh" kubernetes
  cd "$ws"
  local pkgs=(k8s.io/kubernetes/cmd/kubeadm k8s.io/kubernetes/cmd/kube-proxy)
  # The packages must be in the module graph: a second tools file, tidied once.
  if [ ! -f tools_kind.go ]; then
    { printf '//go:build tools\n\npackage tools\n\nimport (\n'
      for p in "${pkgs[@]}"; do printf '\t_ "%s"\n' "$p"; done; printf ')\n'; } >tools_kind.go
    go mod tidy >tidy-kind.log 2>&1 || { tail -30 tidy-kind.log >&2; rm -f tools_kind.go; return 1; }
  fi
  local vpkg ld="-s -w"
  for vpkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    ld+=" -X '$vpkg.gitVersion=$K8S_VERSION' -X '$vpkg.gitMajor=1'"
    ld+=" -X '$vpkg.gitMinor=$(echo "$K8S_VERSION" | cut -d. -f2)'"
    ld+=" -X '$vpkg.gitTreeState=clean' -X '$vpkg.buildDate=1970-01-01T00:00:00Z'"
  done
  mkdir -p "$out.tmp"
  go build -p "$GO_P" -trimpath -ldflags="$ld" -o "$out.tmp/" "${pkgs[@]}"
  touch "$out.tmp/.complete"; rm -rf "$out"; mv "$out.tmp" "$out"
  log "kubeadm, kube-proxy $K8S_VERSION built in $((SECONDS - t0)) s"
}

main() {
  local what="${1:-all}"
  mkdir -p "$CACHE/bin" "$CACHE/src"
  case "$what" in
    all) (build_kind); (build_kubernetes_extra); (build_crictl); (build_coredns) ;;
    kind) (build_kind) ;;
    kubernetes) (build_kubernetes_extra) ;;
    crictl) (build_crictl) ;;
    coredns) (build_coredns) ;;
    *) echo "usage: $0 [all|kind|kubernetes|crictl|coredns]" >&2; exit 2 ;;
  esac
}

main "$@"
