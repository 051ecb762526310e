"""Inventory -> ResourceSlices: contract attributes, MIG devices, API limits, splitting."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pynvml
import pytest
from conftest import bus, discover_doc, gpu_uuid
from simnode.fake import discover_node

from dra_gpu.kube.values import format_quantity
from dra_gpu.model.attributes import cuda_version, normalise_version
from dra_gpu.node.slices import PACKING_RANKS, SliceLimitError, build_slices, packing_rank, validate_device

GPU_ATTRIBUTES = {
    "type",
    "uuid",
    "productName",
    "brand",
    "architecture",
    "index",
    "minor",
    "cudaComputeCapability",
    "driverVersion",
    "cudaDriverVersion",
    "numaNode",
    "nvlinkDomain",
    "nvlinkDomainSize",
    "packingRank",
    "resource.kubernetes.io/pciBusID",
    "resource.kubernetes.io/numaNode",
    "resource.kubernetes.io/pcieRoot",
}


def devices(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for s in slices for d in s["spec"].get("devices") or []]


def attr(dev: dict[str, Any], name: str) -> Any:
    (value,) = dev["attributes"][name].values()
    return value


def test_hgx_slice_has_every_contract_attribute() -> None:
    slices = build_slices(discover_node("node-a", "hgx-2x4"))
    assert len(slices) == 1
    spec = slices[0]["spec"]
    assert spec["driver"] == "gpu.dra-gpu.io"
    assert spec["nodeName"] == "node-a"
    assert spec["pool"] == {"name": "node-a", "generation": 1, "resourceSliceCount": 1}
    devs = devices(slices)
    assert len(devs) == 8
    for dev in devs:
        assert set(dev["attributes"]) == GPU_ATTRIBUTES
        assert dev["capacity"]["memory"] == {"value": "81559Mi"}
        assert attr(dev, "type") == "gpu"
        assert attr(dev, "productName") == "NVIDIA H100 80GB HBM3"
        assert attr(dev, "cudaComputeCapability") == "9.0.0"
        assert attr(dev, "cudaDriverVersion") == "12.8.0"
    by_index = {attr(d, "index"): attr(d, "nvlinkDomain") for d in devs}
    assert len({by_index[i] for i in range(4)}) == 1
    assert len({by_index[i] for i in range(4, 8)}) == 1
    assert by_index[0] != by_index[4]


def test_packing_rank_is_the_nodes_on_every_whole_gpu_and_stable() -> None:
    """One rank a node, a hash of its name: the same on every whole GPU, across builds and
    generations, whatever the profile; MIG devices carry none."""
    for profile in ("hgx-2x4", "dgx-h100", "mixed", "pcie-pairs"):
        for node in ("node-a", "gpu-017"):
            slices = build_slices(discover_node(node, profile), generation=3)
            assert {attr(d, "packingRank") for d in devices(slices)} == {packing_rank(node)}
    assert all(
        "packingRank" not in d["attributes"]
        for d in devices(build_slices(discover_node("n", "dgx-a100-mig")))
        if attr(d, "type") == "mig"
    )
    # pinned: a rank that moved with a release would reshuffle every cluster's fill order
    assert [packing_rank(f"gpu-{i:03d}") for i in range(8)] == PINNED_RANKS


PINNED_RANKS = [1, 1, 7, 5, 7, 7, 4, 7]


def test_packing_ranks_spread_evenly_over_a_clusters_nodes() -> None:
    counts = [0] * PACKING_RANKS
    for i in range(4000):
        counts[packing_rank(f"gpu-{i:04d}")] += 1
    assert all(400 <= c <= 600 for c in counts), counts
    for name in ("a", "node-a", "x" * 253, "ip-10-0-0-1.ec2.internal"):
        assert 0 <= packing_rank(name) < PACKING_RANKS


def test_device_names_are_stable_dns_labels_not_indexes(base_doc: dict) -> None:
    first = {attr(d, "uuid"): d["name"] for d in devices(build_slices(discover_doc(base_doc)))}
    # Same GPUs enumerated in reverse order (the index changed): the names must not.
    for pos, g in enumerate(reversed(base_doc["gpus"])):
        g["index"] = pos
    second = {attr(d, "uuid"): d["name"] for d in devices(build_slices(discover_doc(base_doc)))}
    assert first == second
    assert first[gpu_uuid(0)] == "gpu-0000-10-00-0"


def test_mig_devices_are_published_and_mig_parents_are_not() -> None:
    inv = discover_node("node-a", "dgx-a100-mig")
    devs = devices(build_slices(inv))
    migs = [d for d in devs if attr(d, "type") == "mig"]
    gpus = [d for d in devs if attr(d, "type") == "gpu"]
    assert len(gpus) == 5 and len(migs) == 2 + 5 + 3
    parents = {g.uuid: g for g in inv.gpus if g.mig_enabled}
    assert {attr(m, "parentUUID") for m in migs} == set(parents)
    assert not {attr(g, "uuid") for g in gpus} & set(parents)
    three_g = [m for m in migs if attr(m, "profile") == "3g.40gb"]
    assert len(three_g) == 3
    for m in three_g:
        assert m["capacity"]["memory"] == {"value": "40192Mi"}
        assert m["capacity"]["multiprocessors"] == {"value": "42"}
        assert attr(m, "uuid").startswith("MIG-")
        assert attr(m, "productName") == "NVIDIA A100-SXM4-80GB"
        assert "nvlinkDomain" not in m["attributes"]
    assert {attr(m, "profile") for m in migs} == {"3g.40gb", "2g.20gb", "1g.10gb"}
    assert "gpu-0000-07-00-0-mig-3g40gb-4" in {m["name"] for m in migs}


def test_driver_version_with_leading_zero_becomes_semver() -> None:
    devs = devices(build_slices(discover_node("node-a", "dgx-a100-mig")))  # driver 570.124.06
    assert {attr(d, "driverVersion") for d in devs} == {"570.124.6"}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("535.161.08", "535.161.8"),
        ("580.159.04", "580.159.4"),
        ("550.54", "550.54.0"),
        ("570.133.20", "570.133.20"),
    ],
)
def test_normalise_version(raw: str, expected: str) -> None:
    assert normalise_version(raw) == expected


def test_version_helpers() -> None:
    assert cuda_version(12080) == "12.8.0" and cuda_version(13000) == "13.0.0"
    assert format_quantity(80 << 30) == "80Gi" and format_quantity(81559 << 20) == "81559Mi"
    assert format_quantity(1000) == "1000"
    with pytest.raises(ValueError, match="not a numeric version"):
        normalise_version("570.x")


def good_device(**attrs: Any) -> dict[str, Any]:
    return {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}, **attrs}, "capacity": {}}


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ({"name": "GPU_0", "attributes": {}}, "DNS label"),
        ({"name": "g" * 64, "attributes": {}}, "DNS label"),
        (good_device(productName={"string": "x" * 65}), "<= 64 bytes"),
        (good_device(driverVersion={"version": "535.161.08"}), "not a valid semantic version"),
        (good_device(**{"bad-name": {"string": "x"}}), "C identifier"),
        (good_device(**{"Bad_Domain/x": {"string": "x"}}), "DNS subdomain"),
        (good_device(**{"a" * 33: {"int": 1}}), "C identifier of <= 32"),
        (good_device(x={"int": 1, "string": "a"}), "exactly one"),
        (good_device(x={"int": True}), "not an int64"),
        (good_device(x={"int": 2**63}), "not an int64"),
        (good_device(x={"float": 1.5}), "unknown value type"),
        (good_device(**{f"a{i}": {"int": i} for i in range(32)}), r"33 attributes \+ capacities"),
    ],
)
def test_device_limits_are_enforced(device: dict[str, Any], message: str) -> None:
    with pytest.raises(SliceLimitError, match=message) as err:
        validate_device(device)
    assert device["name"] in str(err.value)


def test_thirty_two_attributes_are_allowed() -> None:
    validate_device(good_device(**{f"a{i}": {"int": i} for i in range(31)}))


def big_node_doc(base_doc: dict, gpus: int) -> dict:
    """`gpus` A100s, each split into seven 1g.10gb MIG devices."""
    base_doc["migProfiles"] = [
        {"name": "1g.10gb", "id": 19, "index": 0, "slices": 1, "memoryMiB": 9856, "multiprocessors": 14}
    ]
    base_doc["gpus"] = [
        {
            "index": i,
            "uuid": gpu_uuid(i),
            "pciBusId": bus(i),
            "mig": {"enabled": True, "instances": [{"profile": "1g.10gb", "placement": p} for p in range(7)]},
        }
        for i in range(gpus)
    ]
    return base_doc


def test_pool_with_more_than_128_devices_is_split(base_doc: dict) -> None:
    inv = discover_doc(big_node_doc(base_doc, 20))  # 140 MIG devices
    slices = build_slices(inv, generation=3)
    assert [len(s["spec"]["devices"]) for s in slices] == [128, 12]
    for s in slices:
        assert s["spec"]["pool"] == {"name": "node-a", "generation": 3, "resourceSliceCount": 2}
    names = [d["name"] for d in devices(slices)]
    assert len(names) == len(set(names)) == 140
    assert len({s["metadata"]["name"] for s in slices}) == 2


def test_exactly_128_devices_fit_one_slice(base_doc: dict) -> None:
    doc = big_node_doc(base_doc, 19)  # 133 -> trim one GPU's instances to reach 128
    doc["gpus"][-1]["mig"]["instances"] = doc["gpus"][-1]["mig"]["instances"][:2]
    slices = build_slices(discover_doc(doc))
    assert len(slices) == 1 and len(slices[0]["spec"]["devices"]) == 128


def test_invalid_node_or_driver_name_is_rejected() -> None:
    inv = discover_node("Node_A", "mixed")
    with pytest.raises(SliceLimitError, match="node name 'Node_A'"):
        build_slices(inv)
    with pytest.raises(SliceLimitError, match="driver name"):
        build_slices(discover_node("node-a", "mixed"), driver="GPU/Driver")


def test_memory_shares_publish_whole_gpus_with_request_policies() -> None:
    from simnode.fake import discover_node

    from dra_gpu.node.slices import build_slices as build

    inv = discover_node("node-a", "hgx-2x4")
    (dev, *_) = build(inv, memory_shares=True)[0]["spec"]["devices"]
    assert dev["allowMultipleAllocations"] is True
    memory = dev["capacity"]["memory"]
    assert memory["value"] == "81559Mi"
    # The range's max and the default are whole steps from min (the apiserver checks it).
    assert memory["requestPolicy"] == {
        "default": "79Gi",
        "validRange": {"min": "1Gi", "max": "79Gi", "step": "1Gi"},
    }
    assert dev["capacity"]["computeShare"]["requestPolicy"]["default"] == "0"
    assert "multiprocessors" not in dev["capacity"]  # unconstrained, it would be consumed whole
    plain = build(inv)[0]["spec"]["devices"][0]
    assert "allowMultipleAllocations" not in plain


def _documented_capacities(device: str) -> set[str]:
    """The capacities the device table of docs/claims-and-examples.md lists for `device` ("whole
    GPU", "MIG device")."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "claims-and-examples.md").read_text()
    (row,) = [line for line in page.splitlines() if line.startswith(f"| {device} |")]
    cell = row.rsplit("|", 2)[1]
    names = set(re.findall(r"`(\w+)`", cell))
    if "`memorySlice<i>` (i = 0..7)" in cell:
        names |= {f"memorySlice{i}" for i in range(8)}
    return names


@pytest.mark.parametrize("profile", ["hgx-2x4", "dgx-h100", "dgx-a100-mig", "mixed", "pcie-pairs"])
def test_whole_gpus_publish_the_capacities_the_docs_list_and_no_sm_count(profile: str) -> None:
    """NVML gives no whole GPU's SM count (nvmlDeviceGetAttributes answers NOT_SUPPORTED but for
    MIG devices): `multiprocessors` is left out on whole GPUs, not guessed, and the docs say so."""
    from simnode.fake import FakeNvml
    from simnode.profiles import load_profile

    nvml = FakeNvml(load_profile(profile))
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetAttributes(handle)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetAttributes_v2(handle)
    devs = devices(build_slices(discover_node("node-a", profile)))
    whole = [d for d in devs if attr(d, "type") == "gpu"]
    assert whole
    for dev in whole:
        assert "multiprocessors" not in dev["capacity"]
        assert set(dev["capacity"]) == _documented_capacities("whole GPU")
    for dev in devs:
        if attr(dev, "type") == "mig":
            assert set(dev["capacity"]) <= _documented_capacities("MIG device")
            assert "multiprocessors" in dev["capacity"]


def test_what_an_apiserver_without_the_gates_gets_instead() -> None:
    """Taints dropped: a failed GPU is left out (nothing else keeps claims off it). Counters
    dropped: no dynamic-MIG placement, no counter set (overlapping placements would be allocated
    together); whole GPUs stay."""
    from dra_gpu.node.catalog import DeviceCatalog
    from dra_gpu.node.slices import SliceBuilder

    builder = SliceBuilder(DeviceCatalog.build(discover_node("node-a", "dgx-h100-mig", dynamic_mig=True)))
    full = builder.slices()
    placements = [d["name"] for d in devices(full) if d.get("consumesCounters")]
    assert placements and any(s["spec"].get("sharedCounters") for s in full)
    without = builder.slices(counters=False)
    assert not any(s["spec"].get("sharedCounters") for s in without)
    assert not any(d.get("consumesCounters") for d in devices(without))
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in without} == {len(without)}

    hgx = SliceBuilder(DeviceCatalog.build(discover_node("node-a", "hgx-2x4")))
    first = devices(hgx.slices())[0]["name"]
    taint = {"key": "gpu.dra-gpu.io/unhealthy", "value": "xid-79", "effect": "NoExecute"}
    kept = devices(hgx.slices(taints={first: [taint]}))
    assert kept[0]["name"] == first and kept[0]["taints"] == [taint]
    withdrawn = devices(hgx.slices(taints={first: [taint]}, withdraw_tainted=True))
    assert first not in [d["name"] for d in withdrawn] and len(withdrawn) == len(kept) - 1
    informational = {**taint, "effect": "None"}
    assert len(devices(hgx.slices(taints={first: [informational]}, withdraw_tainted=True))) == len(kept)


def test_the_1_34_layout_keeps_each_counter_set_beside_its_placements() -> None:
    """1.34 refuses a device whose counter set is in another slice, and more than 32 counters a
    slice (1.35+ refuses a slice with both): one GPU's placements and its set a slice."""
    from dra_gpu.node.catalog import DeviceCatalog
    from dra_gpu.node.slices import SliceBuilder

    builder = SliceBuilder(DeviceCatalog.build(discover_node("node-a", "dgx-h100-mig", dynamic_mig=True)))
    default, old = builder.slices(), builder.slices(counters_beside_devices=True)
    assert sorted(d["name"] for d in devices(default)) == sorted(d["name"] for d in devices(old))
    for s in old:
        sets = {cs["name"]: cs for cs in s["spec"].get("sharedCounters") or []}
        assert sum(len(cs["counters"]) for cs in sets.values()) <= 32
        used = {c["counterSet"] for d in s["spec"]["devices"] for c in d.get("consumesCounters") or []}
        assert used == set(sets)  # every set referenced is here, and only those
        assert len(s["spec"]["devices"]) <= 128
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in old} == {len(old)}


def test_static_mig_devices_name_the_memory_slices_they_hold() -> None:
    """As NVIDIA's driver publishes them: `memorySlice<i>` = 1 for each memory slice of the GPU
    the instance holds (placement start .. start + size), nothing for the slices it does not."""
    inv = discover_node("node-a", "dgx-a100-mig")
    held = {
        gpu.mig_device_name(m): set(range(m.placement_start, m.placement_start + m.placement_size))
        for gpu in inv.gpus
        for m in gpu.mig_devices
    }
    assert held
    seen = 0
    for dev in devices(build_slices(inv)):
        if dev["name"] in held:
            names = [k for k in dev["capacity"] if k.startswith("memorySlice")]
            slices = {int(k.removeprefix("memorySlice")) for k in names}
            assert slices == held[dev["name"]], dev["name"]
            assert all(dev["capacity"][f"memorySlice{i}"] == {"value": "1"} for i in slices)
            seen += 1
    assert seen == len(held)


@pytest.mark.parametrize(("mode", "published"), [(None, None), (1, "HMM"), (2, "ATS"), (0, "None")])
def test_addressing_mode_is_published_where_nvml_gives_it(mode: int | None, published: str | None) -> None:
    """NVML 13 (driver 580+) has nvmlDeviceGetAddressingMode; NVIDIA's driver publishes it as
    `addressingMode` on GPUs and their MIG devices. A library without it (every driver before
    580, so the simulated ones) gives no attribute, never a guess."""
    from simnode.fake import simulated_nvml
    from simnode.profiles import load_profile

    from dra_gpu.discovery.nvml_discovery import discover

    nvml, pcie_root = simulated_nvml(load_profile("dgx-a100-mig"))
    if mode is not None:
        nvml.nvmlDeviceGetAddressingMode = lambda handle: mode
    else:  # what pynvml does over a library without the function (every driver before 580)

        def missing(handle: object) -> int:
            raise nvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

        nvml.nvmlDeviceGetAddressingMode = missing
    devs = devices(build_slices(discover(nvml, "node-a", pcie_root)))
    assert {d["attributes"].get("addressingMode", {}).get("string") for d in devs} == {published}
    assert {attr(d, "type") for d in devs} == {"gpu", "mig"}
