"""`dra-gpu explain` honours the health taints the plugin publishes, and says which taint blocks a
device; a claim that tolerates the taint (with adminAccess, for diagnosis) still gets it."""

from __future__ import annotations

import copy
from typing import Any

from dra_gpu.controller.commands import explain_inputs
from dra_gpu.controller.inputs import Inputs
from tests.controller.objects import GPU_CLASS, NVLINK, claim, device_names, node_slices

TAINT = {"key": "gpu.dra-gpu.io/unhealthy", "value": "xid-79", "effect": "NoExecute"}


def tainted_hgx(index: int) -> list[dict[str, Any]]:
    slices = copy.deepcopy(node_slices())
    slices[0]["spec"]["devices"][index]["taints"] = [dict(TAINT)]
    return slices


def run(slices: list[dict[str, Any]], *objs: dict[str, Any]) -> list[dict[str, Any]]:
    inputs = Inputs()
    for o in [*slices, GPU_CLASS, *objs]:
        inputs.add(o, "test")
    result: list[dict[str, Any]] = explain_inputs(inputs)["claims"]
    return result


def test_a_tainted_gpu_is_avoided_and_named() -> None:
    slices = tainted_hgx(2)
    names = device_names(slices)
    four, five, eight = run(
        slices,
        claim("four", 4, constraints=NVLINK),
        claim("five", 5, constraints=NVLINK),
        claim("eight", 8),
    )
    assert four["allocatable"] and four["devices"] == names[4:8]
    assert not five["allocatable"]
    assert f"{names[2]} gpu.dra-gpu.io/unhealthy=xid-79:NoExecute" in five["reason"]
    assert not eight["allocatable"]
    assert "at most 7 match" in eight["reason"] and "tainted, not tolerated" in eight["reason"]


def test_a_claim_that_tolerates_the_taint_gets_the_device() -> None:
    slices = tainted_hgx(2)
    names = device_names(slices)
    index2 = ["device.attributes['gpu.dra-gpu.io'].index == 2"]
    diag = claim("diag", 1, selectors=index2)
    request = diag["spec"]["devices"]["requests"][0]["exactly"]
    request["adminAccess"] = True
    request["tolerations"] = [{"key": TAINT["key"], "operator": "Exists"}]
    plain, tolerated = run(slices, claim("plain", 1, selectors=index2), diag)
    assert not plain["allocatable"] and "xid-79:NoExecute" in plain["reason"]
    assert tolerated["allocatable"] and tolerated["devices"] == [names[2]]


def test_validate_warns_but_never_rejects_for_a_taint() -> None:
    from dra_gpu.controller.rules import Validator

    slices = tainted_hgx(2)
    validator = Validator("gpu.dra-gpu.io", slices, [GPU_CLASS])
    verdict = validator.validate(claim("eight", 8))
    assert verdict.allowed, verdict
    (warning,) = [w for w in verdict.warnings if "right now" in str(w)]
    assert "gpu.dra-gpu.io/unhealthy=xid-79:NoExecute" in str(warning)
    assert not validator.validate(claim("nine", 9)).allowed  # more GPUs than the node has: never
