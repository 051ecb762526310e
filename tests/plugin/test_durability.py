"""Which of the plugin's writes pay for durability (dra_gpu.common.durable): a prepare and an unprepare
fsync nothing, the health taint book fsyncs every change, and what a power loss can leave of the
boot-scoped files (a CDI spec in a persistent CDI directory, a torn or missing checkpoint) is
removed or discarded at the next boot's start."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from dra_gpu.health.classification import Effect
from dra_gpu.health.node import STATE_FILE as HEALTH_STATE_FILE
from dra_gpu.health.taint_book import TaintBook
from dra_gpu.plugin.checkpoint import COMPLETED, Checkpoint
from plugin.conftest import (
    PluginCore,
    assert_only_live_files,
    claim,
    gpu_names,
    make_core,
    mig_names,
    prepare_claim,
)
from plugin.test_prepare import ref_of
from tests.fsync_counter import fsync_counter

UIDS = [f"{i:08d}-0000-4000-8000-00000000d0ab" for i in range(5)]


def five_claims(core: PluginCore) -> list[dict]:
    """Five claims (one whole GPU, four MIG devices), known to the claim store."""
    devices = gpu_names(core)[:1] + mig_names(core)[:4]
    claims = [claim(u, [d]) for u, d in zip(UIDS, devices, strict=True)]
    for c in claims:
        core.add(c)
    return claims


async def prepare_all(core: PluginCore, claims: list[dict]) -> None:
    """Prepared at once: one round of spec writes and grouped checkpoint writes."""
    await asyncio.gather(*(prepare_claim(core.preparer, ref_of(c)) for c in claims))
    assert {r.uid for r in core.checkpoint.records() if r.state == COMPLETED} == set(UIDS)
    assert set(core.cdi.owned()) == set(UIDS)


def prepared_claims(core: PluginCore) -> list[dict]:
    claims = five_claims(core)
    asyncio.run(prepare_all(core, claims))
    return claims


def test_prepare_and_unprepare_fsync_nothing_while_the_taint_book_does(
    core: PluginCore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims = five_claims(core)
    synced = fsync_counter(monkeypatch)

    async def prepare_and_unprepare() -> None:
        await prepare_all(core, claims)
        await asyncio.gather(*(core.preparer.unprepare(ref_of(c)) for c in claims[1:]))
        await core.preparer.unprepare(ref_of(claims[0]))  # alone: the checkpoint's own write
        await prepare_claim(core.preparer, ref_of(claims[0]))  # alone
        await core.preparer.unprepare(ref_of(claims[0]))

    asyncio.run(prepare_and_unprepare())
    assert core.checkpoint.records() == [] and core.cdi.owned() == {}
    assert synced == [], f"{len(synced)} fsyncs in 6 prepares and 6 unprepares"

    book = TaintBook(tmp_path / "plugin" / HEALTH_STATE_FILE, gpu_names(core))
    book.force(gpu_names(core)[0], Effect.NO_EXECUTE)
    assert len(synced) == 2  # the taint book's temp file, then its directory after the rename
    book.clear(gpu_names(core)[0])
    assert len(synced) == 4


def test_a_spec_a_power_loss_left_in_a_persistent_cdi_dir_is_removed_at_the_next_boot(
    core: PluginCore,
) -> None:
    """The CDI directory on a disk that keeps its files across a reboot (a --cdi-dir that is not a
    tmpfs): the next boot's start finds the specs with the previous boot's checkpoint, discards
    the records and removes the specs before it serves; the claims can be prepared again."""
    claims = prepared_claims(core)
    rebooted = make_core(core.root, core.inventory, core.claims, core.driver_root, boot_id="boot-2")
    assert rebooted.checkpoint.records() == []
    counts = rebooted.preparer.reconcile()
    assert counts["removed"] == len(UIDS), counts
    assert rebooted.cdi.owned() == {}
    assert_only_live_files(rebooted)
    prepare_claim_again(rebooted, claims)


def test_a_spec_whose_checkpoint_write_a_power_loss_lost_is_removed_at_the_next_boot(
    core: PluginCore,
) -> None:
    """Nothing orders two writes that were not synced: the spec may be on disk after a power loss
    while the checkpoint that recorded its claim is not (here: no checkpoint at all)."""
    claims = prepared_claims(core)
    core.checkpoint.path.unlink()
    rebooted = make_core(core.root, core.inventory, core.claims, core.driver_root, boot_id="boot-2")
    counts = rebooted.preparer.reconcile()
    assert counts["removed"] == len(UIDS), counts
    assert_only_live_files(rebooted)
    prepare_claim_again(rebooted, claims)


@pytest.mark.parametrize("torn", [b"", b"\0" * 4096, b'{"version":1,"checksum":"'])
def test_a_checkpoint_a_power_loss_tore_is_discarded_not_rebuilt(
    core: PluginCore, torn: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A torn checkpoint (empty, zeroes, cut short: what a power loss may leave of a write that was
    not synced) of another boot is discarded as an intact one would be: no rebuild from the specs
    and the API (which would take the previous boot's specs for this boot's), nothing moved aside,
    and its specs are removed at start."""
    claims = prepared_claims(core)
    core.checkpoint.path.write_bytes(torn)
    with caplog.at_level(logging.WARNING):
        rebooted = make_core(core.root, core.inventory, core.claims, core.driver_root, boot_id="boot-2")
    assert "checkpoint of another boot unreadable" in caplog.text
    assert not rebooted.checkpoint.rebuild_pending
    assert rebooted.checkpoint.records() == []
    assert rebooted.checkpoint.boot_mark.read_text() == "boot-2\n"
    counts = rebooted.preparer.reconcile()
    assert counts["removed"] == len(UIDS), counts
    assert_only_live_files(rebooted)  # nothing moved aside
    prepare_claim_again(rebooted, claims)


@pytest.mark.parametrize("mark", [None, "boot-1"])
def test_a_checkpoint_corrupted_in_this_boot_is_still_rebuilt(tmp_path: Path, mark: str | None) -> None:
    """Unreadable with the mark naming this boot (or no mark: a plugin that fsynced every write):
    no power loss came between the write and the read, so the file is corrupt and its records
    are rebuilt (test_checkpoint_rebuild)."""
    path = tmp_path / "checkpoint.json"
    if mark is not None:
        Checkpoint(path, boot_id=mark)
    path.write_bytes(b"{not json")
    cp = Checkpoint(path, boot_id="boot-1")
    assert cp.rebuild_pending
    assert len(list(tmp_path.glob("checkpoint.json.corrupt-*"))) == 1


def prepare_claim_again(core: PluginCore, claims: list[dict]) -> None:
    asyncio.run(prepare_all(core, claims))
