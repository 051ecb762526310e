"""File writes a reader sees whole: the old content or the new one, never a mix.

Every state file is replaced atomically (a temp file in the same directory, renamed over the
target), so neither a crash of the plugin nor a reader racing the write ever sees half a file.
Durability (fsync of the file and of its directory) is a separate choice, made per file by the
caller's choice of function: a process crash (SIGKILL, OOM) loses nothing that is not fsynced,
because the kernel's page cache outlives the process; only a power loss or a kernel crash does,
and an fsync is worth its cost (~0.3-0.5 ms a write on an SSD, more on a busy disk) only for a
file whose content must outlive one.

Per file (writer: function; must it outlive a power loss? why):

    checkpoint.json         plugin.checkpoint:      no. Its records are scoped to the boot: a
      (plugin dir)          replace_atomically      file of another boot is discarded at start
                                                    (devices, MIG instances, MPS daemons and
                                                    compute modes are gone; the kubelet
                                                    prepares its claims again).
    claim CDI specs         plugin.journal,         no. /var/run/cdi is a tmpfs on real nodes;
      (--cdi-dir)           plugin.write_rounds     in a persistent --cdi-dir a spec a power
                            (durable=False):        loss left behind has no record of this
                            replace_atomically,     boot, and the start-up reconcile removes it
                            remove_file             before the plugin serves.
    device metadata files   plugin.journal,         no. Made from their claim's record and
      and their CDI specs   plugin.write_rounds     scoped to the boot like it: the start-up
      (plugin dir, --cdi-   (durable=False)         reconcile removes what no record of this
      dir; KEP-5304)                                boot owns, and writes what one lacks.
    health-taints.json      health.taint_book:      yes. Operator-forced taints never expire
      (plugin dir)          replace_durably         and a hold-down must not end early: a
                                                    reboot must not put a device taken out
                                                    back into service.
    checkpoint.json.boot    plugin.checkpoint:      yes, written once per boot. It tells a
      (plugin dir)          replace_durably         checkpoint a power loss tore (not fsynced)
                                                    from one corrupted in this boot (rebuilt).
    MPS daemon state        none                    no file of the plugin's: a daemon's pipe,
                                                    log and shm directories (its own tmpfs on
                                                    a node) are the daemon's and die with it;
                                                    what the plugin must know of a daemon is
                                                    in its claim's checkpoint record.
    simulated GPU state     simnode:                no. A GPU's MIG instances and compute
      (simnode)             replace_atomically      modes do not survive a power loss either.

A removal is not fsynced either where the file need not be durable: a removal a power loss undoes
brings back a file of another boot, which the next start removes again.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from dra_gpu.common import failpoints

# A temp file's name: "." + the target's name + "." + mkstemp's 8 random characters + ".tmp".
TEMP_SUFFIX = ".tmp"
_TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.[a-z0-9_]{8}" + re.escape(TEMP_SUFFIX) + "$")


def replace_atomically(path: Path, data: bytes, mode: int = 0o600, failpoint: str | None = None) -> None:
    """Replace `path` with `data` through a temp file renamed over it, without fsync: a crash of
    the process at any point leaves the old file or the new one (and, between the temp file and
    the rename, the temp file: `remove_stale_temps`); a power loss may leave either, or a torn
    file. For files whose content need not outlive a power loss (the table above). `failpoint`
    is hit between the temp file and the rename."""
    _replace(path, data, mode, failpoint, durable=False)


def replace_durably(path: Path, data: bytes, mode: int = 0o600, failpoint: str | None = None) -> None:
    """`replace_atomically`, and the temp file fsynced before the rename and the directory after
    it, so that a power loss too leaves the old file or the new one, whole."""
    _replace(path, data, mode, failpoint, durable=True)


def _replace(path: Path, data: bytes, mode: int, failpoint: str | None, durable: bool) -> None:
    tmp = write_temp(path, data, mode, durable=durable)
    try:
        if failpoint is not None:
            failpoints.hit(failpoint)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def write_temp(path: Path, data: bytes, mode: int = 0o600, *, durable: bool) -> str:
    """A temp file beside `path` (its directory made if missing) holding `data` with `mode`,
    fsynced when `durable`: what a rename over `path` puts in place. Nothing is left when it
    fails."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    except FileNotFoundError:  # the directory is made on the first write into it
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            if durable:
                os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp


def temp_target(name: str) -> str | None:
    """The name of the file a temp file named `name` was made for by `write_temp`; None when
    `name` is not such a temp file's name."""
    m = _TEMP_NAME.match(name)
    return m["target"] if m else None


def remove_stale_temps(directory: Path, owns: Callable[[str], bool]) -> list[Path]:
    """Remove the temp files that `write_temp` left in `directory` for the targets `owns`
    accepts (by name): a process killed between making one and its rename leaves it behind, and
    nothing else ever removes it. Only regular files of that naming are touched, never another
    program's. Call it when no write into `directory` can be under way (the plugin's start,
    before it serves). Not fsynced: a removal lost to a power cut is done again at the next start.
    Returns what was removed."""
    removed = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for entry in entries:
        target = temp_target(entry.name)
        if target is None or not owns(target):
            continue
        try:
            if not stat.S_ISREG(entry.stat(follow_symlinks=False).st_mode):
                continue
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        removed.append(Path(entry.path))
    return removed


def remove_file(path: Path) -> bool:
    """Remove `path` (if present), not fsynced. True when something was removed."""
    try:
        path.unlink()
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def fsync_dir(directory: Path) -> None:
    """Make the renames and removals in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
