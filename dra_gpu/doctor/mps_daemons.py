"""doctor's MPS check: the daemons running on the node against the claims that need them.

The checkpoint says which daemons the plugin started (each MPS claim's `sharing.mps` entries, with
their limits); /proc says which run (a control daemon, `-d` or `-f` in its own pod, whose pipe
directory, in its environment, is under the plugin's MPS root: doctor may run on the host or in the
plugin's pod, so the process's root is not compared), and where /proc cannot show it (doctor in the
plugin's pod, the daemon in a pod of its own with the host's PID namespace) a daemon that answers on
its pipe runs; the daemon answers its limits through the same command
interface the plugin uses (`dra_gpu.plugin.mps`, so that "wrong limits" means what the plugin's
own check means). Problems: orphans (a daemon or directory no claim records), missing daemons (a
prepared claim's daemon not running) and limits other than the claim's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dra_gpu.doctor.report import Result, fail, ok
from dra_gpu.plugin.driver_files import DriverFiles
from dra_gpu.plugin.driver_programs import program_locator
from dra_gpu.plugin.mps import CONTROL_BINARY, MpsDaemon, MpsDaemons, MpsError, read_proc

NAME = "node/mps-daemons"
FIX = (
    "orphans: restart the plugin (its start-up stops daemons no claim records); a missing daemon or "
    "changed limits: the plugin restarts it and sets the limits again at its next sweep "
    "(kubeletPlugin.sweepInterval) or the claim's next prepare; restart the plugin to do it now"
)


def node_daemons(plugin_dir: Path, driver_root: Path, driver_version: str | None) -> MpsDaemons:
    """The plugin's daemons as doctor asks them: the driver root's control program, never started here."""
    files = DriverFiles(driver_root, driver_version)
    return MpsDaemons(plugin_dir / "mps", program_locator(files, CONTROL_BINARY), isolate=False)


def recorded_daemons(claims: dict[str, Any]) -> dict[str, tuple[str, MpsDaemon, bool]]:
    """Daemon id -> (claim, its record, whether the claim is prepared) from the checkpoint's claims."""
    out = {}
    for entry in claims.values():
        if not isinstance(entry, dict):
            continue
        ref = f"{entry.get('namespace', '?')}/{entry.get('name', '?')}"
        for d in (entry.get("sharing") or {}).get("mps") or []:
            if isinstance(d, dict) and d.get("id"):
                daemon = MpsDaemon.from_dict(d)
                out[daemon.id] = (ref, daemon, entry.get("state") == "completed")
    return out


def running_daemons(mps_root: Path) -> dict[str, int]:
    """Daemon id -> pid of every MPS control daemon whose pipe directory is under `mps_root`."""
    prefix = f"CUDA_MPS_PIPE_DIRECTORY={mps_root}/".encode()
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if not read_proc(entry.name, "comm").startswith(b"nvidia-cuda-mps"):
                continue
            argv = read_proc(entry.name, "cmdline").split(b"\0")
            env = read_proc(entry.name, "environ").split(b"\0")
            state = read_proc(entry.name, "stat").rsplit(b")", 1)[-1].split()[:1]
        except OSError:
            continue
        pipe = next((e[len(prefix) :] for e in env if e.startswith(prefix)), None)
        foreground_or_detached = b"-d" in argv[1:] or b"-f" in argv[1:]
        if pipe and state != [b"Z"] and foreground_or_detached and argv[0].endswith(CONTROL_BINARY.encode()):
            found[pipe.decode(errors="replace").split("/")[0]] = int(entry.name)
    return found


def check(
    claims: dict[str, Any], daemons: MpsDaemons, running: Callable[[Path], dict[str, int]] = running_daemons
) -> Result:
    recorded = recorded_daemons(claims)
    live = running(daemons.root)
    problems = []
    for daemon_id in sorted((set(live) | set(daemons.owned())) - set(recorded)):
        pid = f"pid {live[daemon_id]}" if daemon_id in live else "not running"
        problems.append(f"orphan daemon {daemon_id} ({pid}): no claim records it")
    for daemon_id, (ref, daemon, prepared) in sorted(recorded.items()):
        if daemon_id not in live and not daemons.answers(daemon_id):
            if prepared:
                problems.append(f"claim {ref}: its MPS daemon {daemon_id} is not running")
            continue
        try:
            drift = daemons.drift(daemon)
        except MpsError as exc:
            drift = [str(exc)]
        if drift:
            problems.append(f"claim {ref}: daemon {daemon_id}: {'; '.join(drift)}")
    if problems:
        return fail(NAME, "; ".join(problems), FIX)
    if not recorded:
        return ok(NAME, "no claim needs an MPS daemon; none running")
    return ok(NAME, f"{len(recorded)} MPS daemons, one for each daemon a claim records, limits as set")
