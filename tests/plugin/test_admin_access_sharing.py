"""Prepare refuses a sharing config (MPS, TimeSlicing) on a device allocated with adminAccess:
the device may be held exclusively by another claim, whose GPU the sharing would change. The
error names the claim and the result; nothing is written (no checkpoint record, no CDI spec, no
daemon, the compute mode untouched)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import uuid
from typing import Any

import pytest

from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.model.config import API_VERSION
from dra_gpu.plugin.compute_mode import DEFAULT
from dra_gpu.plugin.plan import PrepareError
from plugin.conftest import DRIVER, PluginCore, claim, gpu_names, prepare_claim

pytestmark = pytest.mark.skipif(
    subprocess.run(["which", "cc"], capture_output=True).returncode != 0, reason="needs cc"
)


def sharing_config(strategy: str) -> list[dict[str, Any]]:
    params = {"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": {"strategy": strategy}}
    return [{"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": params}}]


@pytest.mark.parametrize("strategy", ["MPS", "TimeSlicing"])
def test_sharing_on_admin_access_fails_prepare_and_writes_nothing(core: PluginCore, strategy: str) -> None:
    g0 = gpu_names(core)[0]
    gpu = next(g for g in core.inventory.gpus if g.device_name == g0)
    c = claim(str(uuid.uuid4()), [g0], name="debug", namespace="team-a", config=sharing_config(strategy))
    c["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    core.add(c)
    ref = ClaimRef("team-a", c["metadata"]["uid"], "debug")
    with pytest.raises(PrepareError) as exc:
        asyncio.run(prepare_claim(core.preparer, ref))
    assert str(exc.value) == (
        f"claim team-a/debug (uid {ref.uid}): status.allocation.devices.results[0]: request 'gpu' "
        f"has adminAccess, so its device cannot take sharing.strategy {strategy} "
        "(another claim may hold it exclusively)"
    )
    assert core.checkpoint.records() == []
    assert not core.cdi.path(c["metadata"]["uid"]).exists()
    assert os.listdir(core.mps_root) == []
    state = core.root / "devroot" / "nvidia-state.json"
    modes = json.loads(state.read_text())["computeModes"] if state.exists() else {}
    assert int(modes.get(gpu.uuid, DEFAULT)) == DEFAULT


def test_admin_access_without_sharing_is_prepared(core: PluginCore) -> None:
    g0 = gpu_names(core)[0]
    c = claim(str(uuid.uuid4()), [g0], config=sharing_config("Exclusive"))
    c["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    core.add(c)
    m = c["metadata"]
    prepared = asyncio.run(prepare_claim(core.preparer, ClaimRef(m["namespace"], m["uid"], m["name"])))
    assert [d.device_name for d in prepared] == [g0]
    asyncio.run(core.preparer.unprepare(ClaimRef(m["namespace"], m["uid"], m["name"])))
