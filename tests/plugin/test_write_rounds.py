"""Atomic writes in rounds, durable or not: every change lands whole, fails alone, and in order per path; a
process killed mid-round leaves each file one whole version and, beside it, only temp files that
`remove_stale_temps` (the plugin's start) removes."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path

import pytest

from dra_gpu.common import failpoints
from dra_gpu.common.durable import remove_stale_temps
from dra_gpu.plugin.write_rounds import WriteRounds
from plugin.conftest import kill_in_a_write, slow_renames, temp_files


@pytest.mark.parametrize("durable", [False, True])
def test_concurrent_changes_land_and_a_failing_one_fails_alone(tmp_path: Path, durable: bool) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory should be\n")
    dangling = tmp_path / "dangling"  # its directory cannot be made: a link to nowhere is in the way
    dangling.symlink_to(tmp_path / "nowhere")
    (tmp_path / "old.json").write_text("old\n")

    async def body() -> list[object]:
        rounds = WriteRounds(durable=durable)
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
        rounds = WriteRounds(durable=False)
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
    asyncio.run(WriteRounds(durable=False).write(path, b"{}\n"))
    assert path.read_text() == "{}\n"


def _writer(directory: Path, durable: bool) -> None:
    """Rewrites eight files with ever newer versions, 64 KiB each, until killed."""

    async def forever() -> None:
        rounds = WriteRounds(durable=durable)
        version = 0
        while True:
            version += 1
            body = (f"{version}\n" * 40_000)[: 64 * 1024].encode()
            await asyncio.gather(*(rounds.write(directory / f"f{i}", body) for i in range(8)))

    asyncio.run(forever())


NAMES = [f"f{i}" for i in range(8)]


@pytest.mark.parametrize("durable", [False, True])
def test_killed_mid_round_every_file_is_one_whole_version(tmp_path: Path, durable: bool) -> None:
    """Six kills, each a random time into a round of writes (after a random delay, the next round
    to begin); the temp files each leaves show whether it interrupted the round, and most must
    have."""
    left_by_kill = []
    for seed in range(6):
        directory = tmp_path / f"kill-{seed}"
        directory.mkdir()
        for name in NAMES:
            (directory / name).write_bytes((b"0\n" * 40_000)[: 64 * 1024])
        pid = os.fork()
        if pid == 0:
            try:
                # A window for the kill to land in, durable or not: an fsync's own window depends
                # on the disk (on a quiet one it is as short as the write).
                slow_renames()
                _writer(directory, durable)
            finally:
                os._exit(1)
        rng = random.Random(seed)
        time.sleep(rng.uniform(0.05, 0.4))
        kill_in_a_write(pid, [directory], delay=rng.uniform(0, 0.004))  # into the round
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"seed {seed}: {status}"
        for name in NAMES:
            lines = (directory / name).read_bytes().split(b"\n")
            assert len(b"\n".join(lines)) == 64 * 1024
            assert len(set(lines[:-1])) == 1, f"seed {seed}: {name} mixes versions"
        left = temp_files(directory)
        left_by_kill.append(len(left))
        assert sorted(remove_stale_temps(directory, NAMES.__contains__)) == left
        assert sorted(p.name for p in directory.iterdir()) == NAMES, f"seed {seed}: strays"
    interrupted = sum(1 for n in left_by_kill if n)
    print(
        f"\n{interrupted} of {len(left_by_kill)} kills interrupted a write; temp files left: {left_by_kill}"
    )
    assert interrupted > len(left_by_kill) // 2, f"temp files left per kill: {left_by_kill}"


@pytest.mark.usefixtures("enabled_failpoints")
def test_a_failing_round_leaves_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The failpoint between a round's temp files and its renames, set to `error`: every change
    of the round fails, and its temp files are gone."""
    monkeypatch.setenv(failpoints.ENV, "round=error")

    async def body() -> list[object]:
        rounds = WriteRounds(durable=False, failpoint="round")
        return await asyncio.gather(
            *(rounds.write(tmp_path / n, b"x\n") for n in NAMES), return_exceptions=True
        )

    assert all(isinstance(o, failpoints.FailpointError) for o in asyncio.run(body()))
    assert list(tmp_path.iterdir()) == []
