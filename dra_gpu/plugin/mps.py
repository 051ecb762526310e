"""MPS control daemons, one per claim (or per group of a claim's devices), run on the host.

The daemon is the driver installation's own `nvidia-cuda-mps-control -d`, started with its own
pipe and log directories under `<plugin dir>/mps/<id>/`, `CUDA_VISIBLE_DEVICES` set to the
group's UUIDs. Limits go in through its command interface (one command per stdin line of a client
`nvidia-cuda-mps-control`), and a daemon counts as ready only once it answers there. `-d` puts the
daemon in the background, detached from the plugin, so it outlives a plugin restart and is
re-adopted from the checkpoint; `stop` asks it to `quit` and kills it only when it will not.
The daemon runs with the driver's `libcuda.so.1` preloaded by full path and the driver's MPS
binaries first on `PATH` (it starts `nvidia-cuda-mps-server`), never with a driver library
directory on `LD_LIBRARY_PATH` (`driver_programs` says why).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenacity import RetryError, retry, retry_if_result, stop_after_delay, wait_fixed

from dra_gpu.plugin.driver_programs import DriverProgram, DriverProgramError

log = logging.getLogger(__name__)

CONTROL_BINARY = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
NOT_RUNNING = "Cannot find MPS control daemon process"
CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"
MOUNT_OPTIONS = ["rw", "nosuid", "nodev", "rbind", "rprivate"]
UNIX_PATH_MAX = 108


class MpsError(RuntimeError):
    """A daemon that cannot be started, configured or asked; the message says which and why."""


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
    ) -> None:
        self.root = root
        self.locate = locate  # the control binary and how it runs, found late
        self.extra_env = extra_env or {}  # e.g. a simulated node's device-node directory
        self.ready_timeout = ready_timeout
        self.command_timeout = command_timeout

    def pipe_dir(self, daemon_id: str) -> Path:
        return self.root / daemon_id / "pipe"

    def log_dir(self, daemon_id: str) -> Path:
        return self.root / daemon_id / "log"

    def cdi_edits(self, daemon: MpsDaemon) -> tuple[dict[str, str], list[dict[str, Any]]]:
        """Env and mounts a client container needs: the daemon's pipe dir at the usual path."""
        env = {"CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE_DIR}
        mount = {
            "hostPath": str(self.pipe_dir(daemon.id)),
            "containerPath": CONTAINER_PIPE_DIR,
            "options": MOUNT_OPTIONS,
        }
        return env, [mount]

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

    def pid(self, daemon_id: str) -> int | None:
        try:
            return int((self.pipe_dir(daemon_id) / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return None

    def start(self, daemon: MpsDaemon) -> int:
        """Start the daemon (or keep the one that answers), set its limits, return its pid once it
        answers with them."""
        pipe, logs = self.pipe_dir(daemon.id), self.log_dir(daemon.id)
        if len(str(pipe / "control")) >= UNIX_PATH_MAX:
            raise MpsError(f"MPS pipe directory {pipe} is too long for a UNIX socket path")
        if not self.answers(daemon.id):
            pipe.mkdir(parents=True, exist_ok=True)
            logs.mkdir(parents=True, exist_ok=True)
            binary, program = self._program()
            try:
                proc = subprocess.run(
                    [str(binary), "-d"],
                    env=self._env(program, daemon.id, daemon.uuids),
                    capture_output=True,
                    text=True,
                    timeout=self.command_timeout,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise MpsError(f"MPS daemon {daemon.id}: {CONTROL_BINARY} -d failed: {exc}") from exc
            if proc.returncode != 0:
                said = (proc.stdout + proc.stderr).strip()
                raise MpsError(
                    f"MPS daemon {daemon.id}: {CONTROL_BINARY} -d exited {proc.returncode}: {said}"
                )
            self._wait_ready(daemon.id)
        commands = daemon.commands()
        if commands:
            self.control(daemon.id, commands)
        self._check_limits(daemon)
        pid = self.pid(daemon.id)
        if pid is None:
            raise MpsError(f"MPS daemon {daemon.id}: no {PID_FILE} in {pipe}")
        log.info("MPS daemon ready id=%s pid=%d devices=%s", daemon.id, pid, ",".join(daemon.uuids))
        return pid

    def _wait_ready(self, daemon_id: str) -> None:
        @retry(
            retry=retry_if_result(lambda ok: not ok),
            wait=wait_fixed(0.02),
            stop=stop_after_delay(self.ready_timeout),
        )
        def poll() -> bool:
            return self.answers(daemon_id)

        try:
            poll()
        except RetryError as exc:
            raise MpsError(
                f"MPS daemon {daemon_id}: not answering on {self.pipe_dir(daemon_id)} "
                f"within {self.ready_timeout}s (log: {self.log_dir(daemon_id)})"
            ) from exc

    def _check_limits(self, daemon: MpsDaemon) -> None:
        """Ask the daemon back for what was set: a limit it answers differently is an error. An
        answer in a form not understood here is logged, not fatal (driver versions word it
        differently); one command per line, so answers are matched by position."""
        asks: list[tuple[str, float]] = []  # (command, expected value: percent or MiB)
        if daemon.active_thread_percentage is not None:
            asks.append(("get_default_active_thread_percentage", float(daemon.active_thread_percentage)))
        for uuid, limit in sorted(daemon.pinned_memory_limits.items()):
            asks.append((f"get_default_device_pinned_mem_limit {uuid}", _mib(limit) or 0.0))
        if not asks:
            return
        answers = self.control(daemon.id, [ask for ask, _ in asks]).splitlines()
        for i, (ask, want) in enumerate(asks):
            got = answers[i].strip() if i < len(answers) else ""
            value = float(got) if _is_number(got) else _mib(got)
            if value is None:
                log.warning(
                    "MPS daemon answer not understood id=%s command=%r answer=%r", daemon.id, ask, got
                )
            elif value != want:
                raise MpsError(f"MPS daemon {daemon.id}: {ask} answered {got!r}, expected {want:g}")

    def stop(self, daemon_id: str) -> None:
        """Stop the daemon (quit, then SIGKILL if it lingers) and remove its directories."""
        pid = self.pid(daemon_id)
        if self.answers(daemon_id):
            with contextlib.suppress(MpsError):
                self.control(daemon_id, ["quit"])
        if pid is not None and not self._wait_gone(pid):
            log.warning("MPS daemon did not quit, killing it id=%s pid=%d", daemon_id, pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._wait_gone(pid)
        shutil.rmtree(self.root / daemon_id, ignore_errors=True)
        log.info("MPS daemon stopped id=%s", daemon_id)

    def _wait_gone(self, pid: int) -> bool:
        @retry(retry=retry_if_result(lambda alive: alive), wait=wait_fixed(0.02), stop=stop_after_delay(2))
        def alive() -> bool:
            return _is_daemon(pid)

        try:
            alive()
        except RetryError:
            return False
        return True

    def owned(self) -> list[str]:
        """Ids of every daemon directory under the root (the reconciliation's view)."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())


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


def _is_daemon(pid: int) -> bool:
    """True while `pid` is a live (not zombie) nvidia-cuda-mps-control process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else "?"
    return state != "Z" and CONTROL_BINARY.startswith(comm)
