"""Issue 26's MPS attacks, each from a root container of a real pod against NVIDIA's real MPS daemon
(both Debian versions, 535.261.03 and 550.163.01, under the chart's real-node DaemonSet: see
test_real_mps.py), each shown to fail:

- another claim's daemon pid written as the tenant's pid file: no other claim's process dies;
- a FIFO planted as the pid file: unprepare does not hang (bounded, asserted);
- a link planted in the directories, then `quit` through the tenant's own socket (refused by both
  versions; the daemon is then killed, as in a crash): its restart changes no file outside the
  daemon's directory, and nothing planted stays in it;
- the privileged control socket and the tenant's own limits: the socket is not in the container,
  and a limit changed through `control` (the 535 daemon lets any root client do it; 550 refuses)
  is set again by the plugin within a sweep;
- filling the directories: the pipe view is read-only, /dev/shm is bounded by the daemon's tmpfs.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from support import container_process, exec_in, never, wait_for
from test_driver_userspace import DEBIAN_IMAGE, glibc_images, gpu_pod  # noqa: F401 - a fixture
from test_kubelet_plugin import PLUGIN_DIR, template
from test_real_mps import (  # noqa: F401 - real_mps is a fixture
    MPS_ROOT,
    PID_FILE,
    SWEEP_S,
    daemons,
    mps_config,
    real_mps,
)
from test_real_node import finish, running_log

pytestmark = pytest.mark.e2e

TMPFS_BYTES = 64 << 20
UNPREPARE_BOUND_S = 30.0


class Pair:
    """A victim claim's pod and a tenant claim's pod, each with its own MPS daemon."""

    def __init__(self, core, dyn, namespace):
        self.core, self.namespace = core, namespace
        before = daemons()
        template(dyn, namespace, "victim", config=mps_config(30))
        gpu_pod(core, namespace, "victim", DEBIAN_IMAGE, "echo done; sleep 3600", template="victim")
        running_log(core, namespace, "victim")
        ((self.victim_id, self.victim_pid),) = wait_for(
            "the victim's daemon", lambda: {k: v for k, v in daemons().items() if k not in before}
        ).items()
        before = daemons()
        template(dyn, namespace, "tenant", config=mps_config(25))
        gpu_pod(core, namespace, "tenant", DEBIAN_IMAGE, "echo done; sleep 3600", template="tenant")
        running_log(core, namespace, "tenant")
        ((self.tenant_id, self.tenant_pid),) = wait_for(
            "the tenant's daemon", lambda: {k: v for k, v in daemons().items() if k not in before}
        ).items()
        self.tenant_cid = container_process(core.read_namespaced_pod("tenant", namespace))["cid"]

    def tenant(self, script: str) -> str:
        """Run `script` as root in the tenant's container; its output (whatever its status)."""
        return exec_in(self.tenant_cid, "sh", "-c", f"{{ {script} ; }} 2>&1; true")

    def end_tenant(self) -> float:
        """Delete the tenant's pod; seconds until its claim was unprepared (its daemon's directory
        gone), failing past UNPREPARE_BOUND_S."""
        t0 = time.time()
        self.core.delete_namespaced_pod("tenant", self.namespace, grace_period_seconds=0)
        wait_for(
            "the tenant's claim to be unprepared",
            lambda: not (MPS_ROOT / self.tenant_id).exists(),
            timeout=UNPREPARE_BOUND_S,
            interval=0.2,
        )
        return time.time() - t0


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_another_claims_pid_in_the_pid_file_kills_nothing(
    real_mps,  # noqa: F811 - the fixture imported above
    core,
    dyn,
    namespace,
):
    pair = Pair(core, dyn, namespace)
    try:
        said = pair.tenant(
            f"echo {pair.victim_pid} > /tmp/nvidia-mps/{PID_FILE}; echo pipe rc=$?; "
            f"echo {pair.victim_pid} > /dev/shm/{PID_FILE}; echo shm rc=$?"
        )
        took = pair.end_tenant()
        print(
            f"\n[isolation] {real_mps.version}: pid file attack: {said!r}; tenant unprepared in {took:.1f} s"
        )

        def victim_hit() -> str | None:
            if not alive(pair.victim_pid):
                return f"the victim's daemon {pair.victim_pid} died"
            now = daemons().get(pair.victim_id)
            return None if now == pair.victim_pid else f"the victim's daemon is now {now}"

        # The unprepare's own kill is over once the tenant's directory is gone (the plugin removes
        # it last); after that only the plugin's sweep acts on daemons, every SWEEP_S here, and its
        # kill is a SIGKILL, which ends a process at once. A window of two sweeps, watched
        # throughout, covers one whole sweep after the answer.
        never("the victim's daemon to be hit after the tenant's unprepare", victim_hit, window=2 * SWEEP_S)
        assert real_mps.ask(pair.victim_id, "get_default_active_thread_percentage") == ["30.0"]
    finally:
        finish(core, dyn, namespace)


def test_a_fifo_as_the_pid_file_does_not_hang_unprepare(
    real_mps,  # noqa: F811 - the fixture imported above
    core,
    dyn,
    namespace,
):
    pair = Pair(core, dyn, namespace)
    try:
        said = pair.tenant(
            f"rm -f /tmp/nvidia-mps/{PID_FILE}; mkfifo /tmp/nvidia-mps/{PID_FILE}; echo pipe rc=$?; "
            f"mkfifo /dev/shm/{PID_FILE}; echo shm rc=$?"
        )
        took = pair.end_tenant()
        print(f"\n[isolation] {real_mps.version}: FIFO attack: {said!r}; tenant unprepared in {took:.1f} s")
        assert took < UNPREPARE_BOUND_S
        assert not any(p == pair.tenant_pid for p in daemons().values()) and not alive(pair.tenant_pid)
    finally:
        finish(core, dyn, namespace)


def test_a_planted_link_and_quit_change_no_file_outside_the_directory(
    real_mps,  # noqa: F811 - the fixture imported above
    core,
    dyn,
    namespace,
):
    pair = Pair(core, dyn, namespace)
    sentinel = PLUGIN_DIR / f"isolation-sentinel-{namespace}"
    sentinel.write_text("untouched\n")
    before = sentinel.stat()
    try:
        said = pair.tenant(
            f"ln -s {sentinel} /tmp/nvidia-mps/{PID_FILE}; echo pipe rc=$?; "
            f"ln -s {sentinel} /dev/shm/{PID_FILE}; ln -s {sentinel} /dev/shm/control.log; echo shm rc=$?; "
            "echo quit | nvidia-cuda-mps-control; echo quit rc=$?"
        )
        # Both versions refuse a quit without the privileged socket. The daemon ends anyway here
        # (as in a crash), so that the plugin's next sweep starts it again among the planted links.
        deadline = time.time() + 5  # only for the report: whether the daemon obeyed
        while alive(pair.tenant_pid) and time.time() < deadline:
            time.sleep(0.2)
        quit_taken = not alive(pair.tenant_pid)
        if not quit_taken:
            os.kill(pair.tenant_pid, signal.SIGKILL)
        wait_for("the tenant's daemon to end", lambda: daemons().get(pair.tenant_id) != pair.tenant_pid)
        new_pid = wait_for(
            "the tenant's daemon to answer again",
            lambda: daemons().get(pair.tenant_id),
            timeout=SWEEP_S * 5 + 20,
        )
        # The tenant sees it (its control socket in the client view) only once its limits are set.
        wait_for(
            "the tenant's view of the new daemon",
            lambda: (MPS_ROOT / pair.tenant_id / "client" / "control").exists(),
            timeout=30,
        )
        answers = real_mps.ask(pair.tenant_id, "get_default_active_thread_percentage")
        print(
            f"\n[isolation] {real_mps.version}: link + quit: {said!r}; daemon {pair.tenant_pid} -> {new_pid} "
            f"(quit {'obeyed' if quit_taken else 'refused, then killed'}); answers {answers}"
        )
        assert sentinel.read_text() == "untouched\n" and sentinel.stat().st_mtime_ns == before.st_mtime_ns
        top = MPS_ROOT / pair.tenant_id
        # Where the daemon writes files by name (its /dev/shm is the tenant's own: glibc's shm_open
        # follows no link there).
        dirs = [top / d for d in ("pipe", "log", "client") if (top / d).is_dir()]
        planted = [p for d in dirs for p in d.iterdir() if p.is_symlink()]
        assert not planted, f"links planted by the tenant are in the daemon's directories: {planted}"
        assert new_pid != pair.tenant_pid and not list((top / "shm").iterdir())  # emptied at the restart
        assert answers == ["25.0"], answers
    finally:
        finish(core, dyn, namespace)
        sentinel.unlink(missing_ok=True)


def test_the_privileged_socket_is_out_of_reach_and_limits_stay_as_set(
    real_mps,  # noqa: F811 - the fixture imported above
    core,
    dyn,
    namespace,
):
    pair = Pair(core, dyn, namespace)
    try:
        listing = pair.tenant("ls -A /tmp/nvidia-mps")
        said = pair.tenant(
            "echo set_default_active_thread_percentage 100 | nvidia-cuda-mps-control; "
            "echo get_default_active_thread_percentage | nvidia-cuda-mps-control"
        )
        print(f"\n[isolation] {real_mps.version}: the tenant sees {listing!r}; set 100 -> {said!r}")
        assert listing == "control", listing  # no control_privileged, no pid file, no log FIFO
        t0 = time.time()
        wait_for(
            "the tenant's limit as the claim set it",
            lambda: real_mps.ask(pair.tenant_id, "get_default_active_thread_percentage") == ["25.0"],
            timeout=SWEEP_S * 5 + 20,
            interval=0.5,
        )
        if "100.0" in said.splitlines():  # the 535 daemon took it: the plugin saw the drift and set it back
            assert f"limits changed behind the plugin, set again id={pair.tenant_id}" in real_mps.plugin_log()
            print(f"[isolation] {real_mps.version}: changed limit set back within {time.time() - t0:.1f} s")
        else:
            assert "Insufficient privileges" in said, said
        assert real_mps.ask(pair.victim_id, "get_default_active_thread_percentage") == ["30.0"]
    finally:
        finish(core, dyn, namespace)


def test_filling_the_directories_is_bounded_by_the_tmpfs(
    real_mps,  # noqa: F811 - the fixture imported above
    core,
    dyn,
    namespace,
):
    pair = Pair(core, dyn, namespace)
    try:
        said = pair.tenant(
            "dd if=/dev/zero of=/tmp/nvidia-mps/fill bs=1M count=100; echo pipe rc=$?; "
            "dd if=/dev/zero of=/dev/shm/fill bs=1M count=100; echo shm rc=$?"
        )
        top = MPS_ROOT / pair.tenant_id
        fs = os.statvfs(top)
        used = (fs.f_blocks - fs.f_bfree) * fs.f_frsize
        print(
            f"\n[isolation] {real_mps.version}: fill: {said!r}; "
            f"tmpfs {fs.f_blocks * fs.f_frsize >> 20} MiB, used {used >> 20} MiB"
        )
        assert "pipe rc=0" not in said and "shm rc=0" not in said, said
        assert fs.f_blocks * fs.f_frsize == TMPFS_BYTES and used <= TMPFS_BYTES
        assert not (top / "client" / "fill").exists()
        # The victim's daemon, on its own tmpfs, still answers.
        assert real_mps.ask(pair.victim_id, "get_default_active_thread_percentage") == ["30.0"]
    finally:
        finish(core, dyn, namespace)
