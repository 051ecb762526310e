# Sourced by deploy/build-helm.sh, deploy/build-crane.sh and e2e/node/build_promtool.sh: build
# (once) and cache a pinned program from its Go module.
#
# The binary lands in ${DRA_GPU_CACHE:-$HOME/.cache/dra-gpu}/bin/<name>-<version>/<name>, built from
# a generated go.mod in .../src/<name>-<version>/ (never in the repo). A directory whose .complete
# marker holds the caller's RECIPE is not rebuilt; changing the pin or the recipe builds a new one.
# GOMODCACHE/GOCACHE are Go's defaults. A caller:
#
#   source go-program.sh; go_program NAME VERSION RECIPE   # exits printing the path when cached
#   go_program_resolve MODULE PACKAGE                      # cd's into a workspace; go mod tidy
#   go build -p "$GO_P" ... -o "$GO_PROGRAM_OUT.tmp/NAME" MODULE/PACKAGE
#   go_program_done                                        # prints the binary's path
CACHE="${DRA_GPU_CACHE:-$HOME/.cache/dra-gpu}"
GO_P="${E2E_GO_P:-2}"
export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:--buildvcs=false}"

go_program() { # NAME VERSION RECIPE
  GO_PROGRAM_NAME="$1" GO_PROGRAM_VERSION="$2" GO_PROGRAM_RECIPE="$3"
  GO_PROGRAM_OUT="$CACHE/bin/$1-$2"
  GO_PROGRAM_T0=$SECONDS
  if [ -f "$GO_PROGRAM_OUT/.complete" ] && [ "$(cat "$GO_PROGRAM_OUT/.complete")" = "$3" ]; then
    go_program_log "$1 $2 cached in $GO_PROGRAM_OUT"
    echo "$GO_PROGRAM_OUT/$1"; exit 0
  fi
  command -v go >/dev/null || { echo "build-$1: needs Go (go.dev/dl or apt-get install golang)" >&2; exit 2; }
}

go_program_log() { printf '[build-%s %s] %s\n' "$GO_PROGRAM_NAME" "$(date +%H:%M:%S)" "$*" >&2; }

go_program_resolve() { # MODULE PACKAGE: a workspace requiring MODULE@VERSION that imports PACKAGE
  local ws="$CACHE/src/$GO_PROGRAM_NAME-$GO_PROGRAM_VERSION"
  rm -rf "$ws" && mkdir -p "$ws" && cd "$ws"
  go mod init "dra-gpu.local/${GO_PROGRAM_NAME}build" >/dev/null 2>&1
  go mod edit -require="$1@$GO_PROGRAM_VERSION"
  printf '//go:build tools\n\npackage tools\n\nimport _ "%s"\n' "$2" >tools.go
  go_program_log "resolving $1@$GO_PROGRAM_VERSION"
  go mod tidy >tidy.log 2>&1 || { tail -30 tidy.log >&2; exit 1; }
  rm -rf "$GO_PROGRAM_OUT.tmp" && mkdir -p "$GO_PROGRAM_OUT.tmp"
}

go_program_done() {
  echo "$GO_PROGRAM_RECIPE" >"$GO_PROGRAM_OUT.tmp/.complete"
  rm -rf "$GO_PROGRAM_OUT" && mv "$GO_PROGRAM_OUT.tmp" "$GO_PROGRAM_OUT"
  go_program_log "$GO_PROGRAM_NAME $GO_PROGRAM_VERSION built in $((SECONDS - GO_PROGRAM_T0)) s: $GO_PROGRAM_OUT/$GO_PROGRAM_NAME"
  echo "$GO_PROGRAM_OUT/$GO_PROGRAM_NAME"
}
