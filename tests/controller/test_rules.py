"""Validation rules: a corpus of invalid objects with the message each must produce."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from dra_gpu.controller.rules import Validator

from .objects import DRIVER, GPU_CLASS, NVLINK, allocated, claim, device_names, node_slices

D = f'device.attributes["{DRIVER}"]'
C = f'device.capacity["{DRIVER}"]'
SEL = "spec.devices.requests[0].exactly.selectors[0].cel.expression"


def with_config(params: Any) -> dict[str, Any]:
    return claim("cfg", config=[{"opaque": {"driver": DRIVER, "parameters": params}}])


def device_class(**spec: Any) -> dict[str, Any]:
    c = copy.deepcopy(GPU_CLASS)
    c["metadata"]["name"] = "custom"
    c["spec"].update(spec)
    return c


CORPUS: list[tuple[str, dict[str, Any], str, str]] = [
    ("bad CEL", claim("c", selectors=[f"{D}.productName =="]), SEL, "does not compile: column"),
    (
        "undeclared function",
        claim("c", selectors=["gpuCount(device) > 1"]),
        SEL,
        "undeclared reference to 'gpuCount'",
    ),
    (
        "string vs int",
        claim("c", selectors=[f"{D}.productName == 1"]),
        SEL,
        "type error: found no matching overload for '_==_' applied to '(string, int)'",
    ),
    (
        "capacity vs int",
        claim("c", selectors=[f"{C}.memory.compareTo(40) >= 0"]),
        SEL,
        "applied to '(quantity, int)'",
    ),
    (
        "capacity compared with >=",
        claim("c", selectors=[f"{C}.memory >= 40"]),
        SEL,
        "'_>=_' applied to '(quantity, int)'",
    ),
    (
        "version vs quantity",
        claim("c", selectors=[f'{D}.driverVersion.isGreaterThan(quantity("1"))']),
        SEL,
        "applied to '(semver, quantity)'",
    ),
    ("not bool", claim("c", selectors=[f"{D}.index"]), SEL, "must evaluate to bool, evaluates to int"),
    (
        "unknown attribute",
        claim("c", selectors=[f'{D}.prodName == "x"']),
        SEL,
        f"unknown attribute {DRIVER}/prodName: did you mean 'productName'?",
    ),
    (
        "unknown attribute in has()",
        claim("c", selectors=[f"has({D}.nvlinkDomian)"]),
        SEL,
        "did you mean 'nvlinkDomain'?",
    ),
    (
        "unknown capacity",
        claim("c", selectors=[f'{C}.memroy.compareTo(quantity("1Gi")) > 0']),
        SEL,
        f"unknown capacity {DRIVER}/memroy: did you mean 'memory'?",
    ),
    (
        "unknown device field",
        claim("c", selectors=['device.drvier == "x"']),
        SEL,
        "unknown field device.drvier",
    ),
    ("too long", claim("c", selectors=[f'{D}.productName == "{"x" * 11000}"']), SEL, "the limit is 10240"),
    (
        "too costly",
        claim("c", selectors=[f"{D}.all(a, {D}.all(b, {D}.all(c, {D}.all(d, true))))"]),
        SEL,
        "exceeds the limit of 1000000",
    ),
    ("deeply nested", claim("c", selectors=["(" * 200 + "true" + ")" * 200]), SEL, "recursion limit"),
    (
        "impossible NVLink count",
        claim("c", 16, constraints=NVLINK),
        "spec.devices",
        "largest NVLink domain: 4 GPUs (node-a)",
    ),
    ("impossible count", claim("c", 9), "spec.devices", "needs 9 GPUs; at most 8 match on one node (node-a)"),
    (
        "memory too large",
        claim("c", selectors=[f'{C}.memory.compareTo(quantity("100Gi")) >= 0']),
        "spec.devices",
        "no GPU with memory >= 100Gi; largest: 81559Mi",
    ),
    ("count too big", claim("c", 64), "spec.devices.requests[0].exactly.count", "at most 32"),
    ("count zero", claim("c", 0), "spec.devices.requests[0].exactly.count", "must be a positive integer"),
    (
        "unqualified matchAttribute",
        claim("c", 2, constraints=[{"matchAttribute": "nvlinkDomain"}]),
        "spec.devices.constraints[0].matchAttribute",
        f"must be fully qualified, e.g. '{DRIVER}/nvlinkDomain'",
    ),
    (
        "unknown matchAttribute",
        claim("c", 2, constraints=[{"matchAttribute": f"{DRIVER}/nvlinkDomian"}]),
        "spec.devices.constraints[0].matchAttribute",
        "did you mean 'nvlinkDomain'?",
    ),
    (
        "unknown request in constraint",
        claim("c", 2, constraints=[{"requests": ["gpu"], "matchAttribute": f"{DRIVER}/nvlinkDomain"}]),
        "spec.devices.constraints[0].requests[0]",
        "unknown request 'gpu' (requests: gpus)",
    ),
    (
        "bad opaque field",
        with_config(
            {
                "apiVersion": "gpu.dra-gpu.io/v1alpha1",
                "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mps": {"threads": 5}},
            }
        ),
        "spec.devices.config[0].opaque.parameters.sharing.mps.threads",
        "unknown field",
    ),
    (
        "opaque out of range",
        with_config(
            {
                "apiVersion": "gpu.dra-gpu.io/v1alpha1",
                "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 500}},
            }
        ),
        "spec.devices.config[0].opaque.parameters.sharing.mps.defaultActiveThreadPercentage",
        "between 1 and 100",
    ),
    (
        "opaque wrong version",
        with_config({"apiVersion": "v2", "kind": "GpuConfig"}),
        "spec.devices.config[0].opaque.parameters.apiVersion",
        "must be 'gpu.dra-gpu.io/v1alpha1'",
    ),
    (
        "bad extendedResourceName",
        device_class(extendedResourceName="nvidia.com/gpu/x"),
        "spec.extendedResourceName",
        "must be",
    ),
    (
        "kubernetes.io extendedResourceName",
        device_class(extendedResourceName="kubernetes.io/gpu"),
        "spec.extendedResourceName",
        "outside kubernetes.io",
    ),
    (
        "class with bad CEL",
        device_class(selectors=[{"cel": {"expression": f'{D}.typ == "gpu"'}}]),
        "spec.selectors[0].cel.expression",
        "did you mean 'type'?",
    ),
    (
        "class with bad config",
        device_class(config=[{"opaque": {"driver": DRIVER, "parameters": {"kind": "X"}}}]),
        "spec.config[0].opaque.parameters.apiVersion",
        "must be",
    ),
]


@pytest.fixture(scope="module")
def validator() -> Validator:
    slices = node_slices()
    return Validator(DRIVER, slices, [GPU_CLASS])


@pytest.mark.parametrize(("obj", "path", "message"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_invalid_object(validator: Validator, obj: dict[str, Any], path: str, message: str) -> None:
    verdict = validator.validate(obj)
    assert not verdict.allowed
    assert any(p.path == path and message in p.message for p in verdict.errors), verdict.errors


VALID = [
    claim("one"),
    claim("four-linked", 4, constraints=NVLINK),
    claim(
        "sel",
        2,
        selectors=[
            f'{C}.memory.compareTo(quantity("40Gi")) >= 0',
            f'{D}.driverVersion.isGreaterThan(semver("550.0.0"))',
            f'cel.bind(a, {D}, a.productName.startsWith("NVIDIA") && a.?nvlinkDomainSize.orValue(0) >= 4)',
        ],
    ),
    with_config(
        {
            "apiVersion": "gpu.dra-gpu.io/v1alpha1",
            "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}},
        }
    ),
    device_class(extendedResourceName="example.com/gpu"),
]


@pytest.mark.parametrize("obj", VALID, ids=[o["metadata"]["name"] for o in VALID])
def test_valid_object(validator: Validator, obj: dict[str, Any]) -> None:
    verdict = validator.validate(obj)
    assert verdict.allowed, verdict.errors
    assert verdict.concerned


def test_other_drivers_objects_pass_untouched(validator: Validator) -> None:
    other = claim("other", 99, selectors=["this is not CEL"])
    other["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "fpga.example.com"
    verdict = validator.validate(other)
    assert verdict.allowed and not verdict.concerned


def test_temporarily_unsatisfiable_is_a_warning() -> None:
    slices = node_slices()
    names = device_names(slices)
    busy = allocated("busy", "node-a", [names[0], names[4]])  # one GPU in each NVLink domain
    v = Validator(DRIVER, slices, [GPU_CLASS], [busy])
    verdict = v.validate(claim("c", 4, constraints=NVLINK))
    assert verdict.allowed
    assert [w.message for w in verdict.warnings] == [
        "cannot be allocated right now (devices in use): largest free NVLink domain: 3 GPUs (node-a); "
        "the claim needs 4 NVLink-connected GPUs"
    ]


def test_template_paths() -> None:
    v = Validator(DRIVER, node_slices(), [GPU_CLASS])
    tmpl = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "t", "namespace": "default"},
        "spec": {"spec": claim("x", 16, constraints=NVLINK)["spec"]},
    }
    verdict = v.validate(tmpl)
    assert [p.path for p in verdict.errors] == ["spec.spec.devices"]
    assert "largest NVLink domain: 4 GPUs (node-a)" in verdict.errors[0].message
