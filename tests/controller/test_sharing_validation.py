"""Validation of memory shares (consumable capacity, request-policy rounding) and of sharing
configs the devices cannot take."""

from __future__ import annotations

from typing import Any

from simnode.fake import discover_node

from dra_gpu.controller.published_devices import policy_amount
from dra_gpu.controller.rules import ProblemKind, Validator
from dra_gpu.kube.values import parse_quantity
from dra_gpu.model.config import API_VERSION
from dra_gpu.node.slices import build_slices

from .objects import DRIVER, GPU_CLASS, claim

MIG_SELECTOR = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "mig"'
MIG_CLASS: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": "mig.dra-gpu.io"},
    "spec": {"selectors": [{"cel": {"expression": MIG_SELECTOR}}]},
}


def shares_slices() -> list[dict[str, Any]]:
    """dgx-a100-mig: whole A100 80GB GPUs published as memory shares."""
    return build_slices(discover_node("node-a", "dgx-a100-mig"), DRIVER, memory_shares=True)


def memory_claim(name: str, memory: str) -> dict[str, Any]:
    c = claim(name)
    c["spec"]["devices"]["requests"][0]["exactly"]["capacity"] = {"requests": {"memory": memory}}
    return c


def share(name: str, device: str, memory: str) -> dict[str, Any]:
    c = memory_claim(name, memory)
    c["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "gpus",
                        "driver": DRIVER,
                        "pool": "node-a",
                        "device": device,
                        "shareID": f"00000000-0000-4000-8000-{len(name):012d}",
                        "consumedCapacity": {"memory": memory, "computeShare": "0"},
                    }
                ]
            }
        }
    }
    return c


def q(s: str) -> Any:
    return parse_quantity(s)


def test_request_policy_rounds_up_to_min_and_step_and_refuses_above_max() -> None:
    policy = {"default": "80Gi", "validRange": {"min": "1Gi", "max": "80Gi", "step": "1Gi"}}
    assert policy_amount(q("100Mi"), q("80Gi"), policy) == q("1Gi")
    assert policy_amount(q("20500Mi"), q("80Gi"), policy) == q("21Gi")
    assert policy_amount(None, q("80Gi"), policy) == q("80Gi")
    assert policy_amount(q("81Gi"), q("80Gi"), policy) is None
    assert policy_amount(q("3"), q("10"), {"default": "2", "validValues": ["2", "4", "8"]}) == q("4")


def test_a_share_no_gpu_can_ever_give_is_denied() -> None:
    verdict = Validator(DRIVER, shares_slices(), [GPU_CLASS]).validate(memory_claim("big", "90Gi"))
    assert not verdict.allowed
    (problem,) = verdict.errors
    assert problem.kind is ProblemKind.UNSATISFIABLE
    assert "no GPU can ever give memory 90Gi (largest: memory 80Gi)" in problem.message


def test_a_share_that_fits_only_once_others_are_gone_is_a_warning() -> None:
    slices = shares_slices()
    gpus = [d["name"] for s in slices for d in s["spec"]["devices"] if d.get("allowMultipleAllocations")]
    busy = [share(f"s{i}", g, "40Gi") for i, g in enumerate(gpus)]  # every GPU half used
    verdict = Validator(DRIVER, slices, [GPU_CLASS], busy).validate(memory_claim("c", "48Gi"))
    assert verdict.allowed
    (warning,) = verdict.warnings
    assert warning.kind is ProblemKind.IN_USE
    assert "no GPU has memory 48Gi free right now (most free: memory 40Gi)" in warning.message
    # 40Gi still fits next to each 40Gi share: two shares on one GPU.
    assert Validator(DRIVER, slices, [GPU_CLASS], busy).validate(memory_claim("c", "40Gi")).warnings == []


def config(sharing: dict[str, Any], kind: str = "GpuConfig") -> list[dict[str, Any]]:
    params = {"apiVersion": API_VERSION, "kind": kind, "sharing": sharing}
    return [{"requests": ["gpus"], "opaque": {"driver": DRIVER, "parameters": params}}]


def test_time_slicing_for_a_mig_request_is_denied() -> None:
    slices = build_slices(discover_node("node-a", "dgx-a100-mig"), DRIVER)
    c = claim("ts", config=config({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}))
    c["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "mig.dra-gpu.io"
    verdict = Validator(DRIVER, slices, [GPU_CLASS, MIG_CLASS]).validate(c)
    assert not verdict.allowed
    assert any(
        e.path == "spec.devices.config[0]" and "TimeSlicing cannot be set on MIG device" in e.message
        for e in verdict.errors
    ), verdict.errors


def test_mps_limits_below_compute_capability_7_are_denied() -> None:
    inv = discover_node("node-a", "hgx-2x4")
    for gpu in inv.gpus:
        gpu.cuda_compute_capability = (6, 0)
    slices = build_slices(inv, DRIVER)
    c = claim("mps", config=config({"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 50}}))
    verdict = Validator(DRIVER, slices, [GPU_CLASS]).validate(c)
    assert not verdict.allowed
    assert any("compute capability 6.0; MPS limits need 7.0" in e.message for e in verdict.errors), (
        verdict.errors
    )
    plain = claim("mps", config=config({"strategy": "MPS"}))  # no limits: fine on any GPU
    assert Validator(DRIVER, slices, [GPU_CLASS]).validate(plain).allowed


def test_explain_shows_what_a_share_consumes_after_rounding() -> None:
    from dra_gpu.controller.commands import explain_inputs, render_text
    from dra_gpu.controller.inputs import Inputs

    inputs = Inputs(slices=shares_slices(), classes=[GPU_CLASS], claims=[memory_claim("c", "20500Mi")])
    (entry,) = explain_inputs(inputs, DRIVER)["claims"]
    assert entry["allocatable"]
    (result,) = entry["results"]
    assert result["consumedCapacity"] == {"computeShare": "0", "memory": "21Gi"}  # rounded up to 1Gi steps
    assert "a share consuming computeShare 0, memory 21Gi" in render_text({"claims": [entry]})
