"""Dynamic MIG on the simulated H100 node: the fake's placement rules, discovery of profiles and
placements, and the published counters and devices (1.35+ slice rules)."""

from __future__ import annotations

import ctypes
from decimal import Decimal
from pathlib import Path

import pynvml
import pytest
from simnode.fake import simulated_nvml
from simnode.fake_mig import MigStateError, SimulatedMig
from simnode.fake_nvml import FakeNvml
from simnode.profiles import load_profile

from dra_gpu.discovery import discover
from dra_gpu.model.inventory import Gpu, MigPlacement
from dra_gpu.node.dynamic_mig import counter_totals, placement_consumption
from dra_gpu.node.slices import build_slices

PROFILE = "dgx-h100-mig"


def _fake(root: Path | None = None) -> FakeNvml:
    nv = FakeNvml(load_profile(PROFILE), root)
    nv.nvmlInit()
    return nv


def _create(nv: FakeNvml, gpu: int, profile_id: int, start: int, size: int) -> object:
    h = nv.nvmlDeviceGetHandleByIndex(gpu)
    placement = pynvml.c_nvmlGpuInstancePlacement_t()
    placement.start, placement.size = start, size
    return nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, profile_id, ctypes.byref(placement))


def _inventory(dynamic: bool = True):
    nv, root = simulated_nvml(load_profile(PROFILE))
    return discover(nv, "node-a", root, dynamic_mig=dynamic)


def test_profiles_and_placements_are_the_real_h100_ones():
    gpu = _inventory().gpus[0]
    got = {p.name: (p.profile_id, p.compute_slices, p.memory_slices, p.placements) for p in gpu.mig_profiles}
    assert got == {
        "1g.10gb": (19, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
        "1g.20gb": (15, 1, 2, (0, 2, 4, 6)),
        "2g.20gb": (14, 2, 2, (0, 2, 4)),
        "3g.40gb": (9, 3, 4, (0, 4)),
        "4g.40gb": (5, 4, 4, (0,)),
        "7g.80gb": (0, 7, 8, (0,)),
    }
    assert gpu.dynamic_mig and gpu.mig_devices == []
    assert not _inventory(dynamic=False).gpus[0].dynamic_mig


def test_fake_refuses_overlap_and_maxima_and_keeps_state_in_its_root(tmp_path: Path):
    nv = _fake(tmp_path)
    gi = _create(nv, 0, 9, 0, 4)  # 3g.40gb at 0
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        _create(nv, 0, 5, 0, 4)  # 4g.40gb at 0 overlaps
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        _create(nv, 0, 19, 3, 1)  # 1g.10gb at 3 overlaps slices 0-3
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        _create(nv, 0, 14, 6, 2)  # 2g.20gb has no placement at 6
    ci = nv.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    gi_id = nv.nvmlGpuInstanceGetInfo(gi).id
    caps = tmp_path / "proc/driver/nvidia/capabilities/gpu0/mig" / f"gi{gi_id}"
    assert (caps / "access").exists() and (caps / "ci0" / "access").exists()
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(nv.nvmlDeviceGetHandleByIndex(0), 0)
    uuid = nv.nvmlDeviceGetUUID(mig)
    assert uuid.startswith("MIG-")
    # A new process (plugin restart) sees the same instances: the state is in the root.
    again = _fake(tmp_path)
    h = again.nvmlDeviceGetHandleByIndex(0)
    assert again.nvmlDeviceGetUUID(again.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)) == uuid
    gi2 = again.nvmlDeviceGetGpuInstanceById(h, gi_id)
    with pytest.raises(pynvml.NVMLError_InUse):
        again.nvmlGpuInstanceDestroy(gi2)  # its compute instance first
    again.nvmlComputeInstanceDestroy(again.nvmlGpuInstanceGetComputeInstanceById(gi2, 0))
    again.nvmlGpuInstanceDestroy(gi2)
    assert not caps.exists()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        again.nvmlGpuInstanceDestroy(gi2)  # a destroyed instance's handle is stale
    del ci
    assert _fake(tmp_path).mig.gpus[load_profile(PROFILE).gpus[0].uuid] == []


def test_fake_can_be_told_to_fail_a_step():
    nv = _fake()
    nv.fail_next("nvmlGpuInstanceCreateComputeInstance", pynvml.NVML_ERROR_UNKNOWN)
    gi = _create(nv, 0, 19, 6, 1)
    with pytest.raises(pynvml.NVMLError_Unknown):
        nv.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    nv.nvmlGpuInstanceCreateComputeInstance(gi, 0)  # once only


def _fits_counters(gpu: Gpu, chosen: list[MigPlacement]) -> bool:
    totals = counter_totals(gpu)
    used: dict[str, int] = {}
    for p in chosen:
        for k, v in placement_consumption(gpu, p).items():
            used[k] = used.get(k, 0) + v
    return all(v <= totals[k] for k, v in used.items())


_NODE = load_profile(PROFILE)


def _fake_accepts(chosen: list[MigPlacement]) -> bool:
    state = SimulatedMig(_NODE)
    try:
        for p in chosen:
            state.create_gpu_instance(_NODE.gpus[0], p.profile.profile_id, p.start, p.profile.memory_slices)
    except MigStateError as exc:
        assert exc.code == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
        return False
    return True


def test_counters_allow_exactly_what_the_gpu_allows():
    """Every set of placements the counters admit, the GPU can create, and the reverse
    (exhaustive over one H100's 18 placements; both properties are closed under subsets)."""
    gpu = _inventory().gpus[0]
    placements = gpu.mig_placements()
    checked = 0

    def grow(chosen: list[MigPlacement], start: int, fits: object) -> None:
        nonlocal checked
        for i in range(start, len(placements)):
            more = [*chosen, placements[i]]
            a, b = _fits_counters(gpu, more), _fake_accepts(more)
            checked += 1
            assert a == b, f"counters say {a}, the GPU says {b}: {[(p.profile.name, p.start) for p in more]}"
            if a:
                grow(more, i + 1, fits)

    grow([], 0, None)
    assert checked > 100


def test_slices_follow_the_135_rules():
    slices = build_slices(_inventory())
    counters = [s for s in slices if "sharedCounters" in s["spec"]]
    device_slices = [s for s in slices if "devices" in s["spec"]]
    assert len(counters) == 1 and len(counters[0]["spec"]["sharedCounters"]) == 8
    assert all("devices" not in s["spec"] for s in counters)
    assert all(len(s["spec"]["devices"]) <= 64 for s in device_slices)
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {len(slices)}
    devices = [d for s in device_slices for d in s["spec"]["devices"]]
    assert len(devices) == 8 * 18  # 18 placements each, no whole GPU
    sets = {c["name"]: c["counters"] for c in counters[0]["spec"]["sharedCounters"]}
    by_name = {d["name"]: d for d in devices}
    three = by_name["gpu-0000-18-00-0-mig-3g40gb-4"]
    assert "uuid" not in three["attributes"]
    (use,) = three["consumesCounters"]
    assert use["counterSet"] == "gpu-0000-18-00-0-counters"
    assert {k for k in use["counters"] if k.startswith("memory-slice")} == {
        f"memory-slice-{i}" for i in range(4, 8)
    }
    seven = by_name["gpu-0000-18-00-0-mig-7g80gb-0"]["consumesCounters"][0]["counters"]
    assert {k for k in seven if k.startswith("memory-slice")} == {
        k for k in sets["gpu-0000-18-00-0-counters"] if k.startswith("memory-slice")
    }


def test_a_dynamic_mig_gpu_is_not_offered_whole():
    """A GPU in MIG mode with no instance runs no CUDA work: a dynamic-MIG GPU is offered as its
    placements only (its full-GPU profile, 7g.80gb, is the way to all of it), never as a
    type=gpu device a pod would get and find unusable."""
    inv = _inventory()
    devices = [d for s in build_slices(inv) for d in s["spec"].get("devices") or []]
    assert {d["attributes"]["type"]["string"] for d in devices} == {"mig"}
    assert not {g.device_name for g in inv.gpus} & {d["name"] for d in devices}


def test_order_small_from_the_low_end_large_from_the_high_end_7g_from_the_last_gpu():
    slices = build_slices(_inventory())
    names = [d["name"] for s in slices for d in s["spec"].get("devices") or []]
    gpu0 = [n.removeprefix("gpu-0000-18-00-0-mig-") for n in names if n.startswith("gpu-0000-18-00-0-mig-")]
    assert gpu0[:7] == [f"1g10gb-{i}" for i in range(7)]
    assert gpu0.index("2g20gb-0") < gpu0.index("2g20gb-4")
    assert gpu0.index("3g40gb-4") < gpu0.index("3g40gb-0")
    # Partial profiles from the first GPU on; full-GPU ones (7g) from the last back.
    assert names.index("gpu-0000-18-00-0-mig-4g40gb-0") < names.index("gpu-0000-2a-00-0-mig-1g10gb-0")
    sevens = [n[: len("gpu-0000-18-00-0")] for n in names if n.endswith("-mig-7g80gb-0")]
    assert len(sevens) == 8 and sevens == sorted(sevens, reverse=True)
    assert names[-8:] == [f"{g}-mig-7g80gb-0" for g in sevens]
    assert not [n for n in names if "-mig-" not in n]


def test_memory_counter_is_the_gpu_memory():
    gpu = _inventory().gpus[0]
    assert counter_totals(gpu)["memory"] == 81559 << 20
    assert Decimal(counter_totals(gpu)["memory-slice-7"]) == 1
