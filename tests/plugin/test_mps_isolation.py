"""A claim's container against the plugin's MPS daemons, in process with the simulated daemon (the
e2e/tests/test_isolation.py runs the same attacks in real pods against NVIDIA's daemons): what a
tenant can write (its `/dev/shm`, and what a root process on the node could put in the daemon's
directories) never makes the plugin kill another claim's daemon, hang, follow a link, or keep
limits it did not set."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from pathlib import Path

import pytest

from dra_gpu.plugin.mps import INODE_BYTES, default_shm_size
from plugin.conftest import PluginCore, claim, gpu_names, prepare_claim
from plugin.test_sharing import alive, ask, daemon_of, mps_config, ref_of, uid

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the daemons' tmpfs needs root")

PID_FILE = "nvidia-cuda-mps-control.pid"


def two_claims(core: PluginCore) -> tuple[dict, dict]:
    g0, g1 = gpu_names(core)[:2]
    mine, theirs = (
        claim(uid(), [g0], config=mps_config(30, None)),
        claim(uid(), [g1], config=mps_config(60, None)),
    )
    for c in (mine, theirs):
        core.add(c)
        asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    return mine, theirs


def test_another_claims_pid_in_a_pid_file_kills_nothing_of_that_claim(core: PluginCore) -> None:
    mine, theirs = two_claims(core)
    client, _ = daemon_of(core, mine)
    _, their_pid = daemon_of(core, theirs)
    # Every place a pid file could be read from: the daemon's own pipe dir and the client view.
    for d in (Path(client), Path(client).parent / "pipe"):
        (d / PID_FILE).unlink(missing_ok=True)
        (d / PID_FILE).write_text(f"{their_pid}\n")
    asyncio.run(core.preparer.unprepare(ref_of(mine)))
    time.sleep(0.5)
    assert alive(their_pid), "unprepare of one claim killed another claim's daemon"
    assert ask(core, daemon_of(core, theirs)[0], "get_default_active_thread_percentage") == ["60.0"]


def test_a_fifo_as_the_pid_file_does_not_hang_unprepare(core: PluginCore) -> None:
    c = claim(uid(), gpu_names(core)[:1], config=mps_config(30, None))
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    client, pid = daemon_of(core, c)
    fifos = []
    for d in (Path(client), Path(client).parent / "pipe"):
        (d / PID_FILE).unlink(missing_ok=True)
        os.mkfifo(d / PID_FILE)
        fifos.append(d / PID_FILE)
    done = threading.Event()

    def unprepare() -> None:
        asyncio.run(core.preparer.unprepare(ref_of(c)))
        done.set()

    t0 = time.monotonic()
    worker = threading.Thread(target=unprepare, daemon=True)
    worker.start()
    finished = done.wait(20)
    if not finished:  # let a reader blocked on the FIFO go, so that the test process can end
        for f in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
    assert finished, "unprepare blocked on a FIFO planted as the pid file"
    print(f"\n[mps] unprepare with a FIFO as pid file: {time.monotonic() - t0:.2f} s")
    assert not alive(pid) and not Path(client).parent.exists()


def test_a_link_in_the_shm_dir_is_removed_not_followed_at_restart(core: PluginCore, tmp_path: Path) -> None:
    c = claim(uid(), gpu_names(core)[:1], config=mps_config(30, None))
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    client, pid = daemon_of(core, c)
    top = Path(client).parent
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (victim.parent / "dir").mkdir()
    (victim.parent / "dir" / "keep").write_text("untouched")
    os.symlink(victim, top / "shm" / "planted")
    os.symlink(victim.parent / "dir", top / "shm" / "planted-dir")
    os.kill(pid, 9)  # the daemon dies (a tenant's quit on 535): the next check restarts it
    asyncio.run(core.preparer.sweep(60))
    _, new_pid = daemon_of(core, c)
    assert new_pid != pid and alive(new_pid)
    assert os.listdir(top / "shm") == []
    assert victim.read_text() == "untouched" and (victim.parent / "dir" / "keep").read_text() == "untouched"


def test_limits_a_client_changes_are_set_again_by_the_sweep(core: PluginCore) -> None:
    c = claim(uid(), gpu_names(core)[:1], config=mps_config(30, None))
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    client, _ = daemon_of(core, c)
    assert (
        ask(core, client, "set_default_active_thread_percentage 100", "get_default_active_thread_percentage")[
            -1
        ]
        == "100.0"
    )
    asyncio.run(core.preparer.sweep(60))
    assert ask(core, client, "get_default_active_thread_percentage") == ["30.0"]


def test_the_daemon_directory_is_a_tmpfs_of_half_the_memory_by_default(core: PluginCore) -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    assert default_shm_size() == page * os.sysconf("SC_PHYS_PAGES") // 2
    c = claim(uid(), gpu_names(core)[:1], config=mps_config(30, None))
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    top = Path(daemon_of(core, c)[0]).parent
    fs = os.statvfs(top)
    assert fs.f_blocks * fs.f_frsize == -(-default_shm_size() // page) * page  # rounded up to pages
    # A server of a non-root client (the daemon starts it as the client's user) makes its files here.
    assert {oct(os.stat(top / d).st_mode & 0o7777) for d in ("pipe", "log")} == {"0o1777"}
    asyncio.run(core.preparer.unprepare(ref_of(c)))


def test_the_daemon_directory_is_a_bounded_tmpfs_and_gone_after_unprepare(core: PluginCore) -> None:
    size = 64 << 20
    assert core.preparer.sharing is not None
    core.preparer.sharing.mps.shm_size = size
    c = claim(uid(), gpu_names(core)[:1], config=mps_config(30, None))
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    client, _ = daemon_of(core, c)
    top = Path(client).parent
    assert os.path.ismount(top)
    fs = os.statvfs(top)
    assert fs.f_blocks * fs.f_frsize == size and fs.f_files == size // INODE_BYTES
    assert sorted(os.listdir(client)) == ["control"]  # no control_privileged, no pid file, no log
    with pytest.raises(OSError), open(top / "shm" / "fill", "wb") as f:
        for _ in range(size // (1 << 20) + 8):
            f.write(b"\0" * (1 << 20))
    asyncio.run(core.preparer.unprepare(ref_of(c)))
    assert not top.exists()
    assert str(top) not in Path("/proc/self/mounts").read_text()
