"""Durable writes in rounds: every change lands whole, fails alone, and in order per path."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path

import pytest

from dra_gpu.plugin.write_rounds import WriteRounds


def test_concurrent_changes_land_and_a_failing_one_fails_alone(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory should be\n")
    dangling = tmp_path / "dangling"  # its directory cannot be made: a link to nowhere is in the way
    dangling.symlink_to(tmp_path / "nowhere")
    (tmp_path / "old.json").write_text("old\n")

    async def body() -> list[object]:
        rounds = WriteRounds()
        return await asyncio.gather(
            *(rounds.write(tmp_path / f"spec-{i}.json", f"{i}\n".encode(), 0o644) for i in range(50)),
            rounds.write(blocker / "spec.json", b"x\n"),
            rounds.write(dangling / "spec.json", b"x\n"),
            rounds.remove(tmp_path / "old.json"),
            rounds.remove(tmp_path / "never-there.json"),
            return_exceptions=True,
        )

    outcomes = asyncio.run(body())
    assert outcomes[:50] == [None] * 50
    assert isinstance(outcomes[50], NotADirectoryError)
    assert isinstance(outcomes[51], FileExistsError)
    assert outcomes[52:] == [True, False]
    for i in range(50):
        path = tmp_path / f"spec-{i}.json"
        assert path.read_text() == f"{i}\n"
        assert path.stat().st_mode & 0o777 == 0o644
    assert not (tmp_path / "old.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []  # no temp file left


def test_changes_to_one_path_apply_in_the_order_they_were_asked(tmp_path: Path) -> None:
    path = tmp_path / "claim.json"

    async def body() -> bool:
        rounds = WriteRounds()
        # All in one round (queued before its thread runs): the last one wins.
        first = rounds.write(path, b"1\n")
        second = rounds.write(path, b"2\n")
        gone = rounds.remove(path)
        third = rounds.write(path, b"3\n")
        results = await asyncio.gather(first, second, gone, third)
        return bool(results[2])

    assert asyncio.run(body()) is True
    assert path.read_text() == "3\n"


def test_a_missing_directory_is_made(tmp_path: Path) -> None:
    path = tmp_path / "cdi" / "k8s.spec.json"
    asyncio.run(WriteRounds().write(path, b"{}\n"))
    assert path.read_text() == "{}\n"


def _writer(directory: Path) -> None:
    """Rewrites eight files with ever newer versions, 64 KiB each, until killed."""

    async def forever() -> None:
        rounds = WriteRounds()
        version = 0
        while True:
            version += 1
            body = (f"{version}\n" * 40_000)[: 64 * 1024].encode()
            await asyncio.gather(*(rounds.write(directory / f"f{i}", body) for i in range(8)))

    asyncio.run(forever())


@pytest.mark.parametrize("seed", range(6))
def test_killed_mid_round_every_file_is_one_whole_version(tmp_path: Path, seed: int) -> None:
    for i in range(8):
        (tmp_path / f"f{i}").write_bytes((b"0\n" * 40_000)[: 64 * 1024])
    pid = os.fork()
    if pid == 0:
        try:
            _writer(tmp_path)
        finally:
            os._exit(1)
    time.sleep(random.Random(seed).uniform(0.05, 0.4))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    for i in range(8):
        lines = (tmp_path / f"f{i}").read_bytes().split(b"\n")
        assert len(b"\n".join(lines)) == 64 * 1024
        assert len(set(lines[:-1])) == 1, f"f{i} mixes versions"
