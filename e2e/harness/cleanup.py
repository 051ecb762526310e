"""Stopping what `up` started and wiping what an earlier cluster left.

`down` stops by pid (the peer driver and the kubelet, the containers through containerd, the
control plane and containerd, the shims of our containerd socket), then unmounts everything under
the kubelet root dir and the state dir, deletes the bridge and removes the empty kubepods cgroups.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import time

from .config import (
    BRIDGE,
    CDI_DIRS,
    CLUSTER_VERSIONS,
    CTRD_SOCK,
    DRIVER_NAME,
    KUBELET_ROOT,
    LOGS,
    PEER_CDI_DIR,
    PLUGIN_NAME,
    STATE,
)
from .processes import Fail, ctr, pidfile, read_pid, running, say, stop_pid


def shims() -> list[int]:
    """containerd shims serving our containerd (their argv names our socket)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"containerd-shim-runc-v2") and CTRD_SOCK.encode() in argv:
            out.append(int(d))
    return out


def unmount_under(*roots: str) -> list[str]:
    """Unmount everything at or below roots, deepest first; returns what is still mounted."""
    prefixes = [r.rstrip("/") + "/" for r in roots]
    for attempt in range(5):
        with open("/proc/self/mountinfo") as f:
            mps = [line.split()[4].replace("\\040", " ") for line in f]
        targets = sorted(
            {m for m in mps if any(m.startswith(r) or m + "/" == r for r in prefixes)}, key=len, reverse=True
        )
        if not targets or attempt == 4:
            return targets
        for m in targets:
            if subprocess.run(["umount", m], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", m], capture_output=True)
    return []


def remove_empty_cgroups() -> None:
    """The kubelet's kubepods cgroups (cgroupfs driver), once no process is left in them."""
    base = "/sys/fs/cgroup"
    try:
        hierarchies = [os.path.join(base, h) for h in os.listdir(base)]
    except OSError:
        return
    for h in [*hierarchies, base]:
        top = os.path.join(h, "kubepods")
        if not os.path.isdir(top):
            continue
        for root, dirs, _ in os.walk(top, topdown=False):
            for d in dirs:
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(root, d))
        with contextlib.suppress(OSError):
            os.rmdir(top)


def clean_peer_cdi() -> None:
    """CDI specs the peer driver leaves when it is stopped before its claims are unprepared."""
    with contextlib.suppress(OSError):
        for f in os.listdir(PEER_CDI_DIR):
            if f.startswith(PLUGIN_NAME + "-") and f.endswith(".json"):
                os.unlink(os.path.join(PEER_CDI_DIR, f))


def wipe_old_cluster() -> None:
    """Each `up` starts a fresh cluster: no objects, containers or pod dirs of an earlier one."""
    left = unmount_under(KUBELET_ROOT, STATE)
    if left:
        raise Fail(f"cannot unmount {', '.join(left[:5])}; not wiping the old state")
    for d in (
        os.path.join(STATE, "etcd"),
        os.path.join(STATE, "containerd", "root"),
        os.path.join(STATE, "containerd", "state"),
        os.path.join(STATE, "cni", "ipam"),
    ):
        shutil.rmtree(d, ignore_errors=True)
    # The kubelet's checkpoints (DRA manager state included) and pod dirs belong to the old
    # cluster; the plugin dirs are left for DRA plugins that may already be running.
    if os.path.isdir(KUBELET_ROOT):
        for entry in os.listdir(KUBELET_ROOT):
            if entry not in ("plugins", "plugins_registry"):
                path = os.path.join(KUBELET_ROOT, entry)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
    wipe_driver_node_state()


def cmdlines() -> list[bytes]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{d}/cmdline", "rb") as f:
                out.append(f.read())
    return out


def wipe_driver_node_state() -> None:
    """This driver's checkpoint, MPS dirs, device metadata and CDI specs belong to the old
    cluster's claims: a fresh node has none (an earlier run killed mid-test leaves them, and the
    tests count what is there). Left alone while a plugin of ours still runs on them."""
    plugin_dir = os.path.join(KUBELET_ROOT, "plugins", DRIVER_NAME)
    if any(b"kubelet-plugin" in c and plugin_dir.encode() in c for c in cmdlines()):
        say(f"a {DRIVER_NAME} kubelet plugin is running: its state in {plugin_dir} is left to it")
        return
    wiped = []
    if os.path.isdir(plugin_dir):
        for entry in os.listdir(plugin_dir):
            path = os.path.join(plugin_dir, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
            wiped.append(path)
    for d in CDI_DIRS:
        with contextlib.suppress(OSError):
            for f in os.listdir(d):
                # Its claims' specs and their device metadata's (KEP-5304).
                ours = f.startswith((f"k8s.{DRIVER_NAME}-", f"{DRIVER_NAME}_metadata_"))
                if ours and f.endswith(".json"):
                    os.unlink(os.path.join(d, f))
                    wiped.append(os.path.join(d, f))
    if wiped:
        say(f"removed {len(wiped)} entries of {DRIVER_NAME} an earlier cluster left: {', '.join(wiped[:4])}")


def node_pids() -> list[int]:
    """Every process of the node's pods: the members of the kubelet's kubepods cgroups (cgroupfs
    driver), each hierarchy of cgroup v1 or the one of v2."""
    base = "/sys/fs/cgroup"
    tops = [os.path.join(base, "kubepods")]
    with contextlib.suppress(OSError):
        tops += [os.path.join(base, h, "kubepods") for h in os.listdir(base)]
    pids: set[int] = set()
    for top in tops:
        for root, _, files in os.walk(top):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError), open(os.path.join(root, "cgroup.procs")) as f:
                    pids.update(int(x) for x in f.read().split())
    return sorted(pids)


def power_off_node(tmpfs_cdi_dirs: list[str]) -> list[str]:
    """What a power loss does to the node's half of the cluster (the control plane stands for other
    machines): the kubelet, containerd, the shims and every container die at once (SIGKILL, nothing
    cleans up), and what a real node keeps in tmpfs is gone: containerd's and runc's state
    (/run/containerd there, under the state dir here), every mount under the kubelet's root and
    containerd's dirs (the pods' volumes, their network namespaces, a plugin's tmpfs) and the files
    of the CDI dirs in tmpfs. The disk stays: containerd's root, the kubelet's root with its
    checkpoints, /etc/cdi. The kubelet plugin is not the harness's: its owner stops it. Returns
    what was cleared."""
    for name in ("kubelet", "containerd"):
        pid = read_pid(name)
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 15
    while time.time() < deadline:
        victims = node_pids() + shims()
        if not victims:
            break
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    else:
        raise Fail(f"processes of the node's pods survive SIGKILL: {victims[:10]}")
    containerd = os.path.join(STATE, "containerd")
    left = unmount_under(KUBELET_ROOT, containerd)
    if left:
        raise Fail(f"cannot unmount {', '.join(left[:5])}")
    cleared = []
    for d in (os.path.join(containerd, "state"), os.path.join(containerd, "runc")):
        shutil.rmtree(d, ignore_errors=True)
        cleared.append(d)
    for d in tmpfs_cdi_dirs:
        with contextlib.suppress(OSError):
            for f in os.listdir(d):
                os.unlink(os.path.join(d, f))
                cleared.append(os.path.join(d, f))
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)  # the CNI plugin makes it again
    remove_empty_cgroups()
    for name in ("kubelet", "containerd"):
        with contextlib.suppress(OSError):
            os.unlink(pidfile(name))
    return cleared


def down(quiet: bool = False) -> None:
    """Stop everything `up` (and `peer-driver start`) started, and clean up after it."""
    pids = running()
    if not quiet:
        say(f"stopping: {', '.join(n for n, p in pids.items() if p) or 'nothing running'}")
    # The peer driver and the kubelet first, then the containers (via containerd), then the rest.
    for name in ("peer-driver", "kubelet"):
        pid = pids.get(name)
        if pid:
            stop_pid(name, pid)
    if pids.get("peer-driver"):
        clean_peer_cdi()
    if pids.get("containerd"):
        r = ctr("-n", "k8s.io", "tasks", "ls", "-q", check=False)
        for task in r.stdout.split():
            ctr("-n", "k8s.io", "tasks", "kill", "-a", "-s", "SIGKILL", task, check=False)
        deadline = time.time() + 10
        for task in r.stdout.split():
            while time.time() < deadline:
                if ctr("-n", "k8s.io", "tasks", "delete", task, check=False).returncode == 0:
                    break
                time.sleep(0.2)
    for name in ("kube-scheduler", "kube-controller-manager", "containerd", "kube-apiserver", "etcd"):
        pid = pids.get(name)
        if pid:
            stop_pid(name, pid)
    for pid in shims():
        stop_pid("containerd-shim", pid, timeout=5)
    for n in list(pids):
        with contextlib.suppress(OSError):
            os.unlink(pidfile(n))
    with contextlib.suppress(OSError):  # the next `up` chooses its versions afresh
        os.unlink(CLUSTER_VERSIONS)
    unmount_under(KUBELET_ROOT, STATE)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
    remove_empty_cgroups()
    if not quiet:
        left = [n for n, p in running().items() if p] + [f"shim {p}" for p in shims()]
        say(f"left running: {', '.join(left) or 'nothing'}")
        say(f"logs kept in {LOGS} (remove the state dir to start afresh)")
