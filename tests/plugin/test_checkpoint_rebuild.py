"""A checkpoint that is corrupt, of the previous release, or of a newer release.

Corrupt: the records are rebuilt from the CDI specs on disk and the claims in the API before the
plugin serves, so nothing a running pod needs is removed. Previous release: loads and is served.
Newer: refused, the file left byte for byte as it was."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dra_gpu.common.exit_codes import EXIT_STATE
from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.plugin.checkpoint import (
    BOUND,
    COMPLETED,
    FORMAT_VERSION,
    Checkpoint,
    CheckpointRebuildError,
    CheckpointVersionError,
    _checksum,
)
from plugin.conftest import NODE, PluginCore, claim, gpu_names, make_core, mig_names, prepare_claim
from plugin.test_dynamic_mig_prepare import GPU0, start_node
from plugin.test_failpoints_crash import h100_root  # noqa: F401 - a fixture
from plugin.test_sharing import alive, daemon_of, mps_config
from tests.simnode_support import needs_root, needs_toolchain, nvml_h  # noqa: F401 - a fixture

DATA = Path(__file__).parents[1] / "data"
PREVIOUS = DATA / "checkpoint-previous-release.json"

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="MPS daemons need cc")


def ref_of(c: dict[str, Any]) -> ClaimRef:
    m = c["metadata"]
    return ClaimRef(m["namespace"], m["uid"], m["name"])


def corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "bytes-flipped":
        flipped = bytearray(data)
        for i in range(len(flipped) // 3, len(flipped) // 3 + 8):
            flipped[i] ^= 0x20  # keeps it text, breaks the checksum or the JSON
        path.write_bytes(bytes(flipped))
    else:
        path.write_bytes(b"\x00\xff garbage \x13" * 40)


def spec_files(core: PluginCore) -> dict[str, bytes]:
    return {uid: p.read_bytes() for uid, p in core.cdi.owned().items()}


def test_previous_release_checkpoint_loads_and_is_served(tmp_path: Path, core: PluginCore) -> None:
    """tests/data/checkpoint-previous-release.json was written by the plugin before dynamic MIG
    and sharing (commit a109f8f: a whole GPU and a static MIG device prepared on dgx-a100-mig;
    its simulated dev root renamed to the e2e one, the checksum recomputed)."""
    path = core.root / "plugin" / "checkpoint.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(PREVIOUS, path)
    boot = json.loads(PREVIOUS.read_text())["data"]["bootId"]
    loaded = make_core(core.root, core.inventory, core.claims, core.driver_root, boot, core.mps_root)
    records = {r.name: r for r in loaded.checkpoint.records()}
    assert sorted(records) == ["mig-device", "whole-gpu"]
    assert all(r.state == COMPLETED and r.cdi_spec for r in records.values())
    assert records["whole-gpu"].device_names == {gpu_names(core)[0]}
    assert records["mig-device"].device_names == {mig_names(core)[0]}
    counts = loaded.preparer.reconcile()
    assert counts["rebuilt"] == 2 and counts["removed"] == 0  # its specs written from the records

    async def again() -> None:
        for r in records.values():
            ref = ClaimRef(r.namespace, r.uid, r.name)
            # Its claim is still in the API (the layer reads it); the answer is the record's.
            meta = {"namespace": r.namespace, "name": r.name, "uid": r.uid}
            loaded.claims[(r.namespace, r.name)] = {"metadata": meta}
            devices = await prepare_claim(loaded.preparer, ref)  # the kubelet's retry: same devices
            assert [d.device_name for d in devices] == sorted(r.device_names)
            await loaded.preparer.unprepare(ref)

    asyncio.run(again())
    assert loaded.cdi.owned() == {} and loaded.checkpoint.records() == []
    assert json.loads(path.read_text())["version"] == FORMAT_VERSION


def newer_checkpoint(path: Path) -> bytes:
    data = {"bootId": "b", "claims": {"u": {"state": "completed", "newThing": {"x": 1}}}}
    blob = json.dumps({"version": FORMAT_VERSION + 1, "checksum": _checksum(data), "data": data}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob)
    return blob


def test_a_newer_format_is_refused_and_left_byte_identical(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    blob = newer_checkpoint(path)
    with pytest.raises(CheckpointVersionError, match=f"format version {FORMAT_VERSION + 1}, newer"):
        Checkpoint(path, boot_id="b")
    assert path.read_bytes() == blob
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.json"]  # nothing moved aside


@needs_toolchain
@needs_root
@pytest.mark.usefixtures("nvml_h")
def test_the_plugin_refuses_to_start_on_a_newer_checkpoint(tmp_path: Path) -> None:
    plugin_dir = tmp_path / "plugin"
    blob = newer_checkpoint(plugin_dir / "checkpoint.json")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:9'}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\nusers: [{name: u, user: {token: t}}]\n"
    )
    (tmp_path / "registry").mkdir()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dra_gpu.cli",
            "kubelet-plugin",
            "--node-name",
            NODE,
            "--profile",
            "dgx-a100-mig",  # its simulated driver (built on first use)
            "--kubeconfig",
            str(kubeconfig),
            "--plugin-dir",
            str(plugin_dir),
            "--registry-dir",
            str(tmp_path / "registry"),
            "--cdi-dir",
            str(tmp_path / "cdi"),
            "--http-address",
            "",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == EXIT_STATE, r.stderr[-2000:]
    assert "newer than this plugin's" in r.stderr and "Traceback" not in r.stderr
    assert (plugin_dir / "checkpoint.json").read_bytes() == blob


def prepared(core: PluginCore) -> list[dict[str, Any]]:
    """A whole GPU, a MIG device and an MPS claim, prepared."""
    claims = [
        claim("aaaaaaaa-0000-4000-8000-000000000001", [gpu_names(core)[0]], name="whole"),
        claim("aaaaaaaa-0000-4000-8000-000000000002", [mig_names(core)[0]], name="mig", requests=["mig"]),
        claim(
            "aaaaaaaa-0000-4000-8000-000000000003",
            [gpu_names(core)[1]],
            name="mps",
            config=mps_config(40, None),
        ),
    ]

    async def prepare_all() -> None:
        for c in claims:
            core.add(c)
            await prepare_claim(core.preparer, ref_of(c))

    asyncio.run(prepare_all())
    return claims


@needs_cc
@pytest.mark.parametrize("how", ["truncated", "bytes-flipped", "garbage"])
def test_a_corrupt_checkpoint_is_rebuilt_and_loses_nothing(core: PluginCore, how: str) -> None:
    claims = prepared(core)
    before = {r.uid: r.raw for r in core.checkpoint.records()}
    specs = spec_files(core)
    _, pid = daemon_of(core, claims[2])
    # Left over from a claim whose ResourceClaim is gone: the rebuild must not keep it.
    stale = "bbbbbbbb-0000-4000-8000-000000000009"
    core.preparer.journal.write_spec_now(stale, json.loads(specs[claims[0]["metadata"]["uid"]]))
    # Allocated here but never prepared: no record for it.
    core.add(claim("cccccccc-0000-4000-8000-000000000004", [gpu_names(core)[2]], name="later"))

    path = core.checkpoint.path
    corrupt(path, how)
    restarted = core.restart()
    assert restarted.checkpoint.rebuild_pending and restarted.checkpoint.records() == []
    assert len(list(path.parent.glob("checkpoint.json.corrupt-*"))) == 1
    counts = asyncio.run(restarted.preparer.rebuild(restarted.claims))
    assert counts == {"rebuiltClaims": 3, "rebuiltBound": 0, "specsUnconfirmed": 1, "notRebuilt": 0}
    reconciled = restarted.preparer.reconcile()
    assert reconciled["removed"] == 1 and reconciled["rebuilt"] == 0  # only the stale spec went

    assert spec_files(restarted) == specs  # byte for byte what prepare wrote
    after = {r.uid: r.raw for r in restarted.checkpoint.records()}
    assert sorted(after) == sorted(before)
    for uid, raw in before.items():
        assert after[uid]["devices"] == raw["devices"] and after[uid]["cdiSpec"] == raw["cdiSpec"]
        assert after[uid]["state"] == COMPLETED and after[uid]["rebuilt"] is True
    assert [d["id"] for d in after[claims[2]["metadata"]["uid"]]["sharing"]["mps"]] == [
        d["id"] for d in before[claims[2]["metadata"]["uid"]]["sharing"]["mps"]
    ]
    assert alive(pid) and daemon_of(restarted, claims[2])[1] == pid  # re-adopted, not restarted
    assert not Checkpoint(path, boot_id=restarted.checkpoint.boot_id).rebuild_pending

    async def kubelet() -> None:
        for c in claims:  # a retried prepare answers from the rebuilt record, then unprepare
            assert await prepare_claim(restarted.preparer, ref_of(c))
        # The devices are known to be held again: a second claim for one is refused.
        thief = claim("dddddddd-0000-4000-8000-000000000005", [gpu_names(core)[0]], name="thief")
        restarted.add(thief)
        with pytest.raises(Exception, match="already prepared for claim"):
            await prepare_claim(restarted.preparer, ref_of(thief))
        for c in claims:
            await restarted.preparer.unprepare(ref_of(c))

    asyncio.run(kubelet())
    assert restarted.cdi.owned() == {} and restarted.checkpoint.records() == []
    assert not alive(pid)


def test_rebuild_without_the_api_removes_nothing_and_stays_pending(core: PluginCore) -> None:
    claims = prepared(core)
    specs = spec_files(core)
    corrupt(core.checkpoint.path, "garbage")
    restarted = core.restart()

    class Down:
        async def list_claims(self, keep: object = None) -> list[dict[str, Any]]:
            raise OSError("connection refused")

    with pytest.raises(CheckpointRebuildError, match="connection refused"):
        asyncio.run(restarted.preparer.rebuild(Down(), deadline=0.5))
    assert spec_files(restarted) == specs
    again = restarted.restart()  # the next start still knows it must rebuild
    assert again.checkpoint.rebuild_pending
    assert asyncio.run(again.preparer.rebuild(again.claims))["rebuiltClaims"] == len(claims)


def test_a_corrupt_checkpoint_keeps_dynamic_mig_instances_made_and_bound(
    tmp_path: Path,
    h100_root: Path,  # noqa: F811 - the fixture
) -> None:
    node = start_node(tmp_path, h100_root)
    prepared_ref = node.add(claim("ffffffff-0000-4000-8000-000000000001", [f"{GPU0}-mig-3g40gb-4"], name="p"))
    bound_claim = claim("ffffffff-0000-4000-8000-000000000002", [f"{GPU0}-mig-1g10gb-0"], name="b")
    bound_ref = node.add(bound_claim)
    asyncio.run(prepare_claim(node.preparer, prepared_ref))
    asyncio.run(node.preparer.bind(bound_ref, bound_claim))  # made before the pod is bound, no spec
    made = sorted((i.gi_id, i.uuid) for i in node.live())
    spec = node.cdi.path(prepared_ref.uid).read_bytes()

    corrupt(node.checkpoint.path, "truncated")
    again = node.restart()
    counts = asyncio.run(again.preparer.rebuild(again.claims))
    assert counts == {"rebuiltClaims": 1, "rebuiltBound": 1, "specsUnconfirmed": 0, "notRebuilt": 0}
    assert again.preparer.reconcile()["orphansDestroyed"] == 0  # both instances are claimed again
    assert sorted((i.gi_id, i.uuid) for i in again.live()) == made
    assert again.cdi.path(prepared_ref.uid).read_bytes() == spec
    states = {r.name: r.state for r in again.checkpoint.records()}
    assert states == {"p": COMPLETED, "b": BOUND}

    devices = asyncio.run(prepare_claim(again.preparer, bound_ref))  # the kubelet's prepare of the bound one
    assert [d.device_name for d in devices] == [f"{GPU0}-mig-1g10gb-0"]
    assert sorted((i.gi_id, i.uuid) for i in again.live()) == made  # nothing made twice
    for ref in (prepared_ref, bound_ref):
        asyncio.run(again.preparer.unprepare(ref))
    assert again.live() == [] and again.cdi.owned() == {} and again.checkpoint.records() == []
