"""Checkpoint file format and CDI version rules."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dra_gpu.plugin.cdi import VOID_MOUNT, minimum_version, visible_devices_env
from dra_gpu.plugin.checkpoint import Checkpoint, _checksum


def test_round_trip_and_unknown_fields_survive(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    cp = Checkpoint(path, boot_id="b")
    cp.put("u1", {"state": "completed", "namespace": "n", "name": "c", "devices": []})
    # A newer plugin of the same format version wrote an extra field: still readable, kept.
    doc = json.loads(path.read_text())
    doc["data"]["claims"]["u1"]["mpsDaemon"] = {"id": "x"}
    doc["data"]["futureTopLevel"] = True
    doc["checksum"] = _checksum(doc["data"])
    path.write_text(json.dumps(doc))
    again = Checkpoint(path, boot_id="b")
    rec = again.get("u1")
    assert rec is not None and rec.raw["mpsDaemon"] == {"id": "x"}
    again.put("u2", {"state": "started", "namespace": "n", "name": "d", "devices": []})
    third = Checkpoint(path, boot_id="b")
    assert {r.uid for r in third.records()} == {"u1", "u2"}
    assert third.get("u1").raw["mpsDaemon"] == {"id": "x"}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "content", [b"{not json", b'{"version": 1, "data": {"claims": {}}, "checksum": "bad"}', b"[]", b""]
)
def test_corrupt_checkpoint_is_moved_aside(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_bytes(content)
    with caplog.at_level(logging.ERROR):
        cp = Checkpoint(path, boot_id="b")
    assert cp.records() == []
    aside = list(tmp_path.glob("checkpoint.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == content
    assert "checkpoint corrupt" in caplog.text
    assert cp.rebuild_pending  # the records are rebuilt before serving (test_checkpoint_rebuild)
    cp.put("u", {"state": "completed"})
    cp.rebuilt()
    again = Checkpoint(path, boot_id="b")
    assert again.get("u") is not None and not again.rebuild_pending


def spec(name: str = "gpu-0", **edits: object) -> dict:
    return {"kind": "k8s.gpu.dra-gpu.io/claim", "devices": [{"name": name, "containerEdits": edits}]}


@pytest.mark.parametrize(
    ("s", "version"),
    [
        (spec(), "0.3.0"),
        (spec(mounts=[{"hostPath": "/a", "containerPath": "/b", "type": "bind"}]), "0.4.0"),
        (spec("0a1b-gpu-0"), "0.5.0"),
        (spec(deviceNodes=[{"path": "/dev/x", "hostPath": "/sim/dev/x"}]), "0.5.0"),
        ({**spec(), "annotations": {"a": "b"}}, "0.6.0"),
        (spec(additionalGids=[44]), "0.7.0"),
        (spec(netDevices=[{"hostInterfaceName": "eth1", "name": "net1"}]), "1.1.0"),
    ],
)
def test_minimum_cdi_version(s: dict, version: str) -> None:
    assert minimum_version(s) == version


def test_spec_with_the_driver_user_space_and_a_hook_is_schema_valid(
    tmp_path: Path, driver_root: Path
) -> None:
    from dra_gpu.discovery.driver_install import discover_installation
    from dra_gpu.plugin.cdi import CdiDevice, CdiSpecs, DeviceNode
    from dra_gpu.plugin.driver_files import container_edits
    from plugin.conftest import validate_cdi

    specs = CdiSpecs(tmp_path, "gpu.dra-gpu.io")
    own = specs.build(
        "uid-1",
        [CdiDevice("gpu-0", [DeviceNode("/dev/nvidia0", "/dev/nvidia0")], {"A": "b"})],
        [DeviceNode("/dev/nvidiactl", "/dev/nvidiactl")],
        visible_devices_env(["GPU-x"]),
    )
    edits = container_edits(discover_installation(driver_root, "570.124.06"), "/usr/bin/nvidia-cdi-hook")
    spec = specs.compose(own, edits)
    validate_cdi(spec)
    # Mounts and createContainer hooks exist since 0.3.0: the driver's files need no newer runtime.
    assert spec["cdiVersion"] == minimum_version(own) == "0.3.0"
    assert own["containerEdits"].keys() == {"env", "deviceNodes", "mounts"}  # the claim's part is untouched
    assert [m["containerPath"] for m in own["containerEdits"]["mounts"]] == [VOID_MOUNT["containerPath"]]
    assert [h["args"][1] for h in spec["containerEdits"]["hooks"]] == [
        "create-symlinks",
        "enable-cuda-compat",
        "update-ldcache",
        "disable-device-node-modification",
    ]


_ENTRY = st.fixed_dictionaries(
    {"state": st.sampled_from(["started", "completed"]), "name": st.text(max_size=8)},
    optional={"devices": st.lists(st.dictionaries(st.text(max_size=4), st.integers(), max_size=3))},
)
_OPS = st.lists(
    st.tuples(
        st.sampled_from(["stage", "drop", "put", "remove", "write"]), st.sampled_from('abcdé"\\'), _ENTRY
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_the_incremental_encoding_is_the_full_one_and_reloads(tmp_path: Path, ops: list[Any]) -> None:
    """Each entry is serialised once and reused while unchanged: the file must be byte-for-byte what
    serialising the whole state gives, and load back with its checksum, after any sequence."""
    path = tmp_path / "cp.json"
    path.unlink(missing_ok=True)
    cp = Checkpoint(path, boot_id="b")
    for op, uid, entry in ops:
        if op == "stage":
            cp.stage(uid, dict(entry))
        elif op == "drop":
            cp.stage(uid, None)
        elif op == "put":
            cp.put(uid, entry)
        elif op == "remove":
            cp.remove(uid)
        else:
            cp.write(cp.encode())
        full = json.dumps(cp._data, sort_keys=True, separators=(",", ":"))
        assert json.loads(cp.encode())["data"] == json.loads(full)
        assert cp._canonical() == full
    cp.write(cp.encode())
    again = Checkpoint(path, boot_id="b")
    assert {r.uid: r.raw for r in again.records()} == {r.uid: r.raw for r in cp.records()}


_TEXT = st.text(st.sampled_from('ab/:=.é"\\'), max_size=6)
_NODE = st.builds(
    lambda path, host: {"path": path, **({"hostPath": host} if host else {})},
    _TEXT,
    st.one_of(st.none(), _TEXT),
)
_MOUNT = st.builds(
    lambda host, opts, typed: {
        "hostPath": host,
        "containerPath": host,
        "options": opts,
        **({"type": "bind"} if typed else {}),
    },
    _TEXT,
    st.lists(_TEXT, max_size=2),
    st.booleans(),
)
_EDITS = st.fixed_dictionaries(
    {},
    optional={
        "env": st.lists(_TEXT, max_size=3),
        "deviceNodes": st.lists(_NODE, max_size=3),
        "mounts": st.lists(_MOUNT, max_size=3),
        "hooks": st.lists(st.fixed_dictionaries({"hookName": _TEXT, "path": _TEXT}), max_size=2),
        "additionalGids": st.lists(st.integers(0, 70000), max_size=2),
    },
)


@given(claim_edits=_EDITS, driver_edits=_EDITS, digit_name=st.booleans())
@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_spec_composed_as_json_is_the_composed_spec_encoded(
    tmp_path: Path, claim_edits: dict[str, Any], driver_edits: dict[str, Any], digit_name: bool
) -> None:
    """The spec file is the claim's part and the driver's part serialised apart and joined: byte
    for byte what serialising the composed spec gives, its cdiVersion included."""
    from dra_gpu.plugin.cdi import CdiSpecs

    cdi = CdiSpecs(tmp_path, "gpu.dra-gpu.io")
    name = ("0" if digit_name else "u") + "-gpu-0"
    claim_spec = {"cdiVersion": "", "kind": cdi.kind, "devices": [{"name": name, "containerEdits": {}}]}
    claim_spec["containerEdits"] = claim_edits
    claim_spec["cdiVersion"] = minimum_version(claim_spec)
    for _ in range(2):  # the second time from the driver part serialised before
        assert cdi.encode_composed(claim_spec, driver_edits) == cdi.encode(
            cdi.compose(claim_spec, driver_edits)
        )
