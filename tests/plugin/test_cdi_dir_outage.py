"""A CDI directory that is full or read-only (a tiny tmpfs mounted over it, as root): prepare
fails with an error naming the spec file, leaves nothing half-written (no temp file, no spec, no
checkpoint record), and the kubelet's next try succeeds once the condition clears."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.plugin.plan import PrepareError
from plugin.conftest import PluginCore, claim, gpu_names, prepare_claim


@pytest.fixture
def tmpfs_cdi(core: PluginCore) -> Iterator[Path]:
    """The core's CDI dir on a 64 KiB tmpfs (skipped where mounting is not allowed)."""
    cdi = core.cdi.dir
    cdi.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(cdi)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield cdi
    finally:
        subprocess.run(["umount", "-l", str(cdi)], check=False)


def fill(directory: Path) -> Path:
    """Fill the file system of `directory` to the last byte."""
    filler = directory / "filler"
    with contextlib.suppress(OSError), open(filler, "wb") as f:
        while True:
            f.write(b"\0" * 4096)
            f.flush()
    with contextlib.suppress(OSError), open(filler, "ab") as f:
        while True:  # the last partial page
            f.write(b"\0")
            f.flush()
    return filler


def assert_nothing_left(core: PluginCore, ref: ClaimRef) -> None:
    assert core.checkpoint.get(ref.uid) is None
    assert core.checkpoint.records() == []
    assert core.cdi.owned() == {}
    assert [p.name for p in core.cdi.dir.iterdir() if p.name != "filler"] == []  # no temp file


@pytest.mark.parametrize("condition", ["full", "read-only"])
def test_prepare_fails_cleanly_then_succeeds_when_the_dir_recovers(
    core: PluginCore, tmpfs_cdi: Path, condition: str
) -> None:
    c = claim(str(uuid.uuid4()), gpu_names(core)[:2])
    core.add(c)
    ref = ClaimRef("default", c["metadata"]["uid"], c["metadata"]["name"])
    if condition == "full":
        filler = fill(tmpfs_cdi)
        expected = os.strerror(errno.ENOSPC)
    else:
        subprocess.run(["mount", "-o", "remount,ro", str(tmpfs_cdi)], check=True)
        expected = os.strerror(errno.EROFS)

    async def kubelet() -> list:  # one event loop, as in the plugin
        for _ in range(2):  # the kubelet retries; each try fails the same clean way
            with pytest.raises(PrepareError) as err:
                await prepare_claim(core.preparer, ref)
            message = str(err.value)
            assert str(core.cdi.path(ref.uid)) in message and expected in message, message
            assert_nothing_left(core, ref)
        if condition == "full":
            filler.unlink()
        else:
            subprocess.run(["mount", "-o", "remount,rw", str(tmpfs_cdi)], check=True)
        devices = await prepare_claim(core.preparer, ref)
        assert set(core.cdi.owned()) == {ref.uid}
        await core.preparer.unprepare(ref)
        return devices

    assert [d.device_name for d in asyncio.run(kubelet())] == gpu_names(core)[:2]
    assert core.cdi.owned() == {} and core.checkpoint.records() == []


def test_unprepare_on_a_read_only_dir_keeps_the_claim_until_its_spec_is_gone(
    core: PluginCore, tmpfs_cdi: Path
) -> None:
    c = claim(str(uuid.uuid4()), gpu_names(core)[:1])
    core.add(c)
    ref = ClaimRef("default", c["metadata"]["uid"], c["metadata"]["name"])

    async def kubelet() -> None:
        await prepare_claim(core.preparer, ref)
        subprocess.run(["mount", "-o", "remount,ro", str(tmpfs_cdi)], check=True)
        for _ in range(2):  # each retry fails the same way, and the claim stays recorded
            with pytest.raises(PrepareError, match=os.strerror(errno.EROFS)):
                await core.preparer.unprepare(ref)
            assert core.checkpoint.get(ref.uid) is not None
            assert set(core.cdi.owned()) == {ref.uid}
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs_cdi)], check=True)
        await core.preparer.unprepare(ref)

    asyncio.run(kubelet())
    assert core.cdi.owned() == {} and core.checkpoint.records() == []
