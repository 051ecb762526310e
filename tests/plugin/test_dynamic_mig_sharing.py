"""Dynamic MIG together with sharing: an MPS claim on an instance made at prepare or at binding."""

from __future__ import annotations

import asyncio
import json
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
from simnode.fake_nvml import FakeNvml
from simnode.profiles import load_profile

from dra_gpu.discovery import discover
from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.model.config.v1alpha1 import API_VERSION
from dra_gpu.node.catalog import DeviceCatalog
from dra_gpu.plugin.cdi import CdiSpecs
from dra_gpu.plugin.checkpoint import COMPLETED, Checkpoint
from dra_gpu.plugin.device_nodes import DeviceNodes
from dra_gpu.plugin.driver_files import DriverFiles
from dra_gpu.plugin.mig_lifecycle import MigInstances
from dra_gpu.plugin.prepare import Preparer
from plugin.conftest import DRIVER, NODE, ClaimStore, claim, prepare_claim, stop_daemons
from plugin.test_dynamic_mig_prepare import h100_driver_root  # noqa: F401 - a fixture
from tests.fake_node import create_simulated, fake_sharing

pytestmark = pytest.mark.skipif(
    subprocess.run(["which", "cc"], capture_output=True).returncode != 0, reason="needs cc"
)

PROFILE = "dgx-h100-mig"
GPU0 = "gpu-0000-18-00-0"


def mps_config() -> list[dict]:
    params = {
        "apiVersion": API_VERSION,
        "kind": "MigDeviceConfig",
        "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 50}},
    }
    return [{"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": params}}]


@pytest.mark.parametrize("bind_first", [False, True])
def test_an_mps_claim_on_a_dynamic_mig_instance(
    tmp_path: Path,
    h100_driver_root: Path,  # noqa: F811 - the imported fixture
    bind_first: bool,
) -> None:
    dev_root = tmp_path / "devroot"
    nv = FakeNvml(load_profile(PROFILE), dev_root)
    inventory = discover(nv, NODE, lambda _bus: None, dynamic_mig=True)
    create_simulated(inventory, dev_root)
    driver_files = DriverFiles(h100_driver_root, inventory.driver_version)
    mps_root = Path(tempfile.mkdtemp(prefix="mps-", dir="/tmp"))
    claims = ClaimStore()
    preparer = Preparer(
        DRIVER,
        NODE,
        DeviceCatalog.build(inventory),
        Checkpoint(tmp_path / "plugin" / "checkpoint.json", boot_id="boot-1"),
        CdiSpecs(tmp_path / "cdi", DRIVER),
        DeviceNodes(dev_root),
        claims,
        driver_files,
        sharing=fake_sharing(mps_root, driver_files, PROFILE, dev_root),
        mig=MigInstances(nv),
    )
    try:
        u = str(uuid.uuid4())
        c = claim(u, [f"{GPU0}-mig-3g40gb-4"], config=mps_config())
        claims[(c["metadata"]["namespace"], c["metadata"]["name"])] = c
        ref = ClaimRef("default", u, c["metadata"]["name"])
        if bind_first:
            assert list(asyncio.run(preparer.bind(ref, c))) == [f"{GPU0}-mig-3g40gb-4"]
        asyncio.run(prepare_claim(preparer, ref))
        (inst,) = nv.mig.gpus[inventory.gpus[0].uuid]
        rec = preparer.checkpoint.get(ref.uid)
        assert rec is not None and rec.state == COMPLETED and rec.raw.get("sharing")
        assert inst.uuid in json.dumps(rec.raw["sharing"])
        spec = json.loads(preparer.cdi.path(ref.uid).read_text())
        assert any(
            e.startswith("CUDA_MPS_PIPE_DIRECTORY=") for e in spec["devices"][0]["containerEdits"]["env"]
        )
        asyncio.run(preparer.unprepare(ref))
        assert nv.mig.gpus[inventory.gpus[0].uuid] == []
        assert not preparer.checkpoint.has(ref.uid)
    finally:
        stop_daemons(mps_root)
