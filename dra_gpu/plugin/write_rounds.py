"""Atomic file changes of concurrent prepares, made together in rounds.

Each change is what `dra_gpu.common.durable` does one file at a time (a temp file, renamed over the
target, or the target unlinked), but every change queued while a round runs goes into the next
round: one worker-thread job per round. `durable` rounds also fsync each temp file and, once per
round, each directory touched (instead of once per file). A caller's change is made (and, when
durable, durable) when its await returns, and fails alone: its file's error is raised to it, the
other changes of the round stand.

Changes to one path are applied in the order they were queued. A write may ask for its missing
directories to be made with a mode of its own (`dir_mode`; otherwise `write_temp` makes them as the
umask says).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dra_gpu.common import failpoints
from dra_gpu.common.durable import fsync_dir, write_temp


@dataclass
class _Change:
    path: Path
    data: bytes | None  # None: remove the file
    mode: int
    done: asyncio.Future[bool]
    dir_mode: int | None = None  # its missing directories made with this mode first
    tree: bool = False  # a removal of a directory with all in it
    tmp: str | None = None
    error: BaseException | None = None
    removed: bool = False
    touched: bool = False  # renamed or unlinked: its directory needs its fsync (when durable)


class WriteRounds:
    def __init__(self, *, durable: bool, failpoint: str | None = None) -> None:
        """`durable`: whether the changes must outlive a power loss (fsyncs), see dra_gpu.common.durable."""
        self._durable = durable
        self._failpoint = failpoint  # hit in each round between its temp files and its renames
        self._queue: list[_Change] = []
        self._round: asyncio.Task[None] | None = None

    async def write(self, path: Path, data: bytes, mode: int = 0o600, dir_mode: int | None = None) -> None:
        """Replace `path` with `data`, atomically (and durably, when the rounds are); `dir_mode`:
        the mode of the directories to make if `path`'s are missing."""
        await self._queued(path, data, mode, dir_mode)

    async def write_all(
        self, files: Sequence[tuple[Path, bytes]], mode: int = 0o600, dir_mode: int | None = None
    ) -> list[BaseException | None]:
        """`write` each of `files`, queued together (one round unless one is under way); each
        one's error, or None, in order."""
        done = [self._queue_change(path, data, mode, dir_mode) for path, data in files]
        outcomes = await asyncio.gather(*(asyncio.shield(d) for d in done), return_exceptions=True)
        return [o if isinstance(o, BaseException) else None for o in outcomes]

    async def remove_all(
        self, files: Sequence[Path], trees: Sequence[Path] = ()
    ) -> list[BaseException | None]:
        """`remove` each of `files`, and each of `trees` with all it holds (links in it removed,
        never followed), queued together; each one's error, or None, in order (files, then trees)."""
        done = [self._queue_change(p, None, 0, None) for p in files]
        done += [self._queue_change(p, None, 0, None, tree=True) for p in trees]
        outcomes = await asyncio.gather(*(asyncio.shield(d) for d in done), return_exceptions=True)
        return [o if isinstance(o, BaseException) else None for o in outcomes]

    async def remove(self, path: Path) -> bool:
        """Remove `path` (durably, when the rounds are); False when there was nothing to remove."""
        return await self._queued(path, None, 0)

    async def _queued(self, path: Path, data: bytes | None, mode: int, dir_mode: int | None = None) -> bool:
        # Shielded: a caller cancelled mid-round must not cancel the others' round.
        return await asyncio.shield(self._queue_change(path, data, mode, dir_mode))

    def _queue_change(
        self, path: Path, data: bytes | None, mode: int, dir_mode: int | None, tree: bool = False
    ) -> asyncio.Future[bool]:
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue.append(_Change(path, data, mode, done, dir_mode, tree))
        if self._round is None:
            self._round = asyncio.create_task(self._rounds())
        return done

    async def _rounds(self) -> None:
        changes: list[_Change] = []
        try:
            while self._queue:
                changes, self._queue = self._queue, []
                try:
                    await asyncio.to_thread(self._apply, changes)
                except Exception as exc:  # the thread itself failed: nothing is known to be durable
                    for c in changes:
                        c.error = c.error or exc
                for c in changes:
                    if c.error is not None:
                        c.done.set_exception(c.error)
                    else:
                        c.done.set_result(c.removed)
                changes = []
        finally:
            self._round = None
            left, self._queue = [*changes, *self._queue], []
            for c in left:  # cancelled (the plugin stops): nobody is left waiting
                if not c.done.done():
                    c.done.set_exception(OSError(f"{c.path}: the plugin stopped before the change was made"))

    def _apply(self, changes: list[_Change]) -> None:
        """In a worker thread: temp files written (and synced), then renamed and unlinked in queue
        order, then (when durable) each directory touched synced once."""
        for c in changes:
            if c.data is not None:
                self._write_temp(c)
        if self._failpoint is not None:
            try:
                failpoints.hit(self._failpoint)
            except BaseException:
                for c in changes:
                    self._discard_temp(c)
                raise
        for c in changes:
            if c.error is not None:
                continue
            try:
                if c.tmp is not None:
                    os.replace(c.tmp, c.path)
                    c.tmp = None
                    c.touched = True
                elif c.tree and os.path.isdir(c.path) and not os.path.islink(c.path):
                    shutil.rmtree(c.path)
                    c.removed = c.touched = True
                elif os.path.lexists(c.path):  # (unlink says EROFS for a missing file there)
                    os.unlink(c.path)
                    c.removed = c.touched = True
            except OSError as exc:
                c.error = exc
                self._discard_temp(c)
        if self._durable:
            self._sync_directories(changes)

    @staticmethod
    def _sync_directories(changes: list[_Change]) -> None:
        directories: dict[Path, OSError | None] = {}
        for c in changes:
            if not c.touched:
                continue
            parent = c.path.parent
            if parent not in directories:
                try:
                    fsync_dir(parent)
                    directories[parent] = None
                except OSError as exc:
                    directories[parent] = exc
            c.error = c.error or directories[parent]

    def _write_temp(self, c: _Change) -> None:
        assert c.data is not None
        try:
            if c.dir_mode is not None:
                make_directories(c.path.parent, c.dir_mode)
            c.tmp = write_temp(c.path, c.data, c.mode, durable=self._durable)
        except OSError as exc:  # this change fails, not the round
            c.error = exc

    @staticmethod
    def _discard_temp(c: _Change) -> None:
        if c.tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(c.tmp)
            c.tmp = None


def make_directories(directory: Path, mode: int) -> None:
    """Make `directory` and its missing parents, each with `mode` (less the umask, as mkdir does)."""
    missing = []
    while not directory.is_dir():
        missing.append(directory)
        if directory.parent == directory:
            break
        directory = directory.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, mode)
