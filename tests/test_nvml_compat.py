"""The fallbacks of dra_gpu/discovery/nvml_compat.py: each runs where its NVML symbol is missing.

A driver whose libnvidia-ml lacks a symbol answers NVMLError_FunctionNotFound through pynvml; the
simulated node models the missing `...ProfileInfoByIdV` below driver 580 itself, the other
missing symbols are injected through the profile's `nvmlErrors`.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import pynvml
import pytest
import yaml
from conftest import discover_doc
from simnode.fake import simulated_nvml
from simnode.profiles import parse_profile

from dra_gpu.discovery.nvml_compat import (
    FALLBACKS,
    driver_branch,
    exported_in,
    gpu_instance_profile_info_by_id,
)
from dra_gpu.model.inventory import Inventory

BY_ID = "nvmlDeviceGetGpuInstanceProfileInfoByIdV"


def _mig_doc(driver: str, nvml_errors: dict[str, str] | None = None) -> dict[str, Any]:
    ref = resources.files("simnode").joinpath("profiles/dgx-a100-mig.yaml")
    doc: dict[str, Any] = yaml.safe_load(ref.read_text(encoding="utf-8"))
    doc["driverVersion"] = driver
    if nvml_errors:
        doc["nvmlErrors"] = nvml_errors
    return doc


def _premade(inv: Inventory) -> dict[int, list[tuple[str, int, int, int]]]:
    return {
        g.index: [
            (m.profile, m.gi_profile_id, m.memory_bytes >> 20, m.multiprocessors) for m in g.mig_devices
        ]
        for g in inv.gpus
        if g.mig_enabled
    }


EXPECTED_PREMADE = {
    0: [("3g.40gb", 9, 40192, 42), ("3g.40gb", 9, 40192, 42)],
}


def test_premade_mig_devices_published_without_profile_info_by_id() -> None:
    """A 570 driver: ...ProfileInfoByIdV is missing (FunctionNotFound); pre-made MIG devices are
    still published, with their profile's name, memory and SMs (defect 24.3)."""
    doc = _mig_doc("570.124.06", {"nvmlDeviceGetGpuInstanceProfileInfoById": "FunctionNotFound"})
    inv = discover_doc(doc)
    premade = _premade(inv)
    assert premade[0] == EXPECTED_PREMADE[0]
    assert all(devs for devs in premade.values()), premade


def test_premade_mig_devices_same_with_and_without_by_id() -> None:
    """A 580 driver answers ...ByIdV; a 570 one does not: the same devices either way."""
    new, old = discover_doc(_mig_doc("580.65.06")), discover_doc(_mig_doc("570.124.06"))
    assert _premade(new) == _premade(old)
    assert _premade(old)[0] == EXPECTED_PREMADE[0]


@pytest.mark.parametrize(
    ("driver", "missing"), [("535.261.03", True), ("570.124.06", True), ("580.65.06", False)]
)
def test_simulated_node_lacks_profile_info_by_id_below_580(driver: str, missing: bool) -> None:
    nv, _ = simulated_nvml(parse_profile(yaml.safe_dump(_mig_doc(driver)), source="t.yaml"))
    nv.nvmlInit()
    try:
        h = nv.nvmlDeviceGetHandleByIndex(0)
        if missing:
            with pytest.raises(pynvml.NVMLError_FunctionNotFound):
                nv.nvmlDeviceGetGpuInstanceProfileInfoById(h, 9)
        else:
            assert int(nv.nvmlDeviceGetGpuInstanceProfileInfoById(h, 9).id) == 9
        # the lookup answers either way; an id no profile has is an error either way (the
        # fallback's is NotFound)
        assert int(gpu_instance_profile_info_by_id(nv, h, 9).id) == 9
        with pytest.raises(pynvml.NVMLError_NotFound if missing else pynvml.NVMLError):
            gpu_instance_profile_info_by_id(nv, h, 99)
    finally:
        nv.nvmlShutdown()


def test_nvlink_domains_without_fabric_info(base_doc: dict[str, Any]) -> None:
    """A 535 driver lacks nvmlDeviceGetGpuFabricInfoV: the GPUs' NVLink domains come from their
    own NVLink links (no cluster-wide fabric domain), and discovery does not fail."""
    cluster = "7f3c2a10-5b6e-4d8f-9a0b-1c2d3e4f5a6b"
    for g in base_doc["gpus"][:2]:
        g["fabric"] = {"clusterUuid": cluster, "cliqueId": 32766}
    base_doc["driverVersion"] = "535.261.03"
    base_doc["nvmlErrors"] = {"nvmlDeviceGetGpuFabricInfoV": "FunctionNotFound"}
    inv = discover_doc(base_doc)
    assert len(inv.gpus) == 4
    assert all(g.fabric is None for g in inv.gpus)
    assert all(g.nvlink_domain and not g.nvlink_domain.startswith(cluster) for g in inv.gpus)


def test_numa_node_left_out_without_get_numa_node_id(base_doc: dict[str, Any]) -> None:
    """A 535 driver lacks nvmlDeviceGetNumaNodeId: the numaNode attribute is left out, the rest of
    the GPU is published."""
    base_doc["driverVersion"] = "535.261.03"
    base_doc["nvmlErrors"] = {"nvmlDeviceGetNumaNodeId": "FunctionNotFound"}
    inv = discover_doc(base_doc)
    assert len(inv.gpus) == 4
    assert all(g.numa_node is None for g in inv.gpus)
    assert all(g.memory_bytes and g.uuid for g in inv.gpus)


def test_registry_entries_are_well_formed() -> None:
    for symbol, fb in FALLBACKS.items():
        assert symbol.startswith("nvml"), symbol
        assert fb.since >= 500, (symbol, fb.since)
        assert fb.test.startswith("tests/") and "::" in fb.test, (symbol, fb.test)
    assert driver_branch("535.261.03") == 535
    assert not exported_in(BY_ID, "550.163.01") and exported_in(BY_ID, "580.65.06")
    assert exported_in("nvmlDeviceGetCount_v2", "535.261.03")
