"""What the publisher compares: desired slices against what the apiserver stored."""

from __future__ import annotations

from dra_gpu.discovery import discover_node
from dra_gpu.kubeletplugin.publisher import missing_fields
from dra_gpu.slices import build_slices


def test_stored_defaults_are_fine_but_dropped_or_changed_fields_are_found() -> None:
    (want,) = build_slices(discover_node("node-a", "hgx-2x4"))
    stored = {**want["spec"], "extra": "defaulted by the apiserver"}
    assert missing_fields(want["spec"], stored) == []
    dropped = {**want["spec"], "devices": [dict(d) for d in want["spec"]["devices"]]}
    dropped["devices"][3] = {k: v for k, v in dropped["devices"][3].items() if k != "capacity"}
    assert missing_fields(want["spec"], dropped) == ["devices[3].capacity"]
    edited = {**want["spec"], "devices": want["spec"]["devices"][1:]}
    assert missing_fields(want["spec"], edited) == ["devices"]
    changed = {**want["spec"], "pool": {**want["spec"]["pool"], "generation": 9}}
    assert missing_fields(want["spec"], changed) == ["pool.generation"]
