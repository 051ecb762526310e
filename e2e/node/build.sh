#!/usr/bin/env bash
# Build (once) and cache the upstream programs the e2e cluster runs.
#
#   e2e/node/build.sh [all|kubernetes|etcd|containerd|debs|image|kwok|toolkit|nvidia-dra|podresources]
#
# Binaries land under ${DRA_GPU_CACHE:-$HOME/.cache/dra-gpu}/bin/<component>-<version>/,
# keyed by the pinned version below; a component is rebuilt only when its pin changes
# (or its directory lacks the .complete marker). The Go workspaces (a generated go.mod per
# component) live under .../src/, never in the repo. GOMODCACHE/GOCACHE are Go's defaults.
# `image` builds the dra-gpu image of deploy/Dockerfile with buildah (e2e/node/image_build.sh), as an
# OCI archive under .../images/, rebuilt only when a hash of its inputs changes.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.sh
source "$HERE/versions.sh"
# Another Kubernetes release than the pin (the compatibility suite: 1.34 to 1.37).
K8S_VERSION="${DRA_GPU_KUBE_VERSION:-$K8S_VERSION}"

CACHE="${DRA_GPU_CACHE:-$HOME/.cache/dra-gpu}"
GO_P="${E2E_GO_P:-2}"
export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:--buildvcs=false}"

log() { printf '[build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# ---------------------------------------------------------------------------- Debian bits
debs() {
  local missing=()
  command -v runc >/dev/null || missing+=(runc)
  dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q 'ok installed' \
    || missing+=(busybox-static)
  command -v openssl >/dev/null || missing+=(openssl)
  command -v ip >/dev/null || missing+=(iproute2)
  command -v iptables >/dev/null || missing+=(iptables)
  command -v mount >/dev/null || missing+=(mount)
  command -v conntrack >/dev/null || missing+=(conntrack)
  [ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
  # The simulated NVIDIA driver root (e2e/node/simdriver) is compiled C; the glibc test images
  # (images.py --debian) are made by mmdebstrap from Debian's archive.
  command -v gcc >/dev/null || missing+=(gcc)
  dpkg-query -W -f='${Status}' libc6-dev 2>/dev/null | grep -q 'ok installed' || missing+=(libc6-dev)
  command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
  if [ ${#missing[@]} -gt 0 ]; then
    log "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1 || {
      apt-get update >/dev/null && apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null; }
  fi
}

# ---------------------------------------------------------------------------- helpers
done_marker() { [ -f "$1/.complete" ]; }

new_workspace() { # dir modname
  rm -rf "$1" && mkdir -p "$1"
  (cd "$1" && go mod init "$2" >/dev/null 2>&1)
}

timed() { # name cmd...
  local t0=$SECONDS
  "${@:2}"
  log "$1 built in $((SECONDS - t0)) s"
}

# ---------------------------------------------------------------------------- kubernetes
build_kubernetes() {
  local out="$CACHE/bin/kubernetes-$K8S_VERSION"
  if done_marker "$out"; then log "kubernetes $K8S_VERSION cached in $out"; return; fi
  local ws="$CACHE/src/kubernetes-$K8S_VERSION"
  new_workspace "$ws" e2e.local/kubebuild
  cd "$ws"
  log "fetching k8s.io/kubernetes@$K8S_VERSION"
  go mod download k8s.io/kubernetes@"$K8S_VERSION"
  local kdir; kdir="$(go env GOMODCACHE)/k8s.io/kubernetes@$K8S_VERSION"
  local stagever="v0.${K8S_VERSION#v1.}"
  # Every staging module the release replaces with ./staging/src/... is pinned to v0.<minor>.<patch>.
  local edits=(-require="k8s.io/kubernetes@$K8S_VERSION")
  local m
  for m in $(awk '/=> \.\/staging\/src\//{print $1}' "$kdir/go.mod"); do
    edits+=(-replace="$m=$m@$stagever")
  done
  go mod edit "${edits[@]}"
  cat >tools.go <<EOF
//go:build tools

package tools

import (
$(for p in "${K8S_PKGS[@]}"; do echo "	_ \"$p\""; done)
)
EOF
  log "resolving kubernetes module graph"
  go mod tidy >tidy.log 2>&1 || { tail -30 tidy.log >&2; return 1; }
  local vpkg ld="-s -w"
  for vpkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    ld+=" -X '$vpkg.gitVersion=$K8S_VERSION' -X '$vpkg.gitMajor=1'"
    ld+=" -X '$vpkg.gitMinor=$(echo "$K8S_VERSION" | cut -d. -f2)'"
    ld+=" -X '$vpkg.gitTreeState=clean' -X '$vpkg.buildDate=1970-01-01T00:00:00Z'"
  done
  mkdir -p "$out.tmp"
  log "go build -p $GO_P ${#K8S_PKGS[@]} kubernetes programs (one invocation)"
  timed kubernetes go build -p "$GO_P" -trimpath -ldflags="$ld" -o "$out.tmp/" "${K8S_PKGS[@]}"
  # test/e2e/dra/test-driver builds as "test-driver"; give it a clearer name.
  [ -f "$out.tmp/test-driver" ] && mv "$out.tmp/test-driver" "$out.tmp/dra-test-driver"
  touch "$out.tmp/.complete"; rm -rf "$out"; mv "$out.tmp" "$out"
}

# ---------------------------------------------------------------------------- etcd
build_etcd() {
  local out="$CACHE/bin/etcd-$ETCD_VERSION"
  if done_marker "$out"; then log "etcd $ETCD_VERSION cached in $out"; return; fi
  local ws="$CACHE/src/etcd-$ETCD_VERSION"
  new_workspace "$ws" e2e.local/etcdbuild
  cd "$ws"
  go mod edit -require="go.etcd.io/etcd/server/v3@$ETCD_VERSION"
  printf '//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n' >tools.go
  go mod tidy >tidy.log 2>&1 || { tail -30 tidy.log >&2; return 1; }
  mkdir -p "$out.tmp"
  timed etcd go build -p "$GO_P" -trimpath -ldflags="-s -w" -o "$out.tmp/etcd" go.etcd.io/etcd/server/v3
  touch "$out.tmp/.complete"; rm -rf "$out"; mv "$out.tmp" "$out"
}

# ---------------------------------------------------------------------------- containerd
build_containerd() {
  local out="$CACHE/bin/containerd-$CONTAINERD_VERSION"
  if done_marker "$out"; then log "containerd $CONTAINERD_VERSION cached in $out"; return; fi
  local ws="$CACHE/src/containerd-$CONTAINERD_VERSION"
  new_workspace "$ws" e2e.local/ctrdbuild
  cd "$ws"
  local mod=github.com/containerd/containerd/v2
  go mod edit -require="$mod@$CONTAINERD_VERSION"
  local pkgs=("$mod/cmd/containerd" "$mod/cmd/ctr" "$mod/cmd/containerd-shim-runc-v2")
  { printf '//go:build tools\n\npackage tools\n\nimport (\n'
    for p in "${pkgs[@]}"; do printf '\t_ "%s"\n' "$p"; done; printf ')\n'; } >tools.go
  go mod tidy >tidy.log 2>&1 || { tail -30 tidy.log >&2; return 1; }
  mkdir -p "$out.tmp"
  local ld="-s -w -X '$mod/version.Version=$CONTAINERD_VERSION' -X '$mod/version.Revision=module'"
  timed containerd go build -p "$GO_P" -trimpath -tags "no_btrfs no_devmapper no_zfs urfave_cli_no_docs" \
    -ldflags="$ld" -o "$out.tmp/" "${pkgs[@]}"
  touch "$out.tmp/.complete"; rm -rf "$out"; mv "$out.tmp" "$out"
}

# ---------------------------------------------------------------------------- kwok
# Only the `kwok` controller (fake kubelets for many nodes in one process); the scale benchmark
# runs it against its own apiserver. Not part of `all`: the e2e tier does not need it.
build_kwok() {
  local out="$CACHE/bin/kwok-$KWOK_VERSION"
  if done_marker "$out"; then log "kwok $KWOK_VERSION cached in $out"; return; fi
  local ws="$CACHE/src/kwok-$KWOK_VERSION"
  new_workspace "$ws" e2e.local/kwokbuild
  cd "$ws"
  go mod edit -require="sigs.k8s.io/kwok@$KWOK_VERSION"
  printf '//go:build tools\n\npackage tools\n\nimport _ "sigs.k8s.io/kwok/cmd/kwok"\n' >tools.go
  go mod tidy >tidy.log 2>&1 || { tail -30 tidy.log >&2; return 1; }
  mkdir -p "$out.tmp"
  local ld="-s -w -X 'sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION'"
  timed kwok go build -p "$GO_P" -trimpath -ldflags="$ld" -o "$out.tmp/kwok" sigs.k8s.io/kwok/cmd/kwok
  # The `kwok` controller has no built-in stages: take upstream's node-initialize, lease heartbeat
  # and pod lifecycle stages from the module, one multi-document file for --config.
  local kdir f; kdir="$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage"
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    printf -- '---\n'; cat "$kdir/$f"
  done >"$out.tmp/stages.yaml"
  touch "$out.tmp/.complete"; rm -rf "$out"; mv "$out.tmp" "$out"
}

# ---------------------------------------------------------------------------- toolkit
# NVIDIA's nvidia-ctk and nvidia-cdi-hook, built in the module's own directory (its go.mod and
# go.sum pin what it was released with), with cgo: go-nvml's bindings are cgo (they dlopen
# libnvidia-ml at run time; NVIDIA's Makefile links with unresolved symbols allowed, as here).
# A clean TMPDIR: a stray nvml.h in a parent of cgo's work directory is picked up before
# go-nvml's own and breaks the build. Part of `all`: the e2e node gets nvidia-cdi-hook
# (e2e/tests/test_real_userspace.py), and the spec comparison test runs nvidia-ctk.
toolkit_module_build() { # version out program... (cmd/<program> of the module at version)
  local version="$1" out="$2"; shift 2
  command -v gcc >/dev/null || { log "the toolkit needs a C compiler (cgo): e2e/node/build.sh debs"; return 1; }
  local ws="$CACHE/src/nvidia-container-toolkit-$version"
  new_workspace "$ws" e2e.local/ctkbuild
  cd "$ws"
  local mod=github.com/NVIDIA/nvidia-container-toolkit
  log "fetching $mod@$version"
  local dir; dir="$(go mod download -json "$mod@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
  [ -f "$dir/go.mod" ] || { log "module $mod@$version not found in the module cache"; return 1; }
  mkdir -p "$ws/tmp" "$out.tmp"
  local ld="-s -w '-extldflags=-Wl,--export-dynamic -Wl,--unresolved-symbols=ignore-in-object-files -Wl,-z,lazy'"
  ld+=" -X $mod/internal/info.version=${version#v} -X $mod/internal/info.gitCommit=module"
  local pkgs=() p
  for p in "$@"; do pkgs+=("./cmd/$p"); done
  # -mod=mod: a release with a vendor/ directory (1.17) has only vendor/modules.txt in its module
  # zip; its go.sum pins the same dependencies.
  (cd "$dir" && export TMPDIR="$ws/tmp" CGO_ENABLED=1 && timed "toolkit $version" go build -p "$GO_P" \
    -mod=mod -trimpath -ldflags="$ld" -o "$out.tmp/" "${pkgs[@]}")
  for p in "$@"; do
    "$out.tmp/$p" --version | grep -q "version ${version#v}" \
      || { log "$p does not report version ${version#v}"; return 1; }
  done
  touch "$out.tmp/.complete"; rm -rf "$out"; mv "$out.tmp" "$out"
}

build_toolkit() {
  local out="$CACHE/bin/nvidia-container-toolkit-$NVIDIA_CTK_VERSION"
  if done_marker "$out"; then log "nvidia-container-toolkit $NVIDIA_CTK_VERSION cached in $out"; return; fi
  toolkit_module_build "$NVIDIA_CTK_VERSION" "$out" nvidia-ctk nvidia-cdi-hook
}

# The older release's nvidia-cdi-hook alone (NVIDIA_CTK_OLD_VERSION): a hook that lacks the newer
# subcommands, which the plugin's probe of the hook (dra_gpu/plugin/cdi_hook.py) is tested with.
build_old_hook() {
  local out="$CACHE/bin/nvidia-cdi-hook-$NVIDIA_CTK_OLD_VERSION"
  if done_marker "$out"; then log "nvidia-cdi-hook $NVIDIA_CTK_OLD_VERSION cached in $out"; return; fi
  toolkit_module_build "$NVIDIA_CTK_OLD_VERSION" "$out" nvidia-cdi-hook
}

# NVIDIA's DRA driver (Go module sigs.k8s.io/dra-driver-nvidia-gpu), its gpu-kubelet-plugin: the
# driver dra-gpu must be a drop-in for, run on the simulated node and measured against. Built from
# a writable copy of the module in the cache dir with the harness's patch (nothing of NVIDIA's
# code is in the repository):
#   - k8s.io/kubernetes v1.37.0-rc.0 and its staging modules at v0.37.0-rc.0 are not served by the
#     module proxy: required at v1.37.2 / v0.37.2 instead;
#   - github.com/NVIDIA/go-nvfm (fabric manager's bindings) is not served: pkg/fabricmanager's
#     go-nvfm client is left out and its NewClient returns the package's own stub client (fabric
#     manager exists only on NVSwitch systems; FabricManagerPartitioning stays off).
# cgo (go-nvml's bindings dlopen libnvidia-ml at run time), linked as NVIDIA's Makefile does.
build_nvidia_dra() {
  local out="$CACHE/bin/dra-driver-nvidia-gpu-$NVIDIA_DRA_VERSION"
  if done_marker "$out"; then log "dra-driver-nvidia-gpu $NVIDIA_DRA_VERSION cached in $out"; return; fi
  command -v gcc >/dev/null || { log "NVIDIA's DRA driver needs a C compiler (cgo): e2e/node/build.sh debs"; return 1; }
  local ws="$CACHE/src/dra-driver-nvidia-gpu-$NVIDIA_DRA_VERSION" mod=sigs.k8s.io/dra-driver-nvidia-gpu
  new_workspace "$ws" e2e.local/nvidiadrabuild
  cd "$ws"
  log "fetching $mod@$NVIDIA_DRA_VERSION"
  local dir; dir="$(go mod download -json "$mod@$NVIDIA_DRA_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
  [ -f "$dir/go.mod" ] || { log "module $mod@$NVIDIA_DRA_VERSION not found in the module cache"; return 1; }
  cp -r "$dir" "$ws/module" && chmod -R u+w "$ws/module" && mkdir -p "$ws/tmp" "$out.tmp"
  cd "$ws/module"
  sed -i -E 's#^(\s*k8s\.io/[a-z-]+) v0\.37\.0-rc\.0#\1 v0.37.2#; s#^(\s*k8s\.io/kubernetes) v1\.37\.0-rc\.0#\1 v1.37.2#' go.mod
  go mod edit -droprequire=github.com/NVIDIA/go-nvfm
  rm -f pkg/fabricmanager/client_nvfm.go pkg/fabricmanager/client_nvfm_test.go
  cat >pkg/fabricmanager/client_e2e_stub.go <<'GO'
package fabricmanager

// NewClient: the package's stub client (the e2e build has no go-nvfm, which is not served).
func NewClient(libraryPath string, params ConnectParams) Client { return NewStubClient() }
GO
  if grep -q 'rc\.0' go.mod; then log "go.mod still requires a release candidate: $(grep 'rc\.0' go.mod)"; return 1; fi
  local ld="-s -w '-extldflags=-Wl,--export-dynamic -Wl,--unresolved-symbols=ignore-in-object-files -Wl,-z,lazy'"
  (export TMPDIR="$ws/tmp" CGO_ENABLED=1 GOFLAGS=-mod=mod && timed "dra-driver-nvidia-gpu $NVIDIA_DRA_VERSION" \
    go build -p "$GO_P" -trimpath -ldflags="$ld" -o "$out.tmp/" ./cmd/gpu-kubelet-plugin)
  "$out.tmp/gpu-kubelet-plugin" --help >/dev/null || { log "gpu-kubelet-plugin does not start"; return 1; }
  touch "$out.tmp/.complete"; rm -rf "$out"; mv "$out.tmp" "$out"
}

# ---------------------------------------------------------------------------- podresources
# The kubelet's PodResources API (k8s.io/kubelet's api.proto) for the unit tier's client test
# (tests/test_e2e_podresources.py), which runs before the e2e builds the kubelet: only the module,
# into Go's module cache (the same v0.<minor>.<patch> pin as build_kubernetes's staging modules).
fetch_podresources() {
  local mod="k8s.io/kubelet@v0.${K8S_VERSION#v1.}"
  local tmp; tmp="$(mktemp -d)"  # outside any go.mod: the module alone, not a build's graph
  (cd "$tmp" && go mod download "$mod") || { rmdir "$tmp"; log "could not download $mod"; return 1; }
  rmdir "$tmp"
  log "$mod in Go's module cache"
}

main() {
  local what="${1:-all}" t0=$SECONDS
  mkdir -p "$CACHE/bin" "$CACHE/src"
  case "$what" in
    all) debs; (build_kubernetes); (build_etcd); (build_containerd); (build_toolkit); (build_old_hook); (build_nvidia_dra); bash "$HERE/image_build.sh" ;;
    kubernetes) (build_kubernetes) ;;
    etcd) (build_etcd) ;;
    containerd) (build_containerd) ;;
    debs) debs ;;
    image) bash "$HERE/image_build.sh" ;;
    kwok) (build_kwok) ;;
    toolkit) (build_toolkit); (build_old_hook) ;;
    nvidia-dra) (build_nvidia_dra) ;;
    podresources) fetch_podresources ;;
    *) echo "usage: $0 [all|kubernetes|etcd|containerd|debs|image|kwok|toolkit|nvidia-dra|podresources]" >&2; exit 2 ;;
  esac
  log "done ($what) in $((SECONDS - t0)) s; binaries under $CACHE/bin"
}

main "$@"
