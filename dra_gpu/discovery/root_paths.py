"""Paths inside a driver root, resolved as the root's own filesystem would resolve them.

A driver root is another filesystem mounted into the plugin (`/`, `/run/nvidia/driver`, a host
directory): its symlinks are the host's. Debian's alternatives make absolute ones
(`usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1 -> /etc/alternatives/... -> /usr/lib/.../nvidia/current/...`)
that name paths of the root, not of the plugin's own filesystem. `os.path.realpath` would follow
them into the plugin's image; this module follows each link inside the root and never leaves it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

MAX_LINKS = 40  # as the kernel's ELOOP limit: a longer chain is a loop


class RootPathError(OSError):
    """A path that cannot be resolved inside its root (a loop, or too many links)."""


def resolve_in_root(root: Path, relative: str | PurePosixPath) -> PurePosixPath | None:
    """The root-relative path `relative` names once every symlink is followed inside `root`
    (absolute targets are taken from `root`, `..` stops at it), or None when nothing is there.

    Raises RootPathError for a link loop.
    """
    pending = list(PurePosixPath("/", relative).parts[1:])
    resolved: list[str] = []
    links = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = root.joinpath(*resolved, part)
        try:
            st = os.lstat(candidate)
        except OSError:
            return None
        if not stat.S_ISLNK(st.st_mode):
            resolved.append(part)
            continue
        links += 1
        if links > MAX_LINKS:
            raise RootPathError(f"too many symbolic links under {root} resolving /{relative}")
        target = PurePosixPath(os.readlink(candidate))
        if target.is_absolute():
            resolved = []
            pending = list(target.parts[1:]) + pending
        else:
            pending = list(target.parts) + pending
    return PurePosixPath(*resolved) if resolved else PurePosixPath(".")


def regular_file_in_root(root: Path, relative: str | PurePosixPath) -> Path | None:
    """The regular file `relative` names inside `root` (links followed inside it), as a path this
    process can open, or None."""
    try:
        found = resolve_in_root(root, relative)
    except RootPathError:
        return None
    if found is None:
        return None
    path = root / found
    try:
        return path if stat.S_ISREG(os.lstat(path).st_mode) else None
    except OSError:
        return None
