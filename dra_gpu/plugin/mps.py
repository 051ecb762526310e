"""MPS control daemons, one per claim (or per group of a claim's devices), started by the plugin.

The daemon is the driver installation's own `nvidia-cuda-mps-control`, `CUDA_VISIBLE_DEVICES`
set to the group's UUIDs. Limits go in through its command interface (one command per stdin line
of a client `nvidia-cuda-mps-control`), and a daemon counts as ready only once it answers there.
Where it runs:
- a plugin in a pod (the chart) runs each daemon as a pod of its own (`mps_pods`): it outlives the
  plugin's restarts, upgrades and OOM kills, and the plugin adopts it again from the checkpoint;
- a plugin run as a process of the node (by hand, the tests' host plugin) starts it with `-d`,
  detached from the plugin, so that it too outlives a restart of the plugin's process.
It runs with the driver's `libcuda.so.1` preloaded by full path and the driver's MPS binaries
first on `PATH` (it starts `nvidia-cuda-mps-server`), never with a driver library directory on
`LD_LIBRARY_PATH` (`driver_programs` says why).

A claim's containers are hostile, so nothing they can write is trusted:
- Each daemon has its own tmpfs at `<plugin dir>/mps/<id>/` (`shm_size`, default half the node's
  memory as the kernel gives a tmpfs: a PyTorch data loader's batches go through `/dev/shm`, and a
  page is charged to the cgroup of whoever writes it, so the size is a cap, not a reservation; a
  tenant that fills its `/dev/shm` fills only that), holding `pipe/` and `log/` (the daemon's own,
  never mounted into a container), `shm/` (the daemon's and the containers' `/dev/shm`, see
  `mps_namespace` and `mps_pods`) and `client/`: the containers' read-only
  `CUDA_MPS_PIPE_DIRECTORY`, holding only a hard link to the daemon's `control` socket.
- `pipe/` and `log/` are world-writable (sticky): the daemon starts each client's server as the
  client's user, and a server of a non-root pod must make its files there (measured with NVIDIA's
  535 binaries: with 0700 directories a uid-1000 client's server exits at once, again and again).
  No container reaches them. NVIDIA's daemon also listens on
  `control_privileged` (root only; without it both versions refuse `quit` and 550 any change),
  and writes its pid file (550) and a log FIFO there: a container reaches none of them.
- The plugin never reads a pid file: a daemon's processes are found in `/proc`, matched on the
  pipe directory in their environment, their program and their root (the plugin's own, not a
  container's), and signalled through a pidfd opened before the match is re-checked (a reused pid
  is never signalled).
- Before a (re)start the daemon's directories are emptied without following or opening anything
  in them (a tenant may swap in a FIFO or a link at any moment);
  at stop the tmpfs is unmounted and its mount point removed.
- The limits are read back after every start and at every `check` (each prepare of the claim, the
  plugin's start and each sweep): a 535 daemon lets any root client change them through `control`,
  so a drift is reported and set again.

Without CAP_SYS_ADMIN (an unprivileged simulated node, unit tests as a user) the tmpfs and the
daemon's own mount namespace are skipped, and the plugin says so once.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import secrets
import select
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tenacity import (
    RetryError,
    retry,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_fixed,
)

from dra_gpu.plugin.driver_programs import DriverProgram, DriverProgramError

log = logging.getLogger(__name__)

CONTROL_BINARY = "nvidia-cuda-mps-control"
SERVER_BINARY = "nvidia-cuda-mps-server"
CONTROL_SOCKET = "control"
NOT_RUNNING = "Cannot find MPS control daemon process"
CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"
CONTAINER_SHM_DIR = "/dev/shm"
PIPE_MOUNT_OPTIONS = ["ro", "nosuid", "nodev", "noexec", "rbind", "rprivate"]
SHM_MOUNT_OPTIONS = ["rw", "nosuid", "nodev", "noexec", "rbind", "rprivate"]
UNIX_PATH_MAX = 108
MIN_SHM_SIZE = 64 << 20  # the size container runtimes give /dev/shm by default
INODE_BYTES = 4096  # one inode per page of the tmpfs, as the kernel's default does
PROC_READ_LIMIT = 128 << 10  # bytes of a process's environ or cmdline read
MNT_DETACH = 2
CAP_SYS_ADMIN = 21


class MpsError(RuntimeError):
    """A daemon that cannot be started, configured or asked; the message says which and why."""


class DaemonPods(Protocol):
    """Where daemons run as pods of their own (dra_gpu.plugin.mps_pods.DaemonPods)."""

    def pod_name(self, daemon_id: str) -> str: ...

    def create(
        self, daemon_id: str, pipe_dir: str, shm_dir: str, binary: str, env: dict[str, str]
    ) -> str: ...

    def delete(self, daemon_id: str) -> None: ...

    def ids(self) -> set[str]: ...

    def describe(self, daemon_id: str) -> str: ...

    def running(self, daemon_id: str) -> bool: ...


@dataclass(frozen=True)
class MpsDaemon:
    """One control daemon as the checkpoint records it."""

    id: str  # "<claim uid>-<n>": its directory under the MPS root
    uuids: list[str]
    active_thread_percentage: int | None = None
    pinned_memory_limits: dict[str, str] = field(default_factory=dict)  # uuid -> "<MiB>M"
    share_id: str | None = None  # a memory share's daemon: one of several on its GPU

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "uuids": list(self.uuids)}
        if self.share_id is not None:
            d["shareId"] = self.share_id
        if self.active_thread_percentage is not None:
            d["activeThreadPercentage"] = self.active_thread_percentage
        if self.pinned_memory_limits:
            d["pinnedMemoryLimits"] = dict(self.pinned_memory_limits)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MpsDaemon:
        pct = d.get("activeThreadPercentage")
        return cls(
            id=str(d["id"]),
            uuids=[str(u) for u in d.get("uuids", [])],
            active_thread_percentage=int(pct) if pct is not None else None,
            pinned_memory_limits={str(k): str(v) for k, v in (d.get("pinnedMemoryLimits") or {}).items()},
            share_id=str(d["shareId"]) if d.get("shareId") else None,
        )

    def commands(self) -> list[str]:
        """The control commands that set this daemon's limits."""
        out = []
        if self.active_thread_percentage is not None:
            out.append(f"set_default_active_thread_percentage {self.active_thread_percentage}")
        for uuid, limit in sorted(self.pinned_memory_limits.items()):
            out.append(f"set_default_device_pinned_mem_limit {uuid} {limit}")
        return out


def pinned_limit(limit_bytes: int) -> str:
    """The control interface's form of a byte count: whole MiB with an `M` (at least 1)."""
    return f"{max(1, limit_bytes >> 20)}M"


class MpsDaemons:
    """Starts, checks and stops the daemons under `root` (`<plugin dir>/mps`)."""

    def __init__(
        self,
        root: Path,
        locate: Callable[[], DriverProgram],
        extra_env: dict[str, str] | None = None,
        ready_timeout: float = 5.0,
        command_timeout: float = 5.0,
        quit_timeout: float = 5.0,
        isolate: bool | None = None,
        shm_size: int | None = None,
        pods: DaemonPods | None = None,
        pod_ready_timeout: float = 60.0,
    ) -> None:
        self.root = root
        self.shm_size = max(MIN_SHM_SIZE, shm_size if shm_size else default_shm_size())
        self.pods = pods  # None: daemons are the plugin's detached processes
        self.pod_ready_timeout = pod_ready_timeout
        self.locate = locate  # the control binary and how it runs, found late
        self.extra_env = extra_env or {}  # e.g. a simulated node's device-node directory
        self.ready_timeout = ready_timeout
        self.command_timeout = command_timeout
        self.quit_timeout = quit_timeout
        # A tmpfs and a mount namespace per daemon need CAP_SYS_ADMIN.
        self.isolate = _has_cap_sys_admin() if isolate is None else isolate
        if isolate is None and not self.isolate:
            log.warning(
                "MPS daemons run without their own tmpfs and /dev/shm: no CAP_SYS_ADMIN root=%s", root
            )

    def daemon_dir(self, daemon_id: str) -> Path:
        return self.root / daemon_id

    def pipe_dir(self, daemon_id: str) -> Path:
        return self.root / daemon_id / "pipe"

    def log_dir(self, daemon_id: str) -> Path:
        return self.root / daemon_id / "log"

    def shm_dir(self, daemon_id: str) -> Path:
        return self.root / daemon_id / "shm"

    def client_dir(self, daemon_id: str) -> Path:
        return self.root / daemon_id / "client"

    def cdi_edits(self, daemon: MpsDaemon) -> tuple[dict[str, str], list[dict[str, Any]]]:
        """Env and mounts a client container needs: the client view of the pipe (read-only: the
        `control` socket only) and the daemon's /dev/shm."""
        env = {"CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE_DIR}
        mounts = [
            {
                "hostPath": str(self.client_dir(daemon.id)),
                "containerPath": CONTAINER_PIPE_DIR,
                "options": PIPE_MOUNT_OPTIONS,
            },
            {
                "hostPath": str(self.shm_dir(daemon.id)),
                "containerPath": CONTAINER_SHM_DIR,
                "options": SHM_MOUNT_OPTIONS,
            },
        ]
        return env, mounts

    def _env(self, program: DriverProgram, daemon_id: str, uuids: list[str] | None = None) -> dict[str, str]:
        try:
            env = program.env(os.environ.get("PATH", "/usr/bin:/bin"))
        except DriverProgramError as exc:
            raise MpsError(f"MPS daemon {daemon_id}: {CONTROL_BINARY}: {exc}") from exc
        env.update(self.extra_env)
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe_dir(daemon_id))
        env["CUDA_MPS_LOG_DIRECTORY"] = str(self.log_dir(daemon_id))
        if uuids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(uuids)
        return env

    def _program(self) -> tuple[Path, DriverProgram]:
        program = self.locate()
        if program.binary is None:
            raise MpsError(f"{CONTROL_BINARY} not found in the driver installation")
        return program.binary, program

    def control(self, daemon_id: str, commands: list[str]) -> str:
        """Send commands through the daemon's pipe; its answers. MpsError when it is not there."""
        if not self.pipe_dir(daemon_id).is_dir():
            raise MpsError(f"MPS daemon {daemon_id}: no pipe directory")
        binary, program = self._program()
        try:
            proc = subprocess.run(
                [str(binary)],
                input="".join(f"{c}\n" for c in commands),
                env=self._env(program, daemon_id),
                capture_output=True,
                text=True,
                timeout=self.command_timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise MpsError(f"MPS daemon {daemon_id}: no answer within {self.command_timeout}s") from exc
        except OSError as exc:
            raise MpsError(f"MPS daemon {daemon_id}: cannot run {CONTROL_BINARY}: {exc}") from exc
        if proc.returncode != 0 or NOT_RUNNING in proc.stdout:
            said = (proc.stdout + proc.stderr).strip() or f"exit {proc.returncode}"
            raise MpsError(f"MPS daemon {daemon_id}: {said}")
        return proc.stdout

    def answers(self, daemon_id: str) -> bool:
        """True when the daemon answers on its pipe."""
        try:
            out = self.control(daemon_id, ["get_default_active_thread_percentage"])
        except MpsError:
            return False
        try:
            float(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return False
        return True

    def alive(self, daemon_id: str) -> bool:
        """Whether the daemon's program still runs (its pod's container, or its process), whether
        or not it answers."""
        if self.pods is not None:
            return self.pods.running(daemon_id)
        return self.pid(daemon_id) is not None

    def pid(self, daemon_id: str) -> int | None:
        """The control daemon's pid, from /proc (never from a file in its directories). `-d` forks
        the daemon off the program the plugin ran, so it is looked up after a start and after a
        plugin restart alike."""
        found = [pid for pid, kind in self.processes(daemon_id) if kind == CONTROL_BINARY]
        return found[0] if found else None

    def processes(self, daemon_id: str) -> list[tuple[int, str]]:
        """(pid, program) of every control daemon and server of `daemon_id` in /proc."""
        pipe = str(self.pipe_dir(daemon_id))
        found = []
        with contextlib.suppress(OSError):
            for entry in os.scandir("/proc"):
                if entry.name.isdigit():
                    kind = _identify(int(entry.name), pipe)
                    if kind is not None:
                        found.append((int(entry.name), kind))
        return sorted(found)

    def start(self, daemon: MpsDaemon) -> str:
        """Start the daemon (or keep the one that answers), set its limits; where it runs (its pod
        or its pid) once it answers with them."""
        pipe = self.pipe_dir(daemon.id)
        if len(str(pipe / "control_privileged")) >= UNIX_PATH_MAX:
            raise MpsError(f"MPS pipe directory {pipe} is too long for a UNIX socket path")
        fresh = not self.answers(daemon.id)
        if fresh:
            if self.pods is not None:
                self.pods.delete(daemon.id)  # a wedged or ended one, its container stopped first
            else:
                self._kill(daemon.id, self.processes(daemon.id))  # a wedged one
            self._fresh_dirs(daemon.id)  # client/ emptied: no tenant reaches the new daemon yet
            binary, program = self._program()
            env = self._env(program, daemon.id, daemon.uuids)
            if self.pods is not None:
                self.pods.create(daemon.id, str(pipe), str(self.shm_dir(daemon.id)), str(binary), env)
            else:
                self._spawn(daemon.id, binary, env)
            self._wait_ready(daemon.id)
        commands = daemon.commands()
        if commands:
            self.control(daemon.id, commands)
        drift = self.drift(daemon)
        if drift:
            raise MpsError(f"MPS daemon {daemon.id}: {drift[0]}")
        # Only now the claim's containers see the daemon: none of their clients ever reaches it
        # before its limits are set.
        if fresh:
            self._link_client(daemon.id)
        elif not os.path.lexists(self.client_dir(daemon.id) / CONTROL_SOCKET):
            # A daemon of an earlier release (one directory for all): its containers' views made.
            self.shm_dir(daemon.id).mkdir(mode=0o1777, exist_ok=True)
            self.client_dir(daemon.id).mkdir(mode=0o755, exist_ok=True)
            self._link_client(daemon.id)
        where = self._where(daemon.id)
        log.info("MPS daemon ready id=%s %s devices=%s", daemon.id, where, ",".join(daemon.uuids))
        return where

    def _where(self, daemon_id: str) -> str:
        if self.pods is not None:
            return f"pod={self.pods.pod_name(daemon_id)}"
        pid = self.pid(daemon_id)
        if pid is None:
            raise MpsError(f"MPS daemon {daemon_id}: answers, but no {CONTROL_BINARY} process of it in /proc")
        return f"pid={pid}"

    def _spawn(self, daemon_id: str, binary: Path, env: dict[str, str]) -> None:
        """`-d`: the daemon forks off the program run here and lives on as the node's process."""
        argv = [str(binary), "-d"]
        if self.isolate:
            preload = env.pop("LD_PRELOAD", "")
            argv = [
                sys.executable,
                "-m",
                "dra_gpu.plugin.mps_namespace",
                str(self.shm_dir(daemon_id)),
                preload,
                *argv,
            ]
        try:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=self.command_timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(f"MPS daemon {daemon_id}: {CONTROL_BINARY} -d failed: {exc}") from exc
        if proc.returncode != 0:
            said = (proc.stdout + proc.stderr).strip()
            raise MpsError(f"MPS daemon {daemon_id}: {CONTROL_BINARY} -d exited {proc.returncode}: {said}")

    def _fresh_dirs(self, daemon_id: str) -> None:
        """The daemon's tmpfs (mounted if it is not) with its directories emptied: nothing of an
        earlier daemon, nor anything a container left in `shm/`, is kept. The directories
        themselves stay: running containers of the claim hold bind mounts of `client/` and `shm/`."""
        top = self.daemon_dir(daemon_id)
        top.mkdir(parents=True, exist_ok=True)
        if self.isolate and not os.path.ismount(top):
            _mount_tmpfs(top, self.shm_size)
        for sub, mode in (("pipe", 0o1777), ("log", 0o1777), ("client", 0o755), ("shm", 0o1777)):
            path = top / sub
            with contextlib.suppress(FileExistsError):
                path.mkdir()
            _empty(path)
            os.chmod(path, mode, follow_symlinks=False)

    def _link_client(self, daemon_id: str) -> None:
        """The containers' view: a hard link to the daemon's `control` socket, nothing else."""
        sock = self.pipe_dir(daemon_id) / CONTROL_SOCKET
        if not stat.S_ISSOCK(os.lstat(sock).st_mode):
            raise MpsError(f"MPS daemon {daemon_id}: {sock} is not a socket")
        client = self.client_dir(daemon_id)
        _empty(client)
        os.link(sock, client / CONTROL_SOCKET, follow_symlinks=False)

    def _wait_ready(self, daemon_id: str) -> None:
        timeout = self.ready_timeout if self.pods is None else self.pod_ready_timeout

        @retry(
            retry=retry_if_result(lambda ok: not ok),
            wait=wait_fixed(0.02) if self.pods is None else wait_exponential(multiplier=0.02, max=0.5),
            stop=stop_after_delay(timeout),
        )
        def poll() -> bool:
            return self.answers(daemon_id)

        try:
            poll()
        except RetryError as exc:
            where = f"log: {self.log_dir(daemon_id)}"
            if self.pods is not None:
                where = self.pods.describe(daemon_id)
            raise MpsError(
                f"MPS daemon {daemon_id}: not answering on {self.pipe_dir(daemon_id)} "
                f"within {timeout:g}s ({where})"
            ) from exc

    def drift(self, daemon: MpsDaemon) -> list[str]:
        """The limits the daemon answers differently from what was set, one line each. An answer
        in a form not understood here is logged, not a drift (driver versions word it differently;
        without a GPU a UUID does not resolve and a pinned-memory limit reads back empty). One
        command per client: an unanswered command would shift the answers after it."""
        asks: list[tuple[str, float]] = []  # (command, expected value: percent or MiB)
        if daemon.active_thread_percentage is not None:
            asks.append(("get_default_active_thread_percentage", float(daemon.active_thread_percentage)))
        for uuid, limit in sorted(daemon.pinned_memory_limits.items()):
            asks.append((f"get_default_device_pinned_mem_limit {uuid}", _mib(limit) or 0.0))
        drift = []
        for ask, want in asks:
            lines = self.control(daemon.id, [ask]).strip().splitlines()
            got = lines[-1].strip() if lines else ""
            value = float(got) if _is_number(got) else _mib(got)
            if value is None:
                log.warning(
                    "MPS daemon answer not understood id=%s command=%r answer=%r", daemon.id, ask, got
                )
            elif value != want:
                drift.append(f"{ask} answered {got!r}, expected {want:g}")
        return drift

    def check(self, daemon: MpsDaemon) -> list[str]:
        """A running daemon's limits as set: a drift (a root client of a 535 daemon can change
        them) is logged, set again and read back; the drift found, empty when none."""
        drift = self.drift(daemon)
        if not drift:
            return []
        log.warning("MPS daemon limits changed behind the plugin, set again id=%s drift=%r", daemon.id, drift)
        self.control(daemon.id, daemon.commands())
        still = self.drift(daemon)
        if still:
            raise MpsError(f"MPS daemon {daemon.id}: limits cannot be restored: {still[0]}")
        return drift

    def stop(self, daemon_id: str) -> None:
        """Stop the daemon (quit, then SIGKILL to what lingers, by pidfd), unmount its tmpfs and
        remove its directory. Bounded: quit_timeout plus 2 s at most after the quit."""
        if self.pods is not None:
            if self.answers(daemon_id):
                with contextlib.suppress(MpsError):
                    self.control(daemon_id, ["quit"])
            self.pods.delete(daemon_id)
        else:
            procs = self.processes(daemon_id)
            if procs and self.answers(daemon_id):
                with contextlib.suppress(MpsError):
                    self.control(daemon_id, ["quit"])
            self._kill(daemon_id, procs)
        self._remove(daemon_id)
        log.info("MPS daemon stopped id=%s", daemon_id)

    def _kill(self, daemon_id: str, procs: list[tuple[int, str]]) -> None:
        """Wait up to quit_timeout for `procs` to end, then SIGKILL those left, each through a
        pidfd opened while the process still was this daemon's."""
        pipe = str(self.pipe_dir(daemon_id))
        fds = []
        for pid, _ in procs:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue  # gone
            if _identify(pid, pipe) is None:  # gone and the pid reused before the open
                os.close(fd)
                continue
            fds.append((pid, fd))
        try:
            left = _wait_exit(fds, self.quit_timeout)
            for pid, fd in left:
                log.warning("MPS daemon process did not quit, killing it id=%s pid=%d", daemon_id, pid)
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            for pid, _ in _wait_exit(left, 2.0):
                log.error("MPS daemon process still there after SIGKILL id=%s pid=%d", daemon_id, pid)
        finally:
            for _, fd in fds:
                os.close(fd)

    def _remove(self, daemon_id: str) -> None:
        top = self.daemon_dir(daemon_id)
        if os.path.ismount(top):
            _umount(top)
        if not os.path.lexists(top):
            return
        # Not shutil.rmtree: without the tmpfs, shm/ under it is a tenant's (see _empty).
        try:
            _empty(top)
            os.rmdir(top)
        except (MpsError, OSError) as exc:
            log.warning("MPS daemon directory not removed id=%s: %s", daemon_id, exc)

    def owned(self) -> list[str]:
        """Ids of every daemon directory under the root and every daemon pod of this node (the
        reconciliation's view)."""
        found = {p.name for p in self.root.iterdir() if p.is_dir()} if self.root.is_dir() else set()
        if self.pods is not None:
            found |= self.pods.ids()
        return sorted(found)


def read_proc(pid: int | str, name: str) -> bytes:
    """A /proc file of `pid`, at most PROC_READ_LIMIT bytes."""
    fd = os.open(f"/proc/{pid}/{name}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.read(fd, PROC_READ_LIMIT)
    finally:
        os.close(fd)


def _identify(pid: int, pipe: str) -> str | None:
    """CONTROL_BINARY or SERVER_BINARY when `pid` is a live control daemon (`-d`) or server
    started with `pipe` as its pipe directory and rooted where this process is (a container's
    process that copies the environment has another root); None for anything else."""
    try:
        if not read_proc(pid, "comm").startswith(b"nvidia-cuda-mps"):
            return None
        state = read_proc(pid, "stat").rsplit(b")", 1)[-1].split()[:1]
        if state == [b"Z"]:
            return None
        theirs, ours = os.stat(f"/proc/{pid}/root"), os.stat("/")
        if (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino):
            return None
        exe = os.path.basename(os.readlink(f"/proc/{pid}/exe")).removesuffix(" (deleted)")
        environ = read_proc(pid, "environ").split(b"\0")
        argv = read_proc(pid, "cmdline").split(b"\0")
    except (OSError, ValueError):
        return None
    if f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode() not in environ:
        return None
    if exe == SERVER_BINARY:
        return SERVER_BINARY
    if exe == CONTROL_BINARY and b"-d" in argv[1:]:
        return CONTROL_BINARY
    return None


def _wait_exit(fds: list[tuple[int, int]], timeout: float) -> list[tuple[int, int]]:
    """Those of (pid, pidfd) still running after `timeout` seconds (a pidfd polls readable when
    its process ends)."""
    left = list(fds)
    poller = select.poll()
    for _, fd in left:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    while left:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        done = {fd for fd, _ in poller.poll(remaining * 1000)}
        for fd in done:
            poller.unregister(fd)
        left = [(pid, fd) for pid, fd in left if fd not in done]
    return left


# A tenant may swap any entry of a directory `_empty` clears (for a FIFO, a link, a directory) at
# any moment, so nothing there is ever opened except as a directory, with O_NOFOLLOW (a link
# fails ELOOP), O_DIRECTORY (anything else fails ENOTDIR before its open runs) and O_NONBLOCK.
# shutil.rmtree is not used: it opens what lstat called a directory with O_RDONLY alone, and a
# FIFO swapped in between hangs that open.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# What a swap under our feet makes a call fail with; the entry is tried again on the next pass.
_RACE_ERRNOS = frozenset(
    {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENOTEMPTY, errno.EEXIST}
)
EMPTY_PASSES = 8  # passes over a directory a tenant keeps writing to before giving up
EMPTY_TIMEOUT = 10.0  # seconds, all passes together
EMPTY_MAX_DEPTH = 32  # deeper directories are moved up to the top, so open fds stay bounded


class _Emptier:
    """Removes everything under one open directory, without following or opening anything but
    directories (opened as above)."""

    def __init__(self, top: int, directory: Path) -> None:
        self.top = top
        self.directory = directory
        self.hoisted: list[str] = []
        self.deadline = time.monotonic() + EMPTY_TIMEOUT

    def run(self) -> None:
        @retry(
            retry=retry_if_result(bool),
            wait=wait_exponential(multiplier=0.005, max=0.2),
            stop=stop_after_attempt(EMPTY_PASSES) | stop_after_delay(EMPTY_TIMEOUT),
        )
        def one_pass() -> list[str]:
            for name in self._names(self.top):
                self._remove(self.top, name, 0)
            while self.hoisted and time.monotonic() < self.deadline:
                self._remove(self.top, self.hoisted.pop(), 0)
            return self._names(self.top)

        try:
            one_pass()
        except RetryError as exc:
            left = exc.last_attempt.result()
            raise MpsError(
                f"cannot empty {self.directory}: {len(left)} entries (e.g. {left[0]!r}) still there "
                f"after {EMPTY_PASSES} passes or {EMPTY_TIMEOUT:g}s; something keeps writing there"
            ) from None

    def _names(self, fd: int) -> list[str]:
        try:
            with os.scandir(fd) as entries:
                return [e.name for e in entries]
        except OSError as exc:
            raise MpsError(f"cannot empty {self.directory}: cannot list it: {exc.strerror}") from exc

    def _remove(self, dfd: int, name: str, depth: int) -> None:
        """One try at removing `name`: unlink (any non-directory), else rmdir, else empty it and
        rmdir. A race leaves it for the next pass; any other error is an MpsError."""
        try:
            try:
                os.unlink(name, dir_fd=dfd)
                return
            except IsADirectoryError:
                pass
            try:
                os.rmdir(name, dir_fd=dfd)
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
            if depth >= EMPTY_MAX_DEPTH:
                # Moved to the top and removed from there: depth costs no more open fds.
                hoisted = f".dra-gpu-empty-{secrets.token_hex(8)}"
                os.rename(name, hoisted, src_dir_fd=dfd, dst_dir_fd=self.top)
                self.hoisted.append(hoisted)
                return
            fd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    return
                for child in self._names(fd):
                    self._remove(fd, child, depth + 1)
            finally:
                os.close(fd)
            os.rmdir(name, dir_fd=dfd)
        except OSError as exc:
            if exc.errno not in _RACE_ERRNOS:
                raise MpsError(f"cannot empty {self.directory}: {name!r}: {exc.strerror}") from exc


def _empty(directory: Path) -> None:
    """Remove everything in `directory`, following and opening nothing a container may have put
    there (see _Emptier); an MpsError naming it when that cannot be done."""
    try:
        top = os.open(directory, _DIR_FLAGS)
    except OSError as exc:
        raise MpsError(f"cannot empty {directory}: cannot open it as a directory: {exc.strerror}") from exc
    try:
        _Emptier(top, directory).run()
    finally:
        os.close(top)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def default_shm_size() -> int:
    """Half the node's memory: the kernel's own default size of a tmpfs."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError):
        return MIN_SHM_SIZE


def _mount_tmpfs(path: Path, size: int) -> None:
    options = f"size={size},nr_inodes={max(4096, size // INODE_BYTES)},mode=0755".encode()
    flags = 0x2 | 0x4 | 0x8  # MS_NOSUID | MS_NODEV | MS_NOEXEC
    if _libc().mount(b"tmpfs", os.fsencode(path), b"tmpfs", flags, options) != 0:
        err = ctypes.get_errno()
        raise MpsError(f"cannot mount a tmpfs on {path}: {os.strerror(err)}")


def _umount(path: Path) -> None:
    if _libc().umount2(os.fsencode(path), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # not a mount point (any more)
            raise OSError(err, f"cannot unmount {path}: {os.strerror(err)}")


def _has_cap_sys_admin() -> bool:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except (OSError, ValueError):
        pass
    return False


_MEMORY = re.compile(r"^(\d+(?:\.\d+)?)\s*([MG])i?B?$", re.IGNORECASE)


def _mib(s: str) -> float | None:
    """'10240M', '10G', '10 GB' -> MiB; None for anything else."""
    m = _MEMORY.match(s.strip())
    if not m:
        return None
    return float(m.group(1)) * (1024 if m.group(2).upper() == "G" else 1)


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True
