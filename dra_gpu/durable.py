"""Crash-safe file writes: a reader sees the old content or the new one, never a mix."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write `data` to `path` atomically and durably.

    Temp file in the same directory, fsync, rename over the target, fsync the directory, so a
    crash at any point leaves either the old file or the new one.
    """
    tmp = synced_temp(path, data, mode)
    try:
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
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except FileNotFoundError:  # the directory is made on the first write into it
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
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
