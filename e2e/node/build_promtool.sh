#!/usr/bin/env bash
# Build (once) and cache Prometheus's promtool from its Go module, pinned: e2e/tests/test_alerts.py
# checks the chart's alerts with it (`promtool check rules`, `promtool test rules`).
#
#   e2e/node/build_promtool.sh        # prints the path of the promtool binary on its last line
#
# Cached as deploy/go-program.sh says (bin/promtool-<version>/promtool under ~/.cache/dra-gpu).
#
# Built with the tag remove_all_sd: prometheus/plugins then registers only the file and http
# service discoveries (promtool imports the kubernetes one itself), so the cloud providers' SDKs
# (aws, azure, gce, oci, ...) are not compiled. `go mod tidy` still downloads the modules every tag
# could need (about 300 MB into an empty module cache); the build compiles only what it links.
set -euo pipefail

# shellcheck source=deploy/go-program.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../deploy/go-program.sh"

PROMETHEUS_VERSION="${PROMETHEUS_VERSION:-v0.316.0}"
TAGS="remove_all_sd"
mod=github.com/prometheus/prometheus
# Bump when the way promtool is built changes, so a cached binary built the old way is rebuilt.
go_program promtool "$PROMETHEUS_VERSION" "promtool-build-1 (tags $TAGS)"
go_program_resolve "$mod" "$mod/cmd/promtool"
# As upstream's .promu.yml: the version `promtool --version` prints.
v="${PROMETHEUS_VERSION#v0.}"   # v0.316.0 -> 3.16.0
v="${v:0:1}.${v:1}"
ld="-s -w -X github.com/prometheus/common/version.Version=$v"
ld+=" -X github.com/prometheus/common/version.Revision=$PROMETHEUS_VERSION"
ld+=" -X github.com/prometheus/common/version.Branch=module"
go_program_log "go build -p $GO_P -tags $TAGS $mod/cmd/promtool"
go build -p "$GO_P" -trimpath -tags "$TAGS" -ldflags="$ld" -o "$GO_PROGRAM_OUT.tmp/promtool" "$mod/cmd/promtool"
"$GO_PROGRAM_OUT.tmp/promtool" --version >/dev/null
go_program_done
