"""Two plugin instances over one node's directories (a rolling update with maxSurge): each takes
the instance lock around its work and, taking it anew, re-reads the checkpoint the other changed;
a claim prepared by one is unprepared by the other, and a device the other freed is free."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.kubeletplugin.instance_lock import InstanceLock
from dra_gpu.plugin.checkpoint import Checkpoint
from dra_gpu.plugin.plan import BusyPrepareError

from .conftest import PluginCore, claim, gpu_names, prepare_claim

T = TypeVar("T")


def _lock(core: PluginCore) -> InstanceLock:
    return InstanceLock(
        core.checkpoint.path.parent / "serialize.lock", on_acquired=core.preparer.journal.refresh
    )


async def _under(lock: InstanceLock, step: Callable[[], Awaitable[T]]) -> T:
    async with lock.hold():
        return await step()


def test_a_claim_prepared_by_one_instance_is_unprepared_by_the_other(core: PluginCore) -> None:
    old, new = core, core.restart()
    lock_old, lock_new = _lock(old), _lock(new)
    gpu = gpu_names(core)[0]
    c1 = claim("uid-1", [gpu])
    c2 = claim("uid-2", [gpu])
    core.add(c1)
    core.add(c2)
    ref1 = ClaimRef("default", "uid-1", c1["metadata"]["name"])
    ref2 = ClaimRef("default", "uid-2", c2["metadata"]["name"])

    async def body() -> None:
        # The old instance prepares; the new one (the kubelet's choice now) answers the same.
        first = await _under(lock_old, lambda: prepare_claim(old.preparer, ref1))
        again = await _under(lock_new, lambda: prepare_claim(new.preparer, ref1))
        assert again == first
        # The new one unprepares it; the old one then sees the device free (no stale record).
        await _under(lock_new, lambda: new.preparer.unprepare(ref1))
        assert not core.cdi.path("uid-1").exists()
        await _under(lock_old, lambda: prepare_claim(old.preparer, ref2))
        assert old.preparer.journal.get("uid-1") is None
        # And the new one, in turn, sees the old one's claim.
        await _under(lock_new, lambda: asyncio.sleep(0))
        record = new.preparer.journal.get("uid-2")
        assert record is not None and record.device_names == {gpu}
        # Without the re-read the device would look held by the claim the other unprepared.
        stale = core.restart()  # remembers uid-2 on the GPU
        await _under(lock_old, lambda: old.preparer.unprepare(ref2))
        with pytest.raises(BusyPrepareError):
            await prepare_claim(stale.preparer, ref1)  # no lock, no re-read: refuses
        lock_stale = _lock(stale)
        await _under(lock_stale, lambda: prepare_claim(stale.preparer, ref1))
        lock_stale.close()

    asyncio.run(body())
    for lock in (lock_old, lock_new):
        lock.close()


def test_the_checkpoint_is_re_read_only_when_another_wrote_it(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    a = Checkpoint(path, boot_id="boot-1")
    b = Checkpoint(path, boot_id="boot-1")
    assert not a.changed_on_disk() and not b.changed_on_disk()
    a.remove("nothing")  # no write
    assert not b.changed_on_disk()
    a.put("uid-1", {"state": "completed", "namespace": "ns", "name": "c", "devices": []})
    assert not a.changed_on_disk()  # its own write
    assert b.changed_on_disk() and b.get("uid-1") is None
    b.reload()
    assert not b.changed_on_disk()
    record = b.get("uid-1")
    assert record is not None and record.name == "c"
    b.remove("uid-1")
    assert a.changed_on_disk()


def test_a_file_that_does_not_verify_is_not_taken(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    a = Checkpoint(path, boot_id="boot-1")
    a.put("uid-1", {"state": "completed", "namespace": "ns", "name": "c", "devices": []})
    tampered = path.read_text().replace('"name":"c"', '"name":"d"')
    tmp = tmp_path / "x"
    tmp.write_text(tampered)
    os.replace(tmp, path)
    assert a.changed_on_disk()
    with pytest.raises(ValueError, match="checksum"):
        a.reload()
    record = a.get("uid-1")
    assert record is not None and record.name == "c"  # kept as it was
