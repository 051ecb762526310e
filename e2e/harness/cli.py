"""A single-node Kubernetes cluster from upstream programs, for dra-gpu's e2e tests.

    e2e/cluster build | up | down | status | env | images | restart-kubelet
                | peer-driver start [--kube-api-qps Q] [--kube-api-burst B] | peer-driver stop
                | apiserver stop|start | restart-containerd | node stop|start

Everything (certs, kubeconfigs, configs, data, logs, pids) lives under the state dir
$DRA_GPU_E2E_STATE (default /var/lib/dra-gpu-e2e). Binaries come from e2e/node/build.sh's cache
(${DRA_GPU_CACHE:-$HOME/.cache/dra-gpu}/bin). Must run as root. See e2e/README.md.
"""

import fcntl
import functools
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO

from . import cleanup, components
from .certs import kubeconfig, make_pki
from .config import (
    ADMIN_KUBECONFIG,
    BIN_CTRD,
    BIN_K8S,
    BIN_KUBELET,
    CACHE,
    CDI_DIRS,
    CLUSTER_VERSIONS,
    CTRD_SOCK,
    DRA_GATES,
    E2E_DIR,
    KUBE_VERSION,
    KUBELET_ROOT,
    KUBELET_VERSION,
    LOGS,
    NODE_NAME,
    ORDER,
    STATE,
)
from .processes import Fail, kubectl, log_tail, logfile, read_pid, run, running, say, stop_pid, write


def cmd_build() -> None:
    run(["bash", os.path.join(E2E_DIR, "node", "build.sh"), "all"])


def cmd_images() -> None:
    run([sys.executable, os.path.join(E2E_DIR, "node", "images.py"), os.path.join(CACHE, "images")])


def cmd_up() -> None:
    if os.geteuid() != 0:
        raise Fail("must run as root")
    pids = running()
    alive = [n for n in ORDER if pids[n]]
    if len(alive) == len(ORDER):
        say(f"already running (state {STATE}); nothing to do")
        return
    if alive:
        raise Fail(f"partly running ({', '.join(alive)}); run `e2e/cluster down` first")
    if not components.binaries_present():
        say(f"binaries missing under {CACHE}: building (e2e/node/build.sh)")
        cmd_build()
    else:
        run(["bash", os.path.join(E2E_DIR, "node", "build.sh"), "debs"])
    if KUBELET_VERSION != KUBE_VERSION and not os.access(os.path.join(BIN_KUBELET, "kubelet"), os.X_OK):
        say(f"kubelet {KUBELET_VERSION} missing: building it (version skew)")
        build = os.path.join(E2E_DIR, "node", "build.sh")
        run(["env", f"DRA_GPU_KUBE_VERSION={KUBELET_VERSION}", "bash", build, "kubernetes"])
    t0 = time.time()
    os.makedirs(STATE, exist_ok=True)
    # Later commands (restart-kubelet, env, a test's) use the same programs and gates.
    write(CLUSTER_VERSIONS, f"kube={KUBE_VERSION}\nkubelet={KUBELET_VERSION}\ngates={DRA_GATES}\n")
    say(f"Kubernetes {KUBE_VERSION} (kubelet {KUBELET_VERSION}), DRA gates: {DRA_GATES}")
    ip = components.node_ip()
    make_pki(ip)
    for user, f in (
        ("admin", "admin"),
        ("controller-manager", "controller-manager"),
        ("scheduler", "scheduler"),
        ("kubelet-client", "kubelet"),
    ):
        kubeconfig(os.path.join(STATE, f + ".kubeconfig"), user)
    components.write_cni()
    write(os.path.join(STATE, "node"), f"{NODE_NAME}\n{KUBELET_ROOT}\n{ip}\n")
    cleanup.wipe_old_cluster()
    # (component whose log tells what went wrong, what its step says when done, the step)
    steps: list[tuple[str, str, Callable[[], None]]] = [
        ("etcd", "etcd", components.start_etcd),
        ("kube-apiserver", "kube-apiserver", lambda: components.start_apiserver(ip)),
        ("containerd", "containerd", components.start_containerd),
        ("containerd", "images", components.import_images),
        ("kube-controller-manager", "kube-controller-manager", components.start_controller_manager),
        ("kube-scheduler", "kube-scheduler", components.start_scheduler),
        ("kubelet", "kubelet", lambda: components.start_kubelet(ip)),
    ]
    current = ""
    try:
        for component, done, step in steps:
            current = component
            s0 = time.time()
            step()
            say(f"{done:<24} ok ({time.time() - s0:.1f} s)")
    except (Fail, subprocess.CalledProcessError, OSError) as e:
        say(f"FAILED starting {current}: {e}")
        say(f"---- last lines of {logfile(current)} ----\n{log_tail(current)}")
        if os.environ.get("DRA_GPU_E2E_KEEP_ON_FAILURE") != "1":
            say("stopping what was started (set DRA_GPU_E2E_KEEP_ON_FAILURE=1 to keep it)")
            cleanup.down(quiet=True)
        raise Fail(f"cluster up failed at {current}") from e
    say(f"node {NODE_NAME} Ready in {time.time() - t0:.1f} s; logs in {LOGS}")
    say(f'use: eval "$({os.path.join(E2E_DIR, "cluster")} env)"')


def cmd_down() -> None:
    cleanup.down()


def cmd_status() -> int:
    pids = running()
    print(f"state dir: {STATE}")
    print(f"node:      {NODE_NAME} (kubelet root {KUBELET_ROOT})")
    for n, p in pids.items():
        if n == "peer-driver" and not p:
            continue
        print(f"{n:<24} {f'running, pid {p}' if p else 'not running':<22} log {logfile(n)}")
    if pids.get("kube-apiserver"):
        r = kubectl("get", "nodes", "-o", "wide", check=False)
        print(r.stdout.rstrip() or r.stderr.rstrip())
    return 0 if all(pids[n] for n in ORDER) else 3


def cmd_env() -> None:
    lines = {
        "KUBECONFIG": ADMIN_KUBECONFIG,
        "DRA_GPU_E2E_STATE": STATE,
        "DRA_GPU_E2E_NODE_NAME": NODE_NAME,
        "DRA_GPU_E2E_KUBELET_ROOT": KUBELET_ROOT,
        "DRA_GPU_E2E_CDI_DIRS": ":".join(CDI_DIRS),
        "CONTAINERD_ADDRESS": CTRD_SOCK,
        "CONTAINER_RUNTIME_ENDPOINT": "unix://" + CTRD_SOCK,
        "PATH": f"{BIN_K8S}:{BIN_CTRD}:$PATH",
        "DRA_GPU_KUBE_VERSION": KUBE_VERSION,
        "DRA_GPU_KUBELET_VERSION": KUBELET_VERSION,
        "DRA_GPU_E2E_DRA_GATES": DRA_GATES,
    }
    for k, v in lines.items():
        print(f'export {k}="{v}"')


def peer_client_limits(flags: list[str]) -> tuple[float | None, int | None] | None:
    """`--kube-api-qps Q` / `--kube-api-burst B` of `peer-driver start` (each also `=`-joined;
    `default` for client-go's own); unset: components' non-binding limits. None: not understood."""
    values: dict[str, str] = {}
    i = 0
    while i < len(flags):
        name, eq, value = flags[i].partition("=")
        if name not in ("--kube-api-qps", "--kube-api-burst") or name in values:
            return None
        if not eq:
            i += 1
            if i == len(flags):
                return None
            value = flags[i]
        values[name] = value
        i += 1
    try:
        qps_flag = values.get("--kube-api-qps")
        burst_flag = values.get("--kube-api-burst")
        qps = (
            components.PEER_KUBE_API_QPS
            if qps_flag is None
            else None
            if qps_flag == "default"
            else float(qps_flag)
        )
        burst = (
            components.PEER_KUBE_API_BURST
            if burst_flag is None
            else None
            if burst_flag == "default"
            else int(burst_flag)
        )
    except ValueError:
        return None
    return qps, burst


def cmd_peer_driver(
    action: str,
    kube_api_qps: float | None = components.PEER_KUBE_API_QPS,
    kube_api_burst: int | None = components.PEER_KUBE_API_BURST,
) -> None:
    """Upstream's DRA test driver (test/e2e/dra/test-driver) as a host-process kubelet plugin."""
    if action == "stop":
        pid = read_pid("peer-driver")
        if pid:
            stop_pid("peer-driver", pid)
        cleanup.clean_peer_cdi()
        return
    if read_pid("peer-driver"):
        say("peer driver already running")
        return
    components.start_peer_driver(kube_api_qps, kube_api_burst)


def cmd_restart_kubelet() -> None:
    """Stop the kubelet and start it again with the same configuration (as a node reboot of
    the kubelet alone would): it wipes the node's ResourceSlices and reloads its claims."""
    pid = read_pid("kubelet")
    if not pid:
        raise Fail("the kubelet is not running")
    stop_pid("kubelet", pid)
    components.start_kubelet(components.node_ip())
    say("kubelet restarted")


def cmd_apiserver(action: str) -> None:
    """Stop the kube-apiserver alone (an outage: etcd, the kubelet and the rest keep running),
    or start it again with the same configuration and wait until it is ready."""
    pid = read_pid("kube-apiserver")
    if action == "stop":
        if not pid:
            raise Fail("the kube-apiserver is not running")
        stop_pid("kube-apiserver", pid)
        say("kube-apiserver stopped")
        return
    if pid:
        say("kube-apiserver already running")
        return
    components.start_apiserver(components.node_ip())
    say("kube-apiserver started")


def cmd_restart_containerd() -> None:
    """Stop containerd and start it again; running containers keep running (their shims do)."""
    pid = read_pid("containerd")
    if not pid:
        raise Fail("containerd is not running")
    stop_pid("containerd", pid)
    components.start_containerd()
    say("containerd restarted")


def cmd_node(action: str) -> None:
    """A node reboot, in two halves so that a test can act while the node is down: `stop` is the
    power loss (cleanup.power_off_node: every container, containerd and the kubelet killed, what a
    real node keeps in tmpfs cleared), `start` the boot (containerd, then the kubelet, which starts
    the pods again). A kubelet plugin run as a host process is its owner's to stop and start."""
    if action == "stop":
        tmpfs = [d for d in CDI_DIRS if d.startswith(("/run/", "/var/run/"))]
        cleared = cleanup.power_off_node(tmpfs)
        say(f"node powered off; cleared {len(cleared)} entries: {', '.join(cleared[:6])}")
        return
    if read_pid("containerd") or read_pid("kubelet"):
        raise Fail("containerd or the kubelet is running: `node stop` first")
    components.start_containerd()
    components.start_kubelet(components.node_ip())
    say("node booted: containerd and the kubelet running")


_LOCK: IO[str] | None = None


def state_lock(timeout: float = 600) -> None:
    """Serialise up/down/peer-driver of one state dir between processes (held until exit)."""
    global _LOCK
    os.makedirs(STATE, exist_ok=True)
    _LOCK = open(os.path.join(STATE, ".lock"), "w")  # noqa: SIM115 - held until the process exits
    t0 = time.time()
    while True:
        try:
            fcntl.flock(_LOCK, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.time() - t0 > timeout:
                raise Fail(f"another e2e/cluster command holds {STATE}/.lock") from None
            time.sleep(0.5)


COMMANDS: dict[str, Callable[[], int | None]] = {
    "build": cmd_build,
    "up": cmd_up,
    "down": cmd_down,
    "status": cmd_status,
    "restart-kubelet": cmd_restart_kubelet,
    "restart-containerd": cmd_restart_containerd,
    "env": cmd_env,
    "images": cmd_images,
}
# commands that hold the state lock
LOCKED = ("up", "down", "peer-driver", "restart-kubelet", "restart-containerd", "apiserver", "node")


def main(argv: list[str]) -> int:
    """`e2e/cluster COMMAND [ACTION]` (argv[0] is the program); returns the exit status."""
    fn: Callable[[], int | None]
    limits = (
        peer_client_limits(argv[3:]) if len(argv) >= 3 and argv[1:3] == ["peer-driver", "start"] else None
    )
    if limits is not None:
        fn = functools.partial(cmd_peer_driver, "start", *limits)
    elif len(argv) == 3 and argv[1] == "peer-driver" and argv[2] == "stop":
        fn = functools.partial(cmd_peer_driver, "stop")
    elif len(argv) == 3 and argv[1] == "apiserver" and argv[2] in ("start", "stop"):
        fn = functools.partial(cmd_apiserver, argv[2])
    elif len(argv) == 3 and argv[1] == "node" and argv[2] in ("start", "stop"):
        fn = functools.partial(cmd_node, argv[2])
    elif len(argv) == 2 and argv[1] in COMMANDS:
        fn = COMMANDS[argv[1]]
    else:
        print((__doc__ or "").strip(), file=sys.stderr)
        return 2
    try:
        if argv[1] in LOCKED:
            state_lock()
        rc = fn()
    except Fail as e:
        say(str(e))
        return 1
    except subprocess.CalledProcessError as e:
        say(f"command failed: {' '.join(map(str, e.cmd))}")
        return 1
    return rc or 0
