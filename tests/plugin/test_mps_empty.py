"""`_empty` against what a tenant can put in (or swap into) a daemon's directories: FIFOs, links
out, sockets, deep trees, and entries replaced between the listing and the removal. It never
hangs, never follows a link, leaves the directory empty, or says which directory it could not
empty."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dra_gpu.plugin.mps import EMPTY_MAX_DEPTH, MpsError, _empty

TIMEOUT = 10.0  # seconds; a hang shows as a failure, not a stuck run


@pytest.fixture
def fifos() -> Iterator[list[Path]]:
    """FIFOs a test makes; a reader blocked on one (the bug) is let go when the test ends."""
    made: list[Path] = []
    yield made
    for path in made:
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def mkfifo(path: Path, fifos: list[Path]) -> None:
    os.mkfifo(path)
    fifos.append(path)


def run_bounded(fn: Callable[[], None]) -> BaseException | None:
    """`fn`'s exception (None when it returned); a failure when it runs past TIMEOUT."""
    raised: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the test
            raised.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(TIMEOUT)
    if t.is_alive():
        pytest.fail(f"still running after {TIMEOUT}s: it hangs")
    return raised[0] if raised else None


def empties(directory: Path) -> None:
    exc = run_bounded(lambda: _empty(directory))
    if exc is not None:
        raise exc
    assert os.listdir(directory) == []


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory of the plugin's a link may point at: it must be left as it is."""
    d = tmp_path / "outside"
    (d / "sub").mkdir(parents=True)
    (d / "keep").write_text("x")
    (d / "sub" / "keep").write_text("x")
    return d


def untouched(outside: Path) -> bool:
    return (outside / "keep").is_file() and (outside / "sub" / "keep").is_file()


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    d = tmp_path / "shm"
    d.mkdir()
    return d


def test_a_fifo_is_removed_without_being_opened(shm: Path, fifos: list[Path]) -> None:
    mkfifo(shm / "f", fifos)
    empties(shm)


def test_a_link_to_a_directory_outside_is_removed_not_followed(shm: Path, outside: Path) -> None:
    (shm / "out").symlink_to(outside, target_is_directory=True)
    (shm / "dangling").symlink_to(shm / "nowhere")
    empties(shm)
    assert untouched(outside)


def test_a_socket_is_removed(shm: Path) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(shm / "s"))
        s.listen()
        empties(shm)


def test_nested_directories_with_fifos_and_links_inside(shm: Path, outside: Path, fifos: list[Path]) -> None:
    inner = shm / "a" / "b" / "c"
    inner.mkdir(parents=True)
    mkfifo(shm / "a" / "f", fifos)
    mkfifo(inner / "f", fifos)
    (inner / "out").symlink_to(outside, target_is_directory=True)
    (shm / "a" / "b" / "file").write_text("x")
    empties(shm)
    assert untouched(outside)


def test_a_deep_tree_is_removed_with_a_bounded_number_of_open_fds(
    shm: Path, monkeypatch: pytest.MonkeyPatch, fifos: list[Path]
) -> None:
    d = shm
    for _ in range(EMPTY_MAX_DEPTH * 3 + 1):
        d = d / "d"
        d.mkdir()
    mkfifo(d / "f", fifos)
    real_open, real_close = os.open, os.close
    held: set[int] = set()
    most = [0]

    def counting_open(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        fd = real_open(path, flags, mode, dir_fd=dir_fd)
        held.add(fd)
        most[0] = max(most[0], len(held))
        return fd

    def counting_close(fd: int) -> None:
        held.discard(fd)
        real_close(fd)

    monkeypatch.setattr(os, "open", counting_open)
    monkeypatch.setattr(os, "close", counting_close)
    empties(shm)
    assert most[0] <= EMPTY_MAX_DEPTH + 1


class Listed:
    """What os.scandir returns, read already."""

    def __init__(self, entries: list[os.DirEntry[str]]) -> None:
        self.entries = entries

    def __enter__(self) -> Listed:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def __iter__(self) -> Iterator[os.DirEntry[str]]:
        return iter(self.entries)


def listing_hook(monkeypatch: pytest.MonkeyPatch, directory: Path, after: Callable[[], None]) -> None:
    """Runs `after` once, right after `_empty` has listed `directory` (a tenant's swap there)."""
    real = os.scandir
    ino = directory.stat().st_ino
    done: list[bool] = []

    def scandir(path: int | str = ".") -> Listed:
        with real(path) as it:
            entries = list(it)
        if not done and isinstance(path, int) and os.fstat(path).st_ino == ino:
            done.append(True)
            after()
        return Listed(entries)

    monkeypatch.setattr(os, "scandir", scandir)


def test_a_directory_swapped_for_a_fifo_after_the_listing(
    shm: Path, monkeypatch: pytest.MonkeyPatch, fifos: list[Path]
) -> None:
    (shm / "d" / "sub").mkdir(parents=True)

    def swap() -> None:
        (shm / "d" / "sub").rmdir()
        (shm / "d").rmdir()
        mkfifo(shm / "d", fifos)

    listing_hook(monkeypatch, shm, swap)
    empties(shm)


def rmdir_hook(monkeypatch: pytest.MonkeyPatch, name: str, after: Callable[[], None]) -> None:
    """Runs `after` once, when `_empty`'s rmdir of `name` has failed as not empty: the tenant
    swaps it before the directory is opened to be emptied."""
    real = os.rmdir
    done: list[bool] = []

    def rmdir(path: str, *, dir_fd: int | None = None) -> None:
        try:
            real(path, dir_fd=dir_fd)
        except OSError as exc:
            if not done and path == name and exc.errno == errno.ENOTEMPTY:
                done.append(True)
                after()
            raise

    monkeypatch.setattr(os, "rmdir", rmdir)


def swap_out(d: Path) -> None:
    """Moves the tenant's directory `d` away (out of what is being emptied)."""
    d.rename(d.parent.parent / f"moved-{d.name}")


def test_a_directory_swapped_for_a_fifo_before_it_is_opened(
    shm: Path, monkeypatch: pytest.MonkeyPatch, fifos: list[Path]
) -> None:
    (shm / "d" / "sub").mkdir(parents=True)

    def swap() -> None:
        swap_out(shm / "d")
        mkfifo(shm / "d", fifos)

    rmdir_hook(monkeypatch, "d", swap)
    empties(shm)


def test_a_directory_swapped_for_a_link_out_before_it_is_opened(
    shm: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (shm / "d" / "sub").mkdir(parents=True)

    def swap() -> None:
        swap_out(shm / "d")
        (shm / "d").symlink_to(outside, target_is_directory=True)

    rmdir_hook(monkeypatch, "d", swap)
    empties(shm)
    assert untouched(outside)


def test_a_tenant_that_keeps_writing_gets_an_error_naming_the_directory(
    shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.scandir
    written = iter(range(1_000_000))

    def scandir(path: int | str = ".") -> Listed:
        (shm / f"new-{next(written)}").write_text("x")  # a file for every look at it
        with real(path) as it:
            return Listed(list(it))

    monkeypatch.setattr(os, "scandir", scandir)
    exc = run_bounded(lambda: _empty(shm))
    assert isinstance(exc, MpsError)
    assert f"cannot empty {shm}:" in str(exc)


def test_a_link_as_the_directory_itself_is_an_error_naming_it(tmp_path: Path, outside: Path) -> None:
    link = tmp_path / "shm"
    link.symlink_to(outside, target_is_directory=True)
    exc = run_bounded(lambda: _empty(link))
    assert isinstance(exc, MpsError)
    assert str(link) in str(exc)
    assert untouched(outside)
