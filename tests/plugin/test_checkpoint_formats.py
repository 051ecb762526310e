"""Every checkpoint format the plugin has ever written, read by the current plugin.

tests/data/checkpoints/ keeps one file per format, each written by the commit that first wrote it
(tests/data/checkpoints/README.md says how). Every test here runs over the whole directory, so a
new fixture is picked up as it is added; `EXPECTED` must then say what its claims are.

A fixture is made this boot's before it is read (a checkpoint of another boot is discarded): its
`bootId` is rewritten and, since every format so far has one, its checksum computed again as the
current plugin computes it. Nothing else in the file is changed, its encoding included.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from dra_gpu.plugin.checkpoint import FORMAT_VERSION, Checkpoint, _checksum, current_boot_id
from dra_gpu.plugin.claim_sharing import with_previous_modes
from dra_gpu.plugin.compute_mode import DEFAULT, EXCLUSIVE_PROCESS
from dra_gpu.plugin.mps import MpsDaemon
from dra_gpu.plugin.record import ClaimRecord, ClaimState, MigStage
from dra_gpu.plugin.sharing import Sharing

from .conftest import PluginCore, make_core

FORMATS = Path(__file__).parents[1] / "data" / "checkpoints"
FIXTURES = sorted(FORMATS.glob("*.json"))
NAME = re.compile(r"(\d{4}-\d{2}-\d{2})-([0-9a-f]{7,12})-[a-z0-9]+(-[a-z0-9]+)*\.json")

# The devices of the simulated nodes the fixtures were written on (dgx-a100-mig, dgx-h100-mig).
A100_GPU = {bus: f"gpu-0000-{bus}-00-0" for bus in ("4e", "87", "90", "b7", "bd")}
A100_MIG = "gpu-0000-07-00-0-mig-3g40gb-0"
A100_MIG_MPS = "gpu-0000-07-00-0-mig-3g40gb-4"
A100_MIG_STARTING = "gpu-0000-0f-00-0-mig-2g20gb-0"
H100_GPU0, H100_GPU1 = "gpu-0000-18-00-0", "gpu-0000-2a-00-0"
COMPLETED, STARTED, BOUND = "completed", "started", "bound"

# name -> (state, device names in order), per fixture
BEFORE_SHARING = {
    "whole-gpu": (COMPLETED, [A100_GPU["4e"]]),
    "mig-device": (COMPLETED, [A100_MIG]),
    "admin-access": (COMPLETED, [A100_GPU["4e"]]),
    "two-gpus": (STARTED, [A100_GPU["87"], A100_GPU["90"]]),
}
DYNAMIC_MIG = {
    "whole-gpu": (COMPLETED, [H100_GPU1]),
    "dynamic-mig": (COMPLETED, [f"{H100_GPU0}-mig-3g40gb-4"]),
    "dynamic-mig-halfway": (STARTED, [f"{H100_GPU0}-mig-1g10gb-0", f"{H100_GPU0}-mig-1g10gb-1"]),
}
MPS = {
    "whole-gpu": (COMPLETED, [A100_GPU["4e"]]),
    "mig-device": (COMPLETED, [A100_MIG]),
    "admin-access": (COMPLETED, [A100_GPU["4e"]]),
    "mps-gpus": (COMPLETED, [A100_GPU["87"], A100_GPU["90"]]),
    "mps-mig": (COMPLETED, [A100_MIG_MPS]),
    "mps-starting": (STARTED, [A100_MIG_STARTING]),
}
TIME_SLICES = {**MPS, "time-sliced": (COMPLETED, [A100_GPU["b7"]])}
SHARES = {
    **TIME_SLICES,
    "memory-share-a": (COMPLETED, [A100_GPU["bd"]]),
    "memory-share-b": (COMPLETED, [A100_GPU["bd"]]),
}
EXPECTED: dict[str, dict[str, tuple[str, list[str]]]] = {
    "2026-11-29-06e9b17-two-phase-claims": BEFORE_SHARING,
    "2026-12-01-b0be7ea-driver-user-space": BEFORE_SHARING,
    "2026-12-01-3254e0c-driver-files": BEFORE_SHARING,
    "2026-12-01-161c73b-mig-instances": DYNAMIC_MIG,
    "2026-12-01-a712358-mps-compute-modes": MPS,
    "2026-12-01-834b6e0-time-slices": TIME_SLICES,
    "2026-12-01-598f728-memory-shares": SHARES,
    "2026-12-01-5d54f78-bound": {
        **DYNAMIC_MIG,
        "dynamic-mig-bound": (BOUND, [f"{H100_GPU0}-mig-2g20gb-2"]),
    },
    "2026-12-01-65e7a91-rebuild-pending": {},
    "2026-12-01-65e7a91-rebuilt": {
        "whole-gpu": (COMPLETED, [A100_GPU["4e"]]),
        "mps-gpu": (COMPLETED, [A100_GPU["87"]]),
        "time-sliced": (COMPLETED, [A100_GPU["90"]]),
        "memory-share": (COMPLETED, [A100_GPU["b7"]]),
        "dynamic-mig-bound": (BOUND, ["gpu-0000-47-00-0-mig-1g10gb-3"]),
    },
    "2026-12-02-6c0ab3c-memory-limit": SHARES,
    "2026-12-06-c4e313b-driver-limit-pods": SHARES,
    "2026-12-07-f7faf93-device-metadata": SHARES,
}
# The entry fields each fixture's claims have besides state, namespace, name, devices, cdiSpec.
OPTIONAL_FIELDS = {
    "06e9b17": set(),
    "b0be7ea": set(),
    "3254e0c": {"driverFiles"},
    "161c73b": {"driverFiles", "migInstances"},
    "a712358": {"driverFiles", "sharing"},
    "834b6e0": {"driverFiles", "sharing"},
    "598f728": {"driverFiles", "sharing"},
    "5d54f78": {"driverFiles", "migInstances"},
    "65e7a91": {"driverFiles", "sharing", "migInstances", "rebuilt"},
    "6c0ab3c": {"driverFiles", "sharing"},
    "c4e313b": {"driverFiles", "sharing"},
    "f7faf93": {"driverFiles", "sharing", "deviceMetadata"},
}


def this_boots(fixture: Path, directory: Path) -> tuple[Path, dict[str, Any]]:
    """A copy of `fixture` as if written during this boot, and its data as the plugin must read it."""
    text = fixture.read_text()
    doc = json.loads(text)
    boot = current_boot_id()
    text = text.replace(json.dumps(doc["data"]["bootId"]), json.dumps(boot), 1)
    data = json.loads(text)["data"]
    assert data["bootId"] == boot and data == {**doc["data"], "bootId": boot}
    if "checksum" in doc:  # every format so far; one without would be refused (a corrupt file)
        text = text.replace(doc["checksum"], _checksum(data), 1)
    path = directory / "checkpoint.json"
    path.write_text(text)
    return path, data


def commit_of(fixture: Path) -> str:
    match = NAME.fullmatch(fixture.name)
    assert match, f"{fixture.name}: name it <yyyy-mm-dd>-<commit>-<what>.json"
    return match[2]


def by_name(checkpoint: Checkpoint) -> dict[str, ClaimRecord]:
    records = {r.name: r for r in checkpoint.records()}
    assert len(records) == len(checkpoint.records())
    return records


def load(stem: str, tmp_path: Path) -> tuple[Checkpoint, dict[str, ClaimRecord]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path, _ = this_boots(FORMATS / f"{stem}.json", tmp_path)
    checkpoint = Checkpoint(path)
    return checkpoint, by_name(checkpoint)


@pytest.fixture(params=FIXTURES, ids=lambda p: p.stem)
def fixture(request: pytest.FixtureRequest) -> Path:
    path: Path = request.param
    return path


def test_each_format_has_a_fixture_and_each_fixture_is_described() -> None:
    readme = (FORMATS / "README.md").read_text()
    assert sorted(p.stem for p in FIXTURES) == sorted(EXPECTED)
    for path in FIXTURES:
        assert path.name in readme and commit_of(path) in OPTIONAL_FIELDS, path.name
        doc = json.loads(path.read_text())
        assert doc["version"] <= FORMAT_VERSION and doc["data"]["bootId"] != current_boot_id()


def test_the_current_plugin_reads_every_claim(fixture: Path, tmp_path: Path) -> None:
    path, data = this_boots(fixture, tmp_path)
    written = path.read_bytes()
    checkpoint = Checkpoint(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.json", "checkpoint.json.boot"]
    assert path.read_bytes() == written  # read as it is: nothing moved aside, rebuilt or rewritten
    assert checkpoint.rebuild_pending == bool(data.get("rebuildPending"))
    records = by_name(checkpoint)
    got = {name: (str(r.state), [d.device_name for d in r.devices]) for name, r in records.items()}
    assert got == EXPECTED[fixture.stem]
    optional = OPTIONAL_FIELDS[commit_of(fixture)]
    seen: set[str] = set()
    for uid, raw in data["claims"].items():
        record = checkpoint.get(uid)
        assert record is not None and record.uid == uid
        assert (record.namespace, record.name) == ("default", raw["name"])
        assert record.state == ClaimState(raw["state"])
        assert [d.to_dict() for d in record.devices] == raw["devices"]
        assert all(d.pool_name == "node-a" and d.cdi_device_ids for d in record.devices)
        assert record.cdi_spec == raw["cdiSpec"]
        assert record.driver_files == raw.get("driverFiles")
        assert record.mig_instances == raw.get("migInstances", [])
        assert record.sharing == raw.get("sharing")
        assert record.rebuilt is raw.get("rebuilt", False)
        assert (record.metadata and record.metadata.to_json()) == raw.get("deviceMetadata")
        assert record.extra == {} and record.device_extra == ()  # every field is known
        assert record.to_json() == raw
        seen |= set(raw) - {"state", "namespace", "name", "devices", "cdiSpec"}
    assert seen == (optional if data["claims"] else set())


def test_read_write_read_keeps_every_field(fixture: Path, tmp_path: Path) -> None:
    """Each record re-encoded by the current writer, the file written and read again: the same
    data, and the current writer's encoding of it."""
    path, data = this_boots(fixture, tmp_path)
    checkpoint = Checkpoint(path)
    for record in checkpoint.records():
        checkpoint.stage(record.uid, ClaimRecord.parse(record.uid, record.to_json()))
    checkpoint.write(checkpoint.encode())
    assert json.loads(path.read_text()) == {
        "version": FORMAT_VERSION,
        "checksum": _checksum(data),
        "data": data,
    }
    again = Checkpoint(path)
    assert {r.uid: r.to_json() for r in again.records()} == data["claims"]
    assert again.rebuild_pending == bool(data.get("rebuildPending"))
    assert again.encode() == path.read_bytes()  # stable: written again, byte for byte the same


def with_unknown_fields(data: dict[str, Any]) -> dict[str, Any]:
    """`data` as a newer plugin of the same format version might write it: a field this one does
    not know at every level (the file, each entry, device, MIG step, sharing record and daemon)."""
    out: dict[str, Any] = json.loads(json.dumps(data))
    out["fromANewerPlugin"] = {"x": 1}
    for uid, entry in out["claims"].items():
        entry["newerField"] = [uid]
        for device in entry["devices"]:
            device["newerDeviceField"] = "kept"
        for step in entry.get("migInstances", []):
            step["newerStepField"] = 7
        if "sharing" in entry:
            entry["sharing"]["newerSharingField"] = True
            for daemon in entry["sharing"].get("mps", []):
                daemon["newerDaemonField"] = "kept"
    return out


def test_unknown_fields_are_kept_and_written_back(fixture: Path, tmp_path: Path) -> None:
    _, data = this_boots(fixture, tmp_path)
    newer = with_unknown_fields(data)
    path = tmp_path / "checkpoint.json"
    path.write_text(json.dumps({"version": FORMAT_VERSION, "checksum": _checksum(newer), "data": newer}))
    checkpoint = Checkpoint(path)
    for record in checkpoint.records():
        assert record.extra == {"newerField": [record.uid]}
        assert record.device_extra == tuple({"newerDeviceField": "kept"} for _ in record.devices)
        assert all(m.extra == {"newerStepField": 7} for m in record.mig_steps)
        checkpoint.stage(record.uid, ClaimRecord.parse(record.uid, record.to_json()))
    checkpoint.write(checkpoint.encode())
    assert json.loads(path.read_text())["data"] == newer
    assert {r.uid: r.to_json() for r in Checkpoint(path).records()} == newer["claims"]


# -- what each format added, read through the current plugin's own views ------------------------


def test_dynamic_mig_steps_of_each_format(tmp_path: Path) -> None:
    for stem in ("2026-12-01-161c73b-mig-instances", "2026-12-01-5d54f78-bound"):
        _, records = load(stem, tmp_path / stem)
        halfway = records["dynamic-mig-halfway"]
        first, second = halfway.mig_steps
        assert (first.step, second.step) == (MigStage.GPU_INSTANCE, MigStage.PLANNED)
        assert (first.profile_id, first.start, first.size, first.slices) == (19, 0, 1, {0})
        assert first.gi_id is not None and (first.ci_id, first.uuid) == (None, None)
        assert (second.start, second.gi_id, second.uuid) == (1, None, None)
        assert halfway.cdi_spec is None and not halfway.settled  # rolled back at the next start
        (ready,) = records["dynamic-mig"].mig_steps
        assert (ready.step, ready.profile_id, ready.start, ready.size, ready.ci_id) == ("ready", 9, 4, 4, 0)
        assert ready.parent_uuid == "GPU-8cdaef8d-e8ae-5bd1-a6aa-8fca9b8b93e4"
        assert ready.uuid is not None and ready.uuid.startswith("MIG-")
        (status,) = records["dynamic-mig"].status_devices()
        assert status["migUUID"] == ready.uuid
    bound = records["dynamic-mig-bound"]
    assert bound.state == ClaimState.BOUND and bound.settled and bound.cdi_spec is None
    assert [(m.step, m.profile_id, m.start) for m in bound.mig_steps] == [("ready", 14, 2)]


def test_mps_and_compute_modes_of_each_format(tmp_path: Path) -> None:
    for stem in (
        "2026-12-01-a712358-mps-compute-modes",
        "2026-12-01-834b6e0-time-slices",
        "2026-12-01-598f728-memory-shares",
        "2026-12-02-6c0ab3c-memory-limit",
        "2026-12-06-c4e313b-driver-limit-pods",
        "2026-12-07-f7faf93-device-metadata",
    ):
        _, records = load(stem, tmp_path / stem)
        for record in records.values():  # the daemons as the MPS code reads and writes them
            for raw in (record.sharing or {}).get("mps", []):
                assert MpsDaemon.from_dict(raw).to_dict() == raw
        gpus = records["mps-gpus"].sharing
        assert gpus is not None
        (daemon,) = [MpsDaemon.from_dict(d) for d in gpus["mps"]]
        assert daemon.id == "77777777-7777-4777-8777-777777777777-0" and len(daemon.uuids) == 2
        assert daemon.active_thread_percentage == 50
        assert daemon.pinned_memory_limits == dict.fromkeys(daemon.uuids, "10240M")
        assert gpus["computeModes"] == {
            u: {"mode": EXCLUSIVE_PROCESS, "previous": DEFAULT} for u in daemon.uuids
        }
        mig = records["mps-mig"].sharing
        assert mig is not None
        (mig_daemon,) = [MpsDaemon.from_dict(d) for d in mig["mps"]]
        assert mig_daemon.uuids == ["MIG-b1412001-0001-5294-8a3a-7080a115670c"]
        starting = records["mps-starting"]
        assert starting.state == ClaimState.STARTED
        assert starting.sharing is not None
        assert [MpsDaemon.from_dict(d).active_thread_percentage for d in starting.sharing["mps"]] == [25]
        if stem.startswith("2026-12-01"):
            # Before a0baadf a MIG device's compute mode was recorded too, and a claim that had
            # only planned its sharing has no `previous`: undone as DEFAULT.
            (uuid,) = mig_daemon.uuids
            assert mig["computeModes"] == {uuid: {"mode": EXCLUSIVE_PROCESS, "previous": DEFAULT}}
            (planned,) = starting.sharing["computeModes"].values()
            assert planned == {"mode": EXCLUSIVE_PROCESS}
            assert with_previous_modes(starting.sharing)["computeModes"] == {
                u: {"mode": EXCLUSIVE_PROCESS, "previous": DEFAULT} for u in starting.sharing["computeModes"]
            }
        else:
            assert "computeModes" not in mig and "computeModes" not in starting.sharing


def test_time_slices_memory_shares_and_their_limits(tmp_path: Path) -> None:
    _, records = load("2026-12-01-834b6e0-time-slices", tmp_path / "ts")
    sliced = records["time-sliced"].sharing
    assert sliced is not None
    (uuid,) = sliced["timeSlices"]
    assert sliced == {
        "computeModes": {uuid: {"mode": DEFAULT, "previous": DEFAULT}},
        "timeSlices": {uuid: {"interval": "Long", "level": 3}},
    }

    share_ids = {"memory-share-a": "0f2d3c4b-5a69-4788-9a1b-2c3d4e5f6a7b"}
    share_ids["memory-share-b"] = "1a2b3c4d-5e6f-4a8b-9c0d-1e2f3a4b5c6d"
    limits = {"memory-share-a": "40960M", "memory-share-b": "20480M"}
    for stem in ("2026-12-01-598f728-memory-shares", "2026-12-02-6c0ab3c-memory-limit"):
        _, records = load(stem, tmp_path / stem)
        for name, share_id in share_ids.items():
            (device,) = records[name].devices
            assert device.share_id == share_id and device.cdi_device_ids[0].endswith(share_id)
            sharing = records[name].sharing
            assert sharing is not None
            (daemon,) = [MpsDaemon.from_dict(d) for d in sharing["mps"]]
            assert daemon.share_id == share_id and list(daemon.pinned_memory_limits.values()) == [
                limits[name]
            ]
    # 6c0ab3c: how each share's memory is held
    a, b = records["memory-share-a"].devices[0], records["memory-share-b"].devices[0]
    assert a.memory_limit == {"enforcedBy": "cooperative", "reason": "no driver memory limits on this node"}
    assert b.memory_limit == {"enforcedBy": "driver", "reason": "the hook sets it"}


def test_a_driver_limit_and_its_pods_still_bound_a_new_claim(tmp_path: Path) -> None:
    """c4e313b: the sharing record keeps a driver-held share's limit and the pods reserving it;
    the current plugin refuses a claim held to another limit for one of those pods."""
    _, records = load("2026-12-06-c4e313b-driver-limit-pods", tmp_path)
    held = records["memory-share-b"].sharing
    assert held is not None
    assert (held["driverMemoryLimitMiB"], held["pods"]) == (20480, ["uid-trainer-0"])
    assert "driverMemoryLimitMiB" not in (records["memory-share-a"].sharing or {})
    other = ("default/memory-share-b", held)
    problem = Sharing.conflict({"driverMemoryLimitMiB": 40960, "pods": ["uid-trainer-0"]}, [other])
    assert problem is not None and "20480 MiB" in problem and "uid-trainer-0" in problem
    assert Sharing.conflict({"driverMemoryLimitMiB": 40960, "pods": ["uid-other"]}, [other]) is None


def test_device_metadata_inputs_and_ids(tmp_path: Path) -> None:
    _, records = load("2026-12-07-f7faf93-device-metadata", tmp_path)
    for record in records.values():
        assert record.metadata is not None
        assert record.metadata.requests == tuple(d.request_names[0] for d in record.devices[:1])
        first = record.devices[0].cdi_device_ids
        assert first[-1] == f"gpu.dra-gpu.io/metadata={record.uid}_{record.metadata.requests[0]}"
    pod_claim_names = {name: r.metadata and r.metadata.pod_claim_name for name, r in records.items()}
    assert pod_claim_names == {name: "gpu" if name == "whole-gpu" else None for name in records}
    # the request's first device alone carries the metadata's CDI ID
    assert [len(d.cdi_device_ids) for d in records["mps-gpus"].devices] == [2, 1]


def test_rebuild_pending_and_rebuilt_records(tmp_path: Path) -> None:
    checkpoint, records = load("2026-12-01-65e7a91-rebuild-pending", tmp_path / "pending")
    assert checkpoint.rebuild_pending and records == {}
    checkpoint.rebuilt()  # what the reconcile does once the records are rebuilt
    assert not Checkpoint(checkpoint.path).rebuild_pending

    _, records = load("2026-12-01-65e7a91-rebuilt", tmp_path / "rebuilt")
    assert all(r.rebuilt for r in records.values())
    mps = records["mps-gpu"].sharing
    assert mps is not None
    (uuid,) = mps["computeModes"]
    assert mps["computeModes"][uuid] == {"mode": EXCLUSIVE_PROCESS, "previous": DEFAULT}
    assert [MpsDaemon.from_dict(d).active_thread_percentage for d in mps["mps"]] == [40]
    bound = records["dynamic-mig-bound"]
    assert bound.state == ClaimState.BOUND and bound.cdi_spec is None and bound.settled
    assert [m.step for m in bound.mig_steps] == [MigStage.READY]


def test_a_record_with_the_driver_files_in_its_spec_is_restored_with_each_file_once(core: PluginCore) -> None:
    """b0be7ea's records (before `driverFiles`) carry the driver's user space in their own spec:
    a start that finds their spec files gone writes them back as recorded, not with the driver's
    files added a second time."""
    path, data = this_boots(FORMATS / "2026-12-01-b0be7ea-driver-user-space.json", core.root / "plugin")
    assert path == core.checkpoint.path
    restarted = make_core(core.root, core.inventory, core.claims, core.driver_root, boot_id=current_boot_id())
    counts = restarted.preparer.reconcile()
    completed = {uid: c for uid, c in data["claims"].items() if c["state"] == "completed"}
    assert counts["rebuilt"] == len(completed) == 3, counts
    for uid, c in completed.items():
        spec = restarted.cdi.read(uid)
        assert spec is not None and spec["containerEdits"] == c["cdiSpec"]["containerEdits"], uid
        paths = [m["containerPath"] for m in spec["containerEdits"]["mounts"]]
        assert len(paths) == len(set(paths)) > 0, paths
