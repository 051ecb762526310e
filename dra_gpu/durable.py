"""Crash-safe file writes: a reader sees the old content or the new one, never a mix."""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from dra_gpu import failpoints

# A temp file's name: "." + the target's name + "." + mkstemp's 8 random characters + ".tmp".
TEMP_SUFFIX = ".tmp"
_TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.[a-z0-9_]{8}" + re.escape(TEMP_SUFFIX) + "$")


def atomic_write(path: Path, data: bytes, mode: int = 0o600, failpoint: str | None = None) -> None:
    """Write `data` to `path` atomically and durably.

    Temp file in the same directory, fsync, rename over the target, fsync the directory, so a
    crash at any point leaves either the old file or the new one (and, between the temp file and
    the rename, the temp file: `remove_stale_temps`). `failpoint` is hit between the two.
    """
    tmp = synced_temp(path, data, mode)
    try:
        if failpoint is not None:
            failpoints.hit(failpoint)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def synced_temp(path: Path, data: bytes, mode: int = 0o600) -> str:
    """A temp file beside `path` (its directory made if missing) holding `data` with `mode`,
    fsynced: what a rename over `path` makes durable. Nothing is left when it fails."""
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
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp


def temp_target(name: str) -> str | None:
    """The name of the file a temp file named `name` was made for by `synced_temp`; None when
    `name` is not such a temp file's name."""
    m = _TEMP_NAME.match(name)
    return m["target"] if m else None


def remove_stale_temps(directory: Path, owns: Callable[[str], bool]) -> list[Path]:
    """Remove the temp files that `synced_temp` left in `directory` for the targets `owns`
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


def remove_durably(path: Path) -> bool:
    """Remove `path` (if present) and fsync its directory. True when something was removed."""
    try:
        path.unlink()
    except (FileNotFoundError, NotADirectoryError):
        return False
    fsync_dir(path.parent)
    return True


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
