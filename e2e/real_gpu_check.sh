#!/usr/bin/env bash
# What dra-gpu depends on, read on a node: a real GPU node (the default) or a host-like driver root.
#
#   e2e/real_gpu_check.sh [--driver-root R] [--dev-root D] [--image IMAGEDIR/debian.tar] [--python PY]
#
# Defaults: driver root /, dev root /dev (a real node). Run as root, from a checkout; offline is
# fine: the checkout and a Python with pynvml, PyYAML and pyelftools are all it needs (the NVML
# section falls back to ctypes alone, and says so), plus runc for the container section and a C
# compiler for the CUDA client.
#
# READ-ONLY: it changes no MIG mode, compute mode, clocks or persistence mode (no NVML setter is
# called). Everything that runs NVIDIA's code (NVML, libcuda, nvidia-smi, the MPS daemon) runs in a
# private mount namespace whose /dev is a tmpfs holding copies of the dev root's NVIDIA nodes
# (run as root without a kernel module, NVIDIA's libraries create /dev/nvidiactl wherever they
# look); NVIDIA's binaries run chrooted into a read-only view of the driver root with that /dev,
# their own /tmp and /dev/shm, as NVIDIA's own driver runs them. The last section compares the
# host's /dev before and after.
#
# Sections, each ending in `RESULT <name>: ok|FAIL|SKIP <why>`; a failed section never stops the
# others; the exit status is the number of FAILs:
#   driver     /proc/driver/nvidia/version, NVML's driver version
#   glibc      the host's and the driver root's
#   devices    /proc/devices nvidia lines, ls -l of the dev root's nvidia nodes and nvidia-caps
#   nvml       e2e/realgpu/nvml_probe.py over the root's libnvidia-ml.so.1, loaded by full path
#   inventory  `python -m dra_gpu.cli inventory --driver-root R -o json`
#   runc       one claim's CDI spec (dra-gpu's own code) applied with runc; nvidia-smi -L inside
#              (rootfs: --image's layer, else one assembled read-only from the host's /usr, /lib*, /etc)
#   mps-daemon NVIDIA's nvidia-cuda-mps-control -d in a private pipe/log dir; limits set, read back
#   cuda-client e2e/realgpu/cuda_client.c (built with cc) through the daemon: with the daemon's
#              /dev/shm (expected on a GPU: success) and with another one (expected: CUDA error 805)
#   host-dev   nothing new under the host's /dev; nothing left running
#
# On a host-like root (e2e/node/host_like_root.py: NVIDIA's real 550.163.01 user space, a simulated
# NVML, no kernel module) the expected answers differ where no kernel module can be simulated:
# nvidia-smi stops at its NVML version check, cuInit answers 100 (CUDA_ERROR_NO_DEVICE).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DRIVER_ROOT=/
DEV_ROOT=/dev
IMAGE=
PYTHON=${PYTHON:-}
WORK=
HOST_LIKE_MANIFEST=.dra-gpu-host-like-root.json

usage() { sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
while [ $# -gt 0 ]; do
  case $1 in
    --driver-root) DRIVER_ROOT=$2; shift 2 ;;
    --dev-root) DEV_ROOT=$2; shift 2 ;;
    --image) IMAGE=$2; shift 2 ;;
    --python) PYTHON=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;  # internal: the outer run's work directory
    -h|--help) usage ;;
    *) echo "real_gpu_check: unknown argument $1" >&2; usage ;;
  esac
done
if [ -z "$PYTHON" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
DRIVER_ROOT=$(cd "$DRIVER_ROOT" && pwd -P) || { echo "real_gpu_check: no driver root" >&2; exit 2; }
DEV_ROOT=$(cd "$DEV_ROOT" && pwd -P) || { echo "real_gpu_check: no dev root" >&2; exit 2; }
SIMULATED=
[ -f "$DRIVER_ROOT/$HOST_LIKE_MANIFEST" ] && SIMULATED=1

# ---------------------------------------------------------------------------------------------
# Outer run: the host's /dev before and after, the private mount namespace in between.
if [ -z "${_REAL_GPU_CHECK_INNER:-}" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "real_gpu_check: run as root (private mount namespace, runc, device nodes)" >&2; exit 2
  fi
  if ! unshare -m --propagation private true 2>/dev/null; then
    echo "real_gpu_check: cannot make a private mount namespace (unshare -m); NVIDIA's code is" \
      "not run against the host's /dev" >&2
    exit 2
  fi
  WORK=$(mktemp -d /tmp/real-gpu-check.XXXXXX)
  # NVIDIA's processes (another MPS daemon may be serving pods on a real node: only new ones count).
  nv_procs() {
    local p comm
    for p in /proc/[0-9]*; do
      comm=$(cat "$p/comm" 2>/dev/null) || continue
      case $comm in nvidia-cuda-mps*|nvidia-smi|cuda_client) echo "${p#/proc/} $comm" ;; esac
    done | sort
  }
  find /dev -mindepth 1 -maxdepth 1 -printf '%f\n' | sort >"$WORK/dev.before"
  nv_procs >"$WORK/procs.before"
  _REAL_GPU_CHECK_INNER=1 unshare -m --propagation private bash "$0" --driver-root "$DRIVER_ROOT" \
    --dev-root "$DEV_ROOT" ${IMAGE:+--image "$IMAGE"} --python "$PYTHON" --work "$WORK" \
    | tee "$WORK/log"
  inner=${PIPESTATUS[0]}
  {
    echo
    echo "== host-dev: the host's /dev, and what is left running"
    find /dev -mindepth 1 -maxdepth 1 -printf '%f\n' | sort >"$WORK/dev.after"
    new=$(comm -13 "$WORK/dev.before" "$WORK/dev.after" | tr '\n' ' ')
    for _ in $(seq 50); do  # a daemon told to quit may take a moment to be gone
      left=$(nv_procs | comm -13 "$WORK/procs.before" - | tr '\n' ' ')
      [ -z "$left" ] && break
      sleep 0.1
    done
    echo "  new under /dev: ${new:-none}"
    echo "  NVIDIA processes started by this check and still running: ${left:-none}"
    if [ -n "$new$left" ]; then
      echo "RESULT host-dev: FAIL ${new:+new /dev entries: $new}${left:+still running: $left}"
    else
      echo "RESULT host-dev: ok nothing new under /dev, nothing left running"
    fi
    if [ "$inner" -ge 100 ]; then echo "RESULT script: FAIL the inner run ended with $inner"; fi
  } | tee -a "$WORK/log"
  fails=$(grep -c '^RESULT [a-z-]*: FAIL' "$WORK/log")
  echo "SUMMARY: $(awk '/^RESULT /{n[$3]++} END{for (k in n) printf "%s %d, ", k, n[k]}' "$WORK/log")$fails FAIL"
  rm -f "$WORK/dev.before" "$WORK/dev.after" "$WORK/procs.before" "$WORK/log"
  rmdir "$WORK" 2>/dev/null || echo "real_gpu_check: $WORK not empty, left in place" >&2
  exit $((fails > 99 ? 99 : fails))
fi

# ---------------------------------------------------------------------------------------------
# Inner run, in a private mount namespace: nothing mounted here is seen outside it.
mount -t tmpfs -o mode=700 real-gpu-check "$WORK" || { echo "RESULT setup: FAIL tmpfs on $WORK"; exit 100; }
result() { echo "RESULT $1: $2"; }
indent() { sed 's/^/    /'; }
section() { echo; echo "== $*"; }

# A private /dev: the basic nodes and copies of the dev root's NVIDIA nodes (same numbers).
mkdir "$WORK/dev"
for n in null zero full random urandom tty; do cp -a "/dev/$n" "$WORK/dev/" 2>/dev/null; done
for n in "$DEV_ROOT"/nvidia*; do [ -e "$n" ] && cp -a "$n" "$WORK/dev/"; done
ln -s /proc/self/fd "$WORK/dev/fd"
for i in 0 1 2; do ln -s "/proc/self/fd/$i" "$WORK/dev/$(echo stdin stdout stderr | cut -d' ' -f$((i + 1)))"; done
mkdir "$WORK/dev/shm" "$WORK/dev/pts"
mount --bind "$WORK/dev" /dev || { echo "RESULT setup: FAIL private /dev"; exit 100; }
mount -t tmpfs -o mode=1777 shm /dev/shm
if [ -d "$DEV_ROOT/.nvidia-sim" ]; then  # the simulated node's kernel-side state
  mkdir /dev/.nvidia-sim && mount --bind "$DEV_ROOT/.nvidia-sim" /dev/.nvidia-sim
fi
unset DRA_GPU_SIM_DEV_DIR  # the simulated NVML looks at /dev, as the real one does

# A read-only view of the driver root with that /dev, its own /proc, /tmp and /run: NVIDIA's
# binaries run chrooted here (their own glibc, as on the host they were installed on).
VIEW=$WORK/view
mkdir "$VIEW"
if ! { mount --rbind "$DRIVER_ROOT" "$VIEW" && mount -o remount,bind,ro "$VIEW" &&
  mount --rbind /dev "$VIEW/dev" && mount -t proc proc "$VIEW/proc" &&
  mount -t tmpfs -o mode=1777 tmp "$VIEW/tmp"; }; then
  echo "RESULT setup: FAIL a view of $DRIVER_ROOT (needs dev, proc and tmp directories)"; exit 100
fi
[ -d "$VIEW/run" ] && mount -t tmpfs -o mode=755 run "$VIEW/run"
ROOT_ENV=(PATH=/usr/local/nvidia/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root)
if [ "$DRIVER_ROOT" = / ] && [ -n "${LD_LIBRARY_PATH:-}" ]; then ROOT_ENV+=("LD_LIBRARY_PATH=$LD_LIBRARY_PATH"); fi
in_root() { chroot "$VIEW" /usr/bin/env -i "${ROOT_ENV[@]}" "$@"; }
LIB_DIRS=(usr/lib/x86_64-linux-gnu usr/lib64 usr/lib/x86_64-linux-gnu/nvidia/current
  usr/local/nvidia/lib64 usr/local/nvidia/lib lib/x86_64-linux-gnu lib64 usr/lib/aarch64-linux-gnu usr/lib)
# A library of the root: its path inside the root, every link resolved inside it.
root_lib() {
  local d p
  for d in "${LIB_DIRS[@]}"; do
    p=$(chroot "$VIEW" /usr/bin/readlink -e "/$d/$1" 2>/dev/null) && { echo "$p"; return 0; }
  done
  if [ "$DRIVER_ROOT" = / ]; then
    p=$(ldconfig -p 2>/dev/null | awk -v n="$1" '$1 == n {print $NF; exit}')
    [ -n "$p" ] && readlink -e "$p" && return 0
  fi
  return 1
}
host_path() { if [ "$DRIVER_ROOT" = / ]; then echo "$1"; else echo "$DRIVER_ROOT$1"; fi; }

echo "real_gpu_check: driver root $DRIVER_ROOT, dev root $DEV_ROOT, python $PYTHON ($("$PYTHON" --version 2>&1))"
if [ -n "$SIMULATED" ]; then
  echo "  a host-like root ($HOST_LIKE_MANIFEST): NVIDIA's real user space, a simulated NVML, no kernel module"
fi
echo "  $(uname -srm); $(date -u +%FT%TZ)"

NVML_LIB=$(root_lib libnvidia-ml.so.1) || NVML_LIB=
CUDA_LIB=$(root_lib libcuda.so.1) || CUDA_LIB=

# ---------------------------------------------------------------------------------------------
section "driver: the kernel module's version and NVML's"
if [ -r /proc/driver/nvidia/version ]; then
  sed 's/^/  /' /proc/driver/nvidia/version
  kernel=$(grep -o 'Kernel Module[^0-9]*[0-9][0-9.]*' /proc/driver/nvidia/version | grep -o '[0-9][0-9.]*$')
else
  echo "  /proc/driver/nvidia/version: absent (no NVIDIA kernel module loaded)"
  kernel=
fi
nvml_version=
if [ -n "$NVML_LIB" ]; then
  nvml_version=$("$PYTHON" - "$(host_path "$NVML_LIB")" <<'EOF'
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
buf = ctypes.create_string_buffer(96)
rc = lib.nvmlInit_v2()
if rc == 0 and lib.nvmlSystemGetDriverVersion(buf, 96) == 0:
    print(buf.value.decode())
    lib.nvmlShutdown()
else:
    print(f"nvmlInit_v2 answered {rc}")
EOF
  )
fi
echo "  NVML (${NVML_LIB:-no libnvidia-ml.so.1 in the root}): ${nvml_version:-none}"
if [ -z "$NVML_LIB" ]; then
  result driver "FAIL no libnvidia-ml.so.1 under $DRIVER_ROOT (searched ${LIB_DIRS[*]})"
elif ! [[ $nvml_version =~ ^[0-9]+\.[0-9.]+$ ]]; then
  result driver "FAIL NVML gives no driver version: $nvml_version"
elif [ -n "$kernel" ] && [ "$kernel" != "$nvml_version" ]; then
  result driver "FAIL the kernel module is $kernel, NVML's library $nvml_version"
else
  result driver "ok NVML reports $nvml_version${kernel:+ (kernel module $kernel)}"
fi

# ---------------------------------------------------------------------------------------------
section "glibc: the host's and the driver root's"
host_glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null)
libc=$(chroot "$VIEW" /usr/bin/readlink -e /usr/lib/x86_64-linux-gnu/libc.so.6 2>/dev/null ||
  chroot "$VIEW" /usr/bin/readlink -e /lib64/libc.so.6 2>/dev/null ||
  chroot "$VIEW" /usr/bin/readlink -e /usr/lib64/libc.so.6 2>/dev/null)
root_glibc=
[ -n "$libc" ] && root_glibc=$(grep -a -o -m1 'GNU C Library ([^)]*) [a-z ]*version [0-9.]*' "$VIEW$libc" | head -n1)
echo "  host: ${host_glibc:-unknown}"
echo "  driver root ($libc): ${root_glibc:-unknown}"
if [ -n "$host_glibc" ] && [ -n "$root_glibc" ]; then
  result glibc "ok host ${host_glibc#glibc }, driver root ${root_glibc##* }"
else
  result glibc "FAIL cannot read a glibc version (host: ${host_glibc:-?}, root: ${root_glibc:-?})"
fi

# ---------------------------------------------------------------------------------------------
section "devices: /proc/devices and the dev root's NVIDIA nodes"
lines=$(grep -i nvidia /proc/devices)
echo "  /proc/devices: ${lines:-no nvidia lines (no NVIDIA kernel module)}" | sed '2,$s/^/                 /'
# shellcheck disable=SC2012 # ls -l is the point: type, numbers, modes as the driver made them
ls -l "$DEV_ROOT"/nvidia* 2>&1 | sed 's/^/  /'
if [ -d "$DEV_ROOT/nvidia-caps" ]; then
  # shellcheck disable=SC2012 # as above
  ls -l "$DEV_ROOT/nvidia-caps" | sed 's/^/  nvidia-caps: /'
else
  echo "  $DEV_ROOT/nvidia-caps: absent"
fi
ctl=$(stat -c '%F %t:%T' "$DEV_ROOT/nvidiactl" 2>/dev/null)
gpus=$(find "$DEV_ROOT" -maxdepth 1 -name 'nvidia[0-9]*' -type c 2>/dev/null | wc -l)
if [ "$ctl" = "character special file c3:ff" ] && [ "$gpus" -gt 0 ]; then
  result devices "ok nvidiactl 195:255 and $gpus GPU node(s)${lines:+; kernel module registered}"
else
  result devices "FAIL nvidiactl: ${ctl:-missing}, GPU nodes: $gpus"
fi

# ---------------------------------------------------------------------------------------------
section "nvml: the answers the product depends on"
NVML_JSON=$WORK/nvml.json
if [ -n "$NVML_LIB" ]; then
  out=$("$PYTHON" "$REPO/e2e/realgpu/nvml_probe.py" "$(host_path "$NVML_LIB")" --json "$NVML_JSON" 2>&1)
  echo "$out"
  grep -q '^RESULT nvml:' <<<"$out" || result nvml "FAIL the probe ended without a result: $(tail -n1 <<<"$out")"
else
  result nvml "FAIL no libnvidia-ml.so.1 in the driver root"
fi

# ---------------------------------------------------------------------------------------------
section "inventory: the installation dra-gpu inventory finds"
inv_args=(inventory --driver-root "$DRIVER_ROOT" --node-name real-gpu-check -o json)
inv_out=$WORK/inventory.json
(cd "$REPO" && PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} "$PYTHON" -m dra_gpu.cli "${inv_args[@]}" >"$inv_out" 2>"$WORK/inventory.err")
rc=$?
how="python -m dra_gpu.cli ${inv_args[*]}"
if [ $rc -ne 0 ]; then
  sed 's/^/  /' "$WORK/inventory.err" | tail -n 5
  if grep -q 'ModuleNotFoundError\|ImportError' "$WORK/inventory.err"; then
    result inventory "FAIL the package's dependencies cannot be imported by $PYTHON ($(grep -o "No module named [^ ]*" "$WORK/inventory.err" | head -n1)); the nvml section's ctypes probe stands in"
  else
    result inventory "FAIL $how exited $rc: $(tail -n1 "$WORK/inventory.err")"
  fi
else
  "$PYTHON" - "$inv_out" "$how" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
gpus = doc.get("gpus") or []
inst = doc.get("driverInstallation") or {}
print(f"  {sys.argv[2]}")
print(f"  driverVersion {doc.get('driverVersion')}, cudaDriverVersion {doc.get('cudaDriverVersion')}, {len(gpus)} GPUs")
for g in gpus[:8]:
    print(f"    {g.get('deviceName')}: {g.get('productName')} {g.get('uuid')} {g.get('pciBusId')} "
          f"memory {g.get('memoryBytes')} multiprocessors {g.get('multiprocessors')} numa {g.get('numaNode')} "
          f"pcieRoot {g.get('pcieRoot')} nvlinkDomain {g.get('nvlinkDomain')} (size {g.get('nvlinkDomainSize')}) "
          f"MIG {'on' if g.get('migEnabled') else 'off'}, {len(g.get('migDevices') or [])} MIG devices")
print(f"  skipped: {doc.get('skipped')}")
print(f"  driverInstallation: {json.dumps({k: v for k, v in inst.items() if k != 'files'})}")
for f in inst.get("files") or []:
    print(f"    {f.get('path')}" + (f" -> {f.get('file')}" if f.get("file") != f.get("path") else ""))
if not gpus:
    print("RESULT inventory: FAIL no GPU found")
elif not inst or inst.get("error"):
    print(f"RESULT inventory: FAIL no usable driver installation: {inst.get('error') if inst else 'none'}")
else:
    print(f"RESULT inventory: ok {len(gpus)} GPUs, driver {doc.get('driverVersion')}, {inst.get('libraries')} "
          f"libraries, {inst.get('binaries')} binaries, {inst.get('firmware')} firmware files")
EOF
fi

# ---------------------------------------------------------------------------------------------
section "runc: one claim's CDI spec applied over a glibc rootfs; nvidia-smi -L inside"
runc_args=(--driver-root "$DRIVER_ROOT" --dev-root / --nvml-json "$NVML_JSON" --work "$WORK/runc")
if [ -n "$IMAGE" ]; then runc_args+=(--image "$IMAGE"); else runc_args+=(--host-rootfs); fi
[ -n "$SIMULATED" ] && runc_args+=(--simulated)
mkdir "$WORK/runc"
out=$(PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} "$PYTHON" "$REPO/e2e/realgpu/runc_claim.py" "${runc_args[@]}" 2>&1)
echo "$out"
grep -q '^RESULT runc:' <<<"$out" || result runc "FAIL the runc helper ended without a result: $(tail -n1 <<<"$out")"

# ---------------------------------------------------------------------------------------------
section "mps: NVIDIA's MPS control daemon and a CUDA client through it"
PIPE=/tmp/mps/pipe
LOG=/tmp/mps/log
MPS_ENV=("CUDA_MPS_PIPE_DIRECTORY=$PIPE" "CUDA_MPS_LOG_DIRECTORY=$LOG")
mps() { echo "$1" | in_root "${MPS_ENV[@]}" nvidia-cuda-mps-control 2>&1; }
# Our daemon's processes: named nvidia-cuda-mps*, rooted in our view.
ours() {
  local p
  for p in /proc/[0-9]*; do
    case $(cat "$p/comm" 2>/dev/null) in nvidia-cuda-mps*) ;; *) continue ;; esac
    [ "$(readlink "$p/root")" = "$VIEW" ] && echo "${p#/proc/}"
  done
}
mkdir -p "$VIEW$PIPE" "$VIEW$LOG"
control=$(chroot "$VIEW" /usr/bin/env -i "${ROOT_ENV[@]}" sh -c 'command -v nvidia-cuda-mps-control')
daemon=
if [ -z "$control" ]; then
  result mps-daemon "FAIL no nvidia-cuda-mps-control in the driver root"
else
  echo "  $control -d (pipe $PIPE, log $LOG, a private /dev/shm)"
  out=$(in_root "${MPS_ENV[@]}" "$control" -d 2>&1)
  echo "  -d: rc $? ${out}"
  for _ in $(seq 50); do [ -S "$VIEW$PIPE/control" ] && break; sleep 0.1; done
  # shellcheck disable=SC2012 # the modes and types of the pipe dir's entries are the point
  ls -l "$VIEW$PIPE" 2>&1 | sed 's/^/  pipe dir: /'
  daemon=$(ours | tr '\n' ' ')
  daemon=${daemon% }
  echo "  daemon processes: ${daemon:-none}"
  answers=()
  for cmd in "set_default_active_thread_percentage 50" get_default_active_thread_percentage \
    "set_default_device_pinned_mem_limit 0 2G" "get_default_device_pinned_mem_limit 0"; do
    a=$(mps "$cmd")
    answers+=("$a")
    echo "  $cmd -> ${a:-(nothing)}"
  done
  if [ "${answers[1]}" = 50.0 ] && [ "${answers[3]}" = 2G ]; then
    result mps-daemon "ok started; active thread percentage 50.0 and pinned memory limit 2G read back"
  else
    result mps-daemon "FAIL read back '${answers[1]}' and '${answers[3]}' (expected 50.0 and 2G)"
  fi
fi

client=
if [ -z "$daemon" ]; then
  result cuda-client "FAIL no MPS daemon to connect through"
elif [ -z "$CUDA_LIB" ]; then
  result cuda-client "FAIL no libcuda.so.1 in the driver root"
elif ! command -v "${CC:-cc}" >/dev/null; then
  result cuda-client "FAIL no C compiler (${CC:-cc}) to build e2e/realgpu/cuda_client.c"
elif ! "${CC:-cc}" -O2 -o "$VIEW/tmp/cuda_client" "$REPO/e2e/realgpu/cuda_client.c" -ldl 2>"$WORK/cc.err"; then
  result cuda-client "FAIL cc: $(tail -n1 "$WORK/cc.err")"
else
  client=/tmp/cuda_client
fi
if [ -n "$client" ]; then
  echo "  client: $client $CUDA_LIB (the root's libcuda, dlopen'ed by full path)"
  plain=$(in_root "$client" "$CUDA_LIB" 2>&1)
  plain_rc=$?
  echo "  without MPS (rc $plain_rc):"; indent <<<"$plain"
  shared=$(in_root "${MPS_ENV[@]}" "$client" "$CUDA_LIB" 2>&1)
  shared_rc=$?
  echo "  with the daemon's /dev/shm (rc $shared_rc):"; indent <<<"$shared"
  # shellcheck disable=SC2016 # $1 is the inner shell's
  apart=$(unshare -m --propagation private sh -c 'mount -t tmpfs -o mode=1777 shm "$1/dev/shm" && shift &&
    exec chroot "$@"' - "$VIEW" "$VIEW" /usr/bin/env -i "${ROOT_ENV[@]}" "${MPS_ENV[@]}" "$client" "$CUDA_LIB" 2>&1)
  apart_rc=$?
  echo "  with a /dev/shm of its own (rc $apart_rc):"; indent <<<"$apart"
  for f in control.log server.log; do
    [ -s "$VIEW$LOG/$f" ] && tail -n 4 "$VIEW$LOG/$f" | sed "s/^/  $f: /"
  done
  if [ $shared_rc -eq 0 ] && grep -q ' 805 ' <<<"$apart"; then
    result cuda-client "ok connected through MPS with the shared /dev/shm; 805 (MPS connection failed) without it"
  elif [ -n "$SIMULATED" ] && grep -q '^cuInit 100 ' <<<"$plain" && grep -q '^cuInit 805 ' <<<"$shared" &&
    grep -q '^cuInit 805 ' <<<"$apart"; then
    result cuda-client "ok the simulated node's answer: no kernel module, so NVIDIA's libcuda answers cuInit 100 (CUDA_ERROR_NO_DEVICE) alone and 805 through the daemon, which has no GPU for a server, with or without the shared /dev/shm: the /dev/shm difference is only seen on a GPU"
  else
    result cuda-client "FAIL with the shared /dev/shm: $(tail -n1 <<<"$shared"); without: $(tail -n1 <<<"$apart") (expected success, then 805)"
  fi
fi
if [ -n "$daemon" ]; then
  echo "  quit -> $(mps quit)"
  for _ in $(seq 100); do
    stale=$(ours | tr '\n' ' ')
    for pid in $daemon; do [ -e "/proc/$pid" ] && stale="$stale $pid"; done
    [ -z "${stale// /}" ] && break
    sleep 0.1
  done
  stale=$(tr ' ' '\n' <<<"$stale" | sort -u | tr '\n' ' ')
  stale=${stale# }
  if [ -n "$stale" ]; then
    echo "  still running after quit: $stale; killed"
    for pid in $stale; do kill -9 "$pid" 2>/dev/null; done
    result mps-quit "FAIL the daemon's processes outlived quit: $stale"
  else
    echo "  after quit: no MPS process of this check left"
  fi
fi
exit 0
