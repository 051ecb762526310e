"""The judge of NVIDIA's published devices against ours (e2e/tests/nvidia_judge.py) finds what
differs, matches devices by identity rather than name, and lets only listed exceptions pass."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

JUDGE = Path(__file__).resolve().parents[1] / "e2e" / "tests" / "nvidia_judge.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nvidia_judge", JUDGE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["nvidia_judge"] = module
    spec.loader.exec_module(module)
    return module


nj = _load()


def gpu(name: str, uuid: str, memory: str, **extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {"type": {"string": "gpu"}, "uuid": {"string": uuid}, **extra},
        "capacity": {"memory": {"value": memory}},
    }


def test_same_device_under_another_name_and_added_attributes_pass() -> None:
    theirs = gpu("gpu-0", "GPU-a", "81559Mi", brand={"string": "Nvidia"})
    ours = gpu("gpu-0000-18-00-0", "GPU-a", "85520809984", brand={"string": "Nvidia"}, index={"int": 0})
    ours["attributes"]["gpu.nvidia.com/extra"] = {"int": 1}
    found, excused, compared = nj.judge([theirs], [ours])
    assert (found, excused, compared) == ([], [], 4)


def test_a_value_a_type_a_capacity_and_a_device_that_differ_are_each_found() -> None:
    theirs = [
        gpu("gpu-0", "GPU-a", "80Gi", brand={"string": "Nvidia"}, numa={"int": 0}),
        gpu("gpu-1", "GPU-b", "80Gi"),
    ]
    ours = [gpu("x", "GPU-a", "79Gi", brand={"string": "NVIDIA"}, numa={"string": "0"})]
    found, _, _ = nj.judge(theirs, ours)
    assert {(f.device, f.what, f.key) for f in found} == {
        ("gpu-0", "attribute", "brand"),
        ("gpu-0", "attribute", "numa"),
        ("gpu-0", "capacity", "memory"),
        ("gpu-1", "device", "(device)"),
    }


def test_an_exception_excuses_only_what_it_names() -> None:
    theirs = [gpu("gpu-0", "GPU-a", "80Gi", addressingMode={"string": "HMM"})]
    ours = [gpu("x", "GPU-a", "80Gi")]
    mig_only = nj.Exception_("attribute", "addressingMode", "mig", "not for whole GPUs")
    found, excused, _ = nj.judge(theirs, ours, [mig_only])
    assert [f.key for f in found] == ["addressingMode"] and excused == []
    any_type = nj.Exception_("attribute", "addressingMode", None, "reason")
    found, excused, _ = nj.judge(theirs, ours, [any_type])
    assert found == [] and [f.key for f, _ in excused] == ["addressingMode"]


def test_placements_match_by_parent_profile_and_start() -> None:
    def placement(name: str) -> dict[str, Any]:
        return {
            "name": name,
            "attributes": {
                "type": {"string": "mig"},
                "parentUUID": {"string": "GPU-a"},
                "profile": {"string": "1g.10gb"},
            },
            "capacity": {"memory": {"value": "9984Mi"}},
        }

    theirs = [placement("gpu-0-mig-1g10gb-19-3"), placement("gpu-0-mig-1g10gb-19-4")]
    ours = [placement("gpu-0000-18-00-0-mig-1g10gb-3")]
    found, _, _ = nj.judge(theirs, ours)
    assert [(f.device, f.what) for f in found] == [("gpu-0-mig-1g10gb-19-4", "device")]
