"""Counters in validate / explain, modelled as the scheduler does: MIG placements of one GPU that
overlap exclude each other, also across claims. A dynamic-MIG GPU is not offered whole."""

from __future__ import annotations

from typing import Any

from simnode.fake import discover_node

from dra_gpu.controller.commands import explain_inputs
from dra_gpu.controller.inputs import Inputs
from dra_gpu.controller.rules import Validator
from dra_gpu.node.slices import build_slices

from .objects import DRIVER, GPU_CLASS, allocated

MIG_SELECTOR = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "mig"'
MIG_CLASS: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": "mig.dra-gpu.io"},
    "spec": {"selectors": [{"cel": {"expression": MIG_SELECTOR}}]},
}
GPU0 = "gpu-0000-18-00-0"


def slices() -> list[dict[str, Any]]:
    return build_slices(discover_node("node-a", "dgx-h100-mig", dynamic_mig=True), DRIVER)


def profile(p: str) -> str:
    return f'device.attributes["{DRIVER}"].profile == "{p}"'


def mig_claim(name: str, *requests: tuple[str, str, int], same_gpu: bool = False) -> dict[str, Any]:
    reqs = [
        {
            "name": rname,
            "exactly": {
                "deviceClassName": "mig.dra-gpu.io",
                "count": count,
                "selectors": [{"cel": {"expression": profile(p)}}],
            },
        }
        for rname, p, count in requests
    ]
    devices: dict[str, Any] = {"requests": reqs}
    if same_gpu:
        devices["constraints"] = [{"matchAttribute": f"{DRIVER}/parentUUID"}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": devices},
    }


def explain(*objs: dict[str, Any]) -> list[dict[str, Any]]:
    inputs = Inputs()
    for o in [*slices(), GPU_CLASS, MIG_CLASS, *objs]:
        inputs.add(o, "test")
    result: list[dict[str, Any]] = explain_inputs(inputs)["claims"]
    return result


def test_two_3g_and_a_1g_on_one_h100_is_never_allocatable_and_says_why() -> None:
    v = Validator(DRIVER, slices(), [GPU_CLASS, MIG_CLASS], [])
    verdict = v.validate(mig_claim("c", ("big", "3g.40gb", 2), ("small", "1g.10gb", 1), same_gpu=True))
    assert not verdict.allowed
    text = "\n".join(verdict.lines())
    assert "can never be satisfied" in text and "share counters" in text
    assert "of gpu-0000-18-00-0-counters, which has 1" in text and "memory-slice-" in text
    # Two 3g.40gb alone fit one GPU; so do seven 1g.10gb, not eight.
    assert v.validate(mig_claim("ok", ("big", "3g.40gb", 2), same_gpu=True)).allowed
    assert v.validate(mig_claim("seven", ("s", "1g.10gb", 7), same_gpu=True)).allowed
    assert not v.validate(mig_claim("eight", ("s", "1g.10gb", 8), same_gpu=True)).allowed


def whole_gpu_claim(name: str, cel: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "gpu.dra-gpu.io",
                            "selectors": [{"cel": {"expression": cel}}],
                        },
                    }
                ]
            }
        },
    }


def test_first_fit_packs_one_gpu_and_counts_allocated_devices() -> None:
    (first,) = explain(mig_claim("a", ("s", "1g.10gb", 1)))
    assert first["devices"] == [f"{GPU0}-mig-1g10gb-0"]
    busy = allocated("busy", "node-a", [f"{GPU0}-mig-3g40gb-4", f"{GPU0}-mig-3g40gb-0"])
    all_of_gpu0 = mig_claim("all", ("s", "7g.80gb", 1))
    all_of_gpu0["spec"]["devices"]["requests"][0]["exactly"]["selectors"].append(
        {"cel": {"expression": f'device.attributes["{DRIVER}"].parentIndex == 0'}}
    )
    one, full = explain(busy, mig_claim("one", ("s", "1g.10gb", 1)), all_of_gpu0)
    # GPU 0 is full (two 3g.40gb): the 1g.10gb goes to GPU 1, the 7g.80gb of GPU 0 waits.
    assert one["devices"] == ["gpu-0000-2a-00-0-mig-1g10gb-0"]
    assert not full["allocatable"] and "taken by allocated devices" in full["reason"]
    v = Validator(DRIVER, slices(), [GPU_CLASS, MIG_CLASS], [busy])
    verdict = v.validate(all_of_gpu0)
    assert verdict.allowed  # satisfiable once the MIG devices are released
    assert any("right now" in line for line in verdict.warning_lines() + verdict.lines())


def test_a_dynamic_mig_gpu_is_never_allocated_whole() -> None:
    """In MIG mode without an instance a GPU runs no CUDA work: a dynamic-MIG node offers no
    whole GPU, so a claim for one is refused, saying no device matches."""
    v = Validator(DRIVER, slices(), [GPU_CLASS, MIG_CLASS], [])
    verdict = v.validate(whole_gpu_claim("whole", f'device.attributes["{DRIVER}"].index == 0'))
    assert not verdict.allowed
    assert "can never be satisfied" in "\n".join(verdict.lines())
