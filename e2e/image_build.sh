#!/usr/bin/env bash
# Build the dra-gpu image (deploy/Dockerfile) without a container engine or a registry:
#
#   e2e/image_build.sh            (also: e2e/build.sh image)
#
# 1. The base: Debian $SUITE (Essential packages only: no apt) with python3 and python3-venv, made by mmdebstrap from
#    Debian's archive (docs, man pages, locales, apt lists and caches left out) and committed into
#    a private buildah store as localhost/dra-gpu-base:<suite>-<hash of the mmdebstrap inputs>.
#    The rootfs tarball is kept in the cache, so a wiped store re-imports it without mmdebstrap.
# 2. The image: `buildah bud --isolation chroot` of deploy/Dockerfile with
#    PYTHON_IMAGE=<that base>, from a context holding exactly the files git sees (tracked or
#    untracked, not ignored) that the Dockerfile copies, pushed as an OCI archive to
#    $CACHE/images/dra-gpu.tar (name localhost/dra-gpu:<version>, the chart's default image).
#    It is rebuilt only when the hash of those files, the Dockerfile and the base changes
#    ($CACHE/images/dra-gpu.json records the hash, the size, the packages and the build time).
#
# The buildah store (root, runroot) lives under $CACHE/buildah: no system configuration is
# touched. Temporary containers and the built image are removed from the store after the push.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
CACHE="${DRA_GPU_CACHE:-$HOME/.cache/dra-gpu}"
IMAGES="$CACHE/images"
STORE="$CACHE/buildah"
SUITE=bookworm
MIRROR="${E2E_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
ARCHIVE="$IMAGES/dra-gpu.tar"
META="$IMAGES/dra-gpu.json"

log() { printf '[image %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

bah() {
  buildah --root "$STORE/root" --runroot "$STORE/run" --storage-driver "${E2E_BUILDAH_DRIVER:-overlay}" "$@"
}

need() {
  local missing=()
  command -v buildah >/dev/null || missing+=(buildah)
  command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
  if [ ${#missing[@]} -gt 0 ]; then
    log "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1 || {
      apt-get update >/dev/null && apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null; }
  fi
}

# ---------------------------------------------------------------------------- the base
# What goes into the base; its hash names the base image (change anything here: a new base).
MMDEBSTRAP_ARGS=(
  --variant=essential
  # libstdc++6: grpcio(-tools) and cel-expr-python are C++ extensions.
  --include=python3,python3-venv,libstdc++6
  # /bin -> usr/bin without the usrmerge package (which pulls in perl).
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
  --dpkgopt='path-exclude=/usr/share/doc/*'
  --dpkgopt='path-include=/usr/share/doc/*/copyright'
  --dpkgopt='path-exclude=/usr/share/man/*'
  --dpkgopt='path-exclude=/usr/share/info/*'
  --dpkgopt='path-exclude=/usr/share/locale/*'
  --dpkgopt='path-include=/usr/share/locale/locale.alias'
  # glibc's iconv modules (8 MB): Python's codecs do not use them.
  --dpkgopt='path-exclude=/usr/lib/*/gconv/*'
  # The runtime provides /dev; apt's lists and caches are removed by mmdebstrap's cleanup.
  --skip=output/dev
)

base_image() { # prints the base image's name, building or importing it when missing
  local key name tarball
  key="$(printf '%s\n' "$SUITE" "$MIRROR" "${MMDEBSTRAP_ARGS[@]}" | sha256sum | cut -c1-16)"
  name="localhost/dra-gpu-base:$SUITE-$key"
  tarball="$IMAGES/dra-gpu-base/$key.tar"
  if bah inspect --type image "$name" >/dev/null 2>&1; then echo "$name"; return; fi
  if [ ! -f "$tarball" ]; then
    log "mmdebstrap $SUITE (${MMDEBSTRAP_ARGS[*]:0:2})"
    local t0=$SECONDS
    rm -rf "$IMAGES/dra-gpu-base" && mkdir -p "$IMAGES/dra-gpu-base"
    SOURCE_DATE_EPOCH=0 mmdebstrap --quiet --format=tar "${MMDEBSTRAP_ARGS[@]}" "$SUITE" "$tarball.tmp" "$MIRROR" >&2
    mv "$tarball.tmp" "$tarball"
    log "base rootfs made in $((SECONDS - t0)) s ($(du -m "$tarball" | cut -f1) MB)"
  fi
  local c
  c="$(bah from --quiet scratch)"
  bah add --quiet "$c" "$tarball" / >/dev/null
  bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd /bin/sh \
    --label org.opencontainers.image.description="Debian $SUITE essential, python3 (mmdebstrap)" "$c"
  bah commit --quiet --rm "$c" "$name" >/dev/null
  log "base image $name committed"
  local old  # earlier bases (other inputs) go
  for old in $(bah images --format '{{.Name}}:{{.Tag}}' | grep '^localhost/dra-gpu-base:' || true); do
    [ "$old" = "$name" ] || bah rmi "$old" >/dev/null 2>&1 || true
  done
  echo "$name"
}

# ---------------------------------------------------------------------------- the image
context_files() { # NUL-separated, sorted: what git sees of what the Dockerfile copies
  git -C "$ROOT" ls-files -z --cached --others --exclude-standard -- \
    pyproject.toml setup.py README.md protos dra_gpu deploy/Dockerfile .dockerignore \
    | sort -zu | while IFS= read -r -d '' f; do [ -f "$ROOT/$f" ] && printf '%s\0' "$f"; done
}

inputs_hash() { # base name + each file's path and content
  {
    echo "$1"
    (cd "$ROOT" && context_files | xargs -0 sha256sum)
  } | sha256sum | cut -c1-16
}

CONTAINER=
cleanup() { if [ -n "$CONTAINER" ]; then bah rm "$CONTAINER" >/dev/null 2>&1 || true; fi; }
trap cleanup EXIT

main() {
  need
  mkdir -p "$IMAGES" "$STORE"
  exec 9>"$STORE/.lock"  # one build at a time per cache
  flock 9
  local t0=$SECONDS base key version name
  base="$(base_image)"
  key="$(inputs_hash "$base")"
  version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml" | head -1)"
  name="localhost/dra-gpu:$version"
  if [ -f "$ARCHIVE" ] && [ -f "$META" ] && grep -q "\"key\": \"$key\"" "$META"; then
    log "$name cached ($ARCHIVE, inputs $key)"
    return
  fi
  local ctx="$CACHE/image-context"
  rm -rf "$ctx" && mkdir -p "$ctx"
  (cd "$ROOT" && context_files | xargs -0 cp --parents -t "$ctx")
  log "buildah bud $name (base $base, inputs $key)"
  local t1=$SECONDS
  # pip inside the build trusts what pip trusts here (a proxy's CA, when one is configured).
  local ca="${PIP_CERT:-${SSL_CERT_FILE:-}}" pip_args=()
  [ -n "$ca" ] && [ -f "$ca" ] && pip_args=(--volume "$ca:/run/build-ca.pem:ro" --build-arg PIP_CERT=/run/build-ca.pem)
  [ -n "${PIP_INDEX_URL:-}" ] && pip_args+=(--build-arg PIP_INDEX_URL="$PIP_INDEX_URL")
  bah bud --isolation chroot --pull-never --layers=false --network host "${pip_args[@]}" \
    --build-arg PYTHON_IMAGE="$base" -f "$ctx/deploy/Dockerfile" -t "$name" "$ctx" >&2
  local build_s=$((SECONDS - t1))

  # What is in it: the rootfs size, the Python packages, `dra-gpu --version` (as the image's user).
  local mnt size packages version_out
  CONTAINER="$(bah from --quiet --pull-never "$name")"
  local c="$CONTAINER"
  mnt="$(bah mount "$c")"
  size="$(du -sb "$mnt" | cut -f1)"
  bah umount "$c" >/dev/null
  version_out="$(bah run --isolation chroot --user 65532:65532 "$c" -- dra-gpu --version)"
  packages="$(bah run --isolation chroot "$c" -- python3 -c 'import importlib.metadata as m, json
print(json.dumps(sorted(f"{d.name}=={d.version}" for d in m.distributions())))')"

  rm -f "$ARCHIVE.tmp"
  bah push --quiet "$name" "oci-archive:$ARCHIVE.tmp:$name" >&2
  mv "$ARCHIVE.tmp" "$ARCHIVE"
  bah rm "$c" >/dev/null && CONTAINER=
  bah rmi "$name" >/dev/null 2>&1 || true
  bah rmi --prune >/dev/null 2>&1 || true
  rm -rf "$ctx"
  cat >"$META" <<EOF
{"key": "$key", "name": "$name", "base": "$base", "rootfs_bytes": $size,
 "archive_bytes": $(stat -c %s "$ARCHIVE"), "build_seconds": $build_s,
 "version": "$version_out", "packages": $packages}
EOF
  log "$name: rootfs $((size / 1000000)) MB, archive $(($(stat -c %s "$ARCHIVE") / 1000000)) MB," \
    "bud $build_s s, all $((SECONDS - t0)) s; '$version_out'"
}

main "$@"
