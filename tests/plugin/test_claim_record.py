"""The checkpoint's typed records and the parsed allocation: shapes kept, documentation checked."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.plugin import checkpoint
from dra_gpu.plugin.allocation import Allocation
from dra_gpu.plugin.record import (
    ENTRY_FIELDS,
    MIG_READY,
    ClaimRecord,
    ClaimState,
    MetadataInputs,
    MigStage,
    MigStep,
    PreparedDevice,
)
from plugin.conftest import PluginCore, claim, gpu_names, mig_names, prepare_claim

PREVIOUS = Path(__file__).parent.parent / "data" / "checkpoint-previous-release.json"


def _documented_fields() -> list[str]:
    """The entry fields the checkpoint module's docstring lists (one per line, indented)."""
    doc = checkpoint.__doc__ or ""
    table = doc.split("An entry is one claim's record", 1)[1].split("\n\n", 2)[1]
    return [m.group(1) for m in re.finditer(r"^    (\w+)\s{2,}", table, re.MULTILINE)]


def test_the_checkpoint_docstring_documents_exactly_the_record_fields() -> None:
    assert _documented_fields() == list(ENTRY_FIELDS)
    doc = checkpoint.__doc__ or ""
    for state in ClaimState:
        if state != ClaimState.UNKNOWN:
            assert state.value in doc, state
    for stage in MigStage:
        assert stage.value in doc, stage


def test_a_record_writes_only_documented_fields() -> None:
    record = ClaimRecord(
        uid="u",
        state=ClaimState.COMPLETED,
        namespace="n",
        name="c",
        devices=(PreparedDevice(["r"], "node", "gpu-0", ["k8s.x/claim=u-gpu-0"], "s", True),),
        cdi_spec={"kind": "k8s.x/claim"},
        driver_files="abc",
        mig_steps=(MigStep("gpu-0-mig", "GPU-1", 9, 0, 4, MIG_READY, 1, 0, "MIG-1"),),
        sharing={"mps": []},
        rebuilt=True,
        metadata=MetadataInputs(("r",), "gpus"),
    )
    raw = record.to_json()
    assert set(raw) == set(ENTRY_FIELDS)
    assert ClaimRecord.parse("u", raw) == record


def test_the_previous_release_entries_are_written_back_as_they_were() -> None:
    claims = json.loads(PREVIOUS.read_text())["data"]["claims"]
    assert claims
    for uid, raw in claims.items():
        record = ClaimRecord.parse(uid, raw)
        assert record.state == ClaimState.COMPLETED
        assert record.to_json() == raw


def test_a_claim_prepared_now_is_written_in_the_previous_release_shape(core: PluginCore) -> None:
    previous = json.loads(PREVIOUS.read_text())["data"]["claims"]
    for i, device in enumerate([gpu_names(core)[0], mig_names(core)[0]]):
        c = claim(f"00000000-0000-4000-8000-00000000000{i}", [device])
        core.add(c)
        meta = c["metadata"]
        asyncio.run(prepare_claim(core.preparer, ClaimRef(meta["namespace"], meta["uid"], meta["name"])))
        path = core.root / "plugin" / "checkpoint.json"
        written = json.loads(path.read_text())["data"]["claims"][meta["uid"]]
        for old in previous.values():
            assert written.keys() == old.keys()
            assert written["devices"][0].keys() == old["devices"][0].keys()
            assert written["cdiSpec"].keys() == old["cdiSpec"].keys()


@pytest.mark.parametrize(
    "raw",
    [
        {"state": "completed"},
        {"state": "started", "name": "x", "devices": [{"": 3}]},
        {"state": "someday", "newThing": {"x": 1}},
        {
            "state": "bound",
            "namespace": "n",
            "name": "c",
            "devices": [{"deviceName": "d", "poolName": "p", "extraKey": 1}],
            "cdiSpec": None,
            "migInstances": [
                {
                    "device": "d",
                    "parentUUID": "G",
                    "profileId": 9,
                    "start": 0,
                    "size": 4,
                    "step": "planned",
                    "later": True,
                }
            ],
        },
    ],
)
def test_unknown_and_missing_fields_keep_their_shape(raw: dict) -> None:
    record = ClaimRecord.parse("u", raw)
    once = record.to_json()
    assert ClaimRecord.parse("u", once).to_json() == once
    for key, value in raw.items():
        if key != "devices":
            assert once[key] == value
    if raw["state"] == "someday":
        assert record.state == ClaimState.UNKNOWN and not record.settled


def test_a_changed_record_writes_the_changed_fields() -> None:
    record = ClaimRecord.parse("u", {"state": "started"})
    done = record.evolve(state=ClaimState.COMPLETED, cdi_spec={"kind": "k"}, sharing={"mps": [1]})
    assert done.to_json() == {"state": "completed", "cdiSpec": {"kind": "k"}, "sharing": {"mps": [1]}}
    assert record.to_json() == {"state": "started"}  # frozen: the original is unchanged
    assert done.evolve(sharing=None).to_json() == {"state": "completed", "cdiSpec": {"kind": "k"}}


def test_the_allocation_is_parsed_once_and_filtered_by_driver_and_pool() -> None:
    claim = {
        "status": {
            "allocation": {
                "allocationTimestamp": "2026-01-01T00:00:00Z",
                "devices": {
                    "results": [
                        {
                            "request": "a/sub",
                            "driver": "d",
                            "pool": "n1",
                            "device": "x",
                            "shareID": "s1",
                            "consumedCapacity": {"memory": "1Gi"},
                            "bindingConditions": ["Ready"],
                        },
                        {"request": "b", "driver": "d", "pool": "n2", "device": "y", "adminAccess": True},
                        {"request": "c", "driver": "other", "pool": "n1", "device": "z"},
                    ],
                    "config": [
                        {
                            "source": "FromClaim",
                            "requests": ["a"],
                            "opaque": {"driver": "d", "parameters": 1},
                        },
                        {"source": "FromClass", "opaque": {"driver": "d", "parameters": 2}},
                        {"source": "FromClass", "opaque": {"driver": "other", "parameters": 3}},
                    ],
                },
            }
        }
    }
    allocation = Allocation.of(claim)
    assert allocation.allocated and allocation.timestamp == "2026-01-01T00:00:00Z"
    assert [r.device for r in allocation.results_for("d")] == ["x", "y"]
    (x,) = allocation.results_for("d", "n1")
    assert (x.base_request, x.share_id, x.consumed_capacity, x.binding_conditions) == (
        "a",
        "s1",
        {"memory": "1Gi"},
        ("Ready",),
    )
    assert allocation.devices_for("d", "n2") == {"y"}
    assert [(c.index, c.parameters) for c in allocation.configs_for("d")] == [(1, 2), (0, 1)]
    assert not Allocation.of({}).allocated and Allocation.of({"status": {}}).results_for("d") == ()
