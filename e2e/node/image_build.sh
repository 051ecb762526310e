#!/usr/bin/env bash
# Build the dra-gpu image (deploy/Dockerfile) without a container engine or a registry:
#
#   e2e/node/image_build.sh            (also: e2e/node/build.sh image)
#
# 1. The bases: Debian $SUITE, Essential packages only (no apt), made by mmdebstrap from Debian's
#    archive (docs, man pages, locales, glibc's iconv modules, apt lists and caches left out), each
#    committed into a private buildah store as localhost/dra-gpu-base:<suite>-<kind>-<hash of its
#    mmdebstrap inputs>: `run` (python3, libstdc++6) is the image's base, `build` (also
#    python3-venv and binutils) the build stage's. The rootfs tarballs are kept in the cache, so a
#    wiped store re-imports them without mmdebstrap.
# 2. The image: `buildah bud --isolation chroot` of deploy/Dockerfile with PYTHON_IMAGE=<run
#    base> and BUILD_IMAGE=<build base>, from a context of exactly the files git sees (tracked
#    or untracked, not ignored) that the Dockerfile copies, pushed as an OCI archive to
#    $CACHE/images/dra-gpu.tar (name localhost/dra-gpu:<version>, the chart's default image).
#    It is rebuilt only when a hash of those files, the bases' names and this script changes
#    ($CACHE/images/dra-gpu.json records the hash, the size, the packages and the build time).
#
# The buildah store (root, runroot) lives under $CACHE/buildah: no system configuration is
# touched. Temporary containers and the built image are removed from the store after the push.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$(dirname "$HERE")")"
CACHE="${DRA_GPU_CACHE:-$HOME/.cache/dra-gpu}"
IMAGES="$CACHE/images"
STORE="$CACHE/buildah"
SUITE=bookworm
MIRROR="${E2E_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
ARCHIVE="$IMAGES/dra-gpu.tar"
META="$IMAGES/dra-gpu.json"
# The simulator's image: the driver's image plus the simulator's own distribution (sim/), for the
# chart's simulatedProfile. The driver's image never carries it.
SIM_ARCHIVE="$IMAGES/dra-gpu-simnode.tar"
SIM_META="$IMAGES/dra-gpu-simnode.json"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"

log() { printf '[image %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

bah() { # buildah on the private store; its temporary files there too
  TMPDIR="$STORE/tmp" buildah --root "$STORE/root" --runroot "$STORE/run" --storage-driver "${E2E_BUILDAH_DRIVER:-overlay}" "$@"
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

# ---------------------------------------------------------------------------- the bases
# What goes into the bases; a hash of it names each (change anything here: new bases).
MMDEBSTRAP_ARGS=(
  --variant=essential
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
# The image's base (PYTHON_IMAGE): Python, and libstdc++ for the C++ extensions (grpcio,
# cel-expr-python). The build stage's (BUILD_IMAGE): also venv/ensurepip and strip (binutils).
RUN_PACKAGES=python3,libstdc++6
BUILD_PACKAGES=python3,libstdc++6,python3-venv,binutils

base_image() { # KIND PACKAGES: prints the base's name, building or importing it when missing
  local kind="$1" packages="$2" key name tarball
  trap cleanup EXIT # runs in a subshell $(...): its own trap for its temporary container
  key="$(printf '%s\n' "$SUITE" "$MIRROR" "$packages" "${MMDEBSTRAP_ARGS[@]}" | sha256sum | cut -c1-16)"
  name="localhost/dra-gpu-base:$SUITE-$kind-$key"
  tarball="$IMAGES/dra-gpu-base/$kind-$key.tar"
  if bah inspect --type image "$name" >/dev/null 2>&1; then echo "$name"; return; fi
  if [ ! -f "$tarball" ]; then
    log "mmdebstrap $SUITE --variant=essential --include=$packages"
    local t0=$SECONDS
    mkdir -p "$IMAGES/dra-gpu-base" && rm -f "$IMAGES/dra-gpu-base/$kind-"*
    SOURCE_DATE_EPOCH=0 mmdebstrap --quiet --format=tar --include="$packages" "${MMDEBSTRAP_ARGS[@]}" \
      "$SUITE" "$tarball.tmp" "$MIRROR" >&2
    mv "$tarball.tmp" "$tarball"
    log "$kind base rootfs made in $((SECONDS - t0)) s ($(du -m "$tarball" | cut -f1) MB)"
  fi
  CONTAINER="$(bah from --quiet scratch)"
  bah add --quiet "$CONTAINER" "$tarball" / >/dev/null
  bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd /bin/sh \
    --label org.opencontainers.image.description="Debian $SUITE essential + $packages (mmdebstrap)" \
    "$CONTAINER"
  bah commit --quiet --rm "$CONTAINER" "$name" >/dev/null && CONTAINER=
  log "base image $name committed"
  echo "$name"
}

# ---------------------------------------------------------------------------- the image
context_files() { # NUL-separated, sorted: what git sees of what the Dockerfile copies
  git -C "$ROOT" ls-files -z --cached --others --exclude-standard -- \
    requirements.lock requirements-build.lock pyproject.toml setup.py README.md protos dra_gpu \
    deploy/Dockerfile .dockerignore \
    | sort -zu | while IFS= read -r -d '' f; do [ -f "$ROOT/$f" ] && printf '%s\0' "$f"; done
}

inputs_hash() { # the bases' names, this script, each context file's path and content
  {
    echo "$1"
    sha256sum <"$HERE/image_build.sh"
    (cd "$ROOT" && context_files | xargs -0 sha256sum)
  } | sha256sum | cut -c1-16
}

CONTAINER=
cleanup() { if [ -n "$CONTAINER" ]; then bah rm "$CONTAINER" >/dev/null 2>&1 || true; fi; }
trap cleanup EXIT

main() {
  need
  mkdir -p "$IMAGES" "$STORE/tmp"
  exec 9>"$STORE/.lock"  # one build at a time per cache
  flock 9
  local t0=$SECONDS base build_base key version name
  base="$(base_image run "$RUN_PACKAGES")"
  build_base="$(base_image build "$BUILD_PACKAGES")"
  key="$(inputs_hash "$base $build_base")"
  local old # earlier bases (other inputs) go
  for old in $(bah images --format '{{.Name}}:{{.Tag}}' | grep '^localhost/dra-gpu-base:' || true); do
    [ "$old" = "$base" ] || [ "$old" = "$build_base" ] || bah rmi "$old" >/dev/null 2>&1 || true
  done
  version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml" | head -1)"
  name="localhost/dra-gpu:$version"
  if [ -f "$ARCHIVE" ] && [ -f "$META" ] && grep -q "\"key\": \"$key\"" "$META"; then
    log "$name cached ($ARCHIVE, inputs $key)"
  else
    driver_image "$key" "$base" "$build_base" "$version" "$name"
  fi
  simnode_image "$key" "$version"
}

driver_image() { # KEY BASE BUILD_BASE VERSION NAME: builds the driver's image into $ARCHIVE
  local key="$1" base="$2" build_base="$3" version="$4" name="$5" t0=$SECONDS
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
    --build-arg PYTHON_IMAGE="$base" --build-arg BUILD_IMAGE="$build_base" -f "$ctx/deploy/Dockerfile" -t "$name" "$ctx" >&2
  local build_s=$((SECONDS - t1))

  # What is in it: the rootfs size, the Python packages, `dra-gpu --version` (as the image's user).
  local mnt size packages version_out
  CONTAINER="$(bah from --quiet --pull-never "$name")"
  local c="$CONTAINER"
  mnt="$(bah mount "$c")"
  size="$(du -sb "$mnt" | cut -f1)"
  # The simulator is its own distribution: nothing of it (package, C sources) is in the driver's image.
  local sim_files
  sim_files="$(find "$mnt/opt" \( -path '*simnode*' -o -name 'libnvidia-ml.c' -o -name 'simgpu.h' \) | wc -l)"
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
{"key": "$key", "name": "$name", "base": "$base", "build_base": "$build_base",
 "rootfs_bytes": $size, "simulator_files": $sim_files,
 "archive_bytes": $(stat -c %s "$ARCHIVE"), "build_seconds": $build_s,
 "version": "$version_out", "packages": $packages}
EOF
  log "$name: rootfs $((size / 1000000)) MB, archive $(($(stat -c %s "$ARCHIVE") / 1000000)) MB," \
    "bud $build_s s, all $((SECONDS - t0)) s; '$version_out'"
}

simnode_image() { # KEY VERSION: the driver's image plus the simulator package, into $SIM_ARCHIVE
  local key="$1" version="$2" t0=$SECONDS sim_key site purelib profiles
  local name="localhost/dra-gpu-simnode:$version"
  sim_key="$( { echo "$key"; (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard -- sim \
    | sort -z | xargs -0 sha256sum); } | sha256sum | cut -c1-16)"
  if [ -f "$SIM_ARCHIVE" ] && [ -f "$SIM_META" ] && grep -q "\"key\": \"$sim_key\"" "$SIM_META"; then
    log "$name cached ($SIM_ARCHIVE, inputs $sim_key)"
    return
  fi
  site="$(mktemp -d)"
  # A pure-Python distribution: pip installs it into a directory, copied into the image's venv.
  "$PYTHON" -m pip install --quiet --no-deps --no-compile --no-build-isolation --target "$site" "$ROOT/sim" >&2
  rm -rf "$ROOT/sim/build"  # setuptools' build tree: stale files there would reach the next image
  CONTAINER="$(bah from --quiet "oci-archive:$ARCHIVE")"
  purelib="$(bah run --isolation chroot "$CONTAINER" -- python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  bah copy --quiet "$CONTAINER" "$site" "$purelib" >/dev/null
  rm -rf "$site"
  bah config --label org.opencontainers.image.title="dra-gpu-simnode" \
    --label org.opencontainers.image.description="dra-gpu with its simulated GPU node (demos, tests)" "$CONTAINER"
  # The driver finds it through its entry point, as the image's user.
  profiles="$(bah run --isolation chroot --user 65532:65532 "$CONTAINER" -- python3 -c \
    'from dra_gpu.node.profiles import profile_names; print(" ".join(profile_names()))')"
  [ -n "$profiles" ] || { log "$name: dra-gpu does not see the simulator's profiles"; return 1; }
  bah commit --quiet --rm "$CONTAINER" "$name" >/dev/null && CONTAINER=
  rm -f "$SIM_ARCHIVE.tmp"
  bah push --quiet "$name" "oci-archive:$SIM_ARCHIVE.tmp:$name" >&2
  mv "$SIM_ARCHIVE.tmp" "$SIM_ARCHIVE"
  bah rmi "$name" >/dev/null 2>&1 || true
  cat >"$SIM_META" <<EOF
{"key": "$sim_key", "name": "$name", "profiles": "$profiles", "seconds": $((SECONDS - t0))}
EOF
  log "$name: profiles $profiles, $((SECONDS - t0)) s"
}

main "$@"
