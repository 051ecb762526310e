"""Atomic writes: the temp file's naming, and what `remove_stale_temps` removes (its own naming
for the targets asked, regular files only)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from dra_gpu.common import failpoints
from dra_gpu.common.durable import (
    remove_stale_temps,
    replace_atomically,
    replace_durably,
    temp_target,
    write_temp,
)
from tests.fsync_counter import fsync_counter


def test_a_temp_file_names_its_target(tmp_path: Path) -> None:
    for name in ("checkpoint.json", "k8s.gpu.dra-gpu.io-claim_0d3c-11.json", ".hidden", "a.b.c.tmp"):
        tmp = Path(write_temp(tmp_path / name, b"x", durable=False))
        assert temp_target(tmp.name) == name
    assert temp_target("checkpoint.json") is None
    assert temp_target(".checkpoint.json.tmp") is None
    assert temp_target(".checkpoint.json.ABCDEFGH.tmp") is None  # mkstemp's letters are lower case


def test_only_the_named_targets_temp_files_are_removed(tmp_path: Path) -> None:
    mine = Path(write_temp(tmp_path / "mine.json", b"x", durable=False))
    theirs = Path(write_temp(tmp_path / "theirs.json", b"x", durable=True))
    (tmp_path / "mine.json").write_text("kept")
    assert remove_stale_temps(tmp_path, {"mine.json"}.__contains__) == [mine]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["mine.json", theirs.name])
    assert remove_stale_temps(tmp_path / "missing", lambda _: True) == []


@pytest.mark.usefixtures("enabled_failpoints")
@pytest.mark.parametrize("replace", [replace_atomically, replace_durably])
def test_a_failpoint_between_temp_and_rename_leaves_no_temp_on_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replace: Callable[..., None]
) -> None:
    monkeypatch.setenv(failpoints.ENV, "between=error")
    with pytest.raises(failpoints.FailpointError):
        replace(tmp_path / "f", b"new", failpoint="between")
    assert list(tmp_path.iterdir()) == []
    replace(tmp_path / "f", b"new", 0o640, failpoint="elsewhere")
    assert (tmp_path / "f").read_bytes() == b"new"
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o640


def test_only_a_durable_replace_fsyncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced = fsync_counter(monkeypatch)
    replace_atomically(tmp_path / "boot-scoped", b"x")
    assert synced == []
    replace_durably(tmp_path / "kept", b"x")
    assert len(synced) == 2  # the temp file, then the directory after the rename
