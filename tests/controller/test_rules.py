"""Validation rules: a corpus of invalid objects with the message each must produce."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from dra_gpu.controller.rules import ProblemKind, Validator

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
    ("sign as a member", claim("c", selectors=[f"{C}.memory.sign() == 1"]), SEL, "reference to 'sign'"),
    (
        "int plus double",  # compiles in Kubernetes (dyn), fails at runtime on every device
        claim("c", selectors=[f"{D}.index + 1.0 > 2.0"]),
        SEL,
        "no matching overload for '_+_' applied to '(int, double)'",
    ),
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
    # Kubernetes: sign() is a global function; comparisons across int/uint/double and with null are
    # valid (attributes are dyn there, cel.CrossTypeNumericComparisons); found by the e2e tests.
    claim(
        "kubernetes-typing",
        selectors=[
            f'sign({C}.memory.sub(quantity("1Gi"))) == 1',
            f"{D}.index > 2.5 && {D}.index < 6u && {D}.index != 3.0",
            f"{D}.numaNode != null && {D}.?index.orValue(0.5) >= 0",
        ],
    ),
    # Kubernetes' strings extension (version 2), as the scheduler has it (found by the e2e fidelity test).
    claim(
        "strings",
        2,
        selectors=[
            f'{D}.architecture.lowerAscii() == "hopper" && {D}.productName.upperAscii().contains("H100")',
            f'{D}.productName.split(" ")[1] == "H100" && {D}.productName.substring(0, 6) == "NVIDIA"',
            f'{D}.productName.replace("NVIDIA ", "").indexOf("H") == 0 && ["a", "b"].join("-") == "a-b"',
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


def test_problems_carry_their_kind() -> None:
    """Callers act on the kind, never on the words: an unknown class warns, an impossible claim denies."""
    slices = node_slices()
    names = device_names(slices)
    busy = allocated("busy", "node-a", [names[0], names[4]])
    v = Validator(DRIVER, slices, [GPU_CLASS], [busy])
    impossible = v.validate(claim("c", 16, constraints=NVLINK))
    assert [p.kind for p in impossible.errors] == [ProblemKind.UNSATISFIABLE]
    assert [p.kind for p in v.validate(claim("c", 4, constraints=NVLINK)).warnings] == [ProblemKind.IN_USE]
    missing = claim("c")
    missing["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "later.gpu.dra-gpu.io"
    verdict = v.validate(missing)
    assert verdict.allowed
    assert [(p.kind, p.message) for p in verdict.warnings] == [
        (ProblemKind.UNKNOWN_CLASS, "device class 'later.gpu.dra-gpu.io' does not exist")
    ]
    # The search stops at the first request; the diagnosis meets the second one's missing class.
    two = claim("c", 16, constraints=NVLINK)
    second = {"name": "more", "exactly": {"deviceClassName": "later.gpu.dra-gpu.io"}}
    two["spec"]["devices"]["requests"].append(second)
    two["spec"]["devices"]["constraints"][0]["requests"] = ["gpus"]
    verdict = v.validate(two)
    assert verdict.allowed and [p.kind for p in verdict.warnings] == [ProblemKind.UNKNOWN_CLASS]
    bad = v.validate(claim("c", selectors=["1 +"]))
    assert [p.kind for p in bad.errors] == [ProblemKind.INVALID]


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


@pytest.mark.parametrize(
    "expression",
    [
        f'{D}.productName.find("H[0-9]+") == "H100"',
        f"sets.contains([0, 1, 2, 3], [{D}.index])",
        f"[{D}.index, 1].sum() > 1",
        f'[1, 2].all(i, v, v > i) && {D}.type == "gpu"',
    ],
)
def test_unmodelled_kubernetes_functions_warn_not_deny(validator: Validator, expression: str) -> None:
    """Valid for the apiserver and the scheduler, but not in cel-cpp: never a denial, a warning."""
    verdict = validator.validate(claim("k8s-lib", selectors=[expression]))
    assert verdict.allowed and verdict.concerned, verdict.errors
    messages = [w.message for w in verdict.warnings]
    assert any("of the Kubernetes CEL libraries, which dra-gpu does not model" in m for m in messages)
    assert any(m.startswith("feasibility not checked") for m in messages), messages


def test_unmodelled_function_in_a_class_does_not_deny_claims() -> None:
    cls = device_class(selectors=[{"cel": {"expression": f'{D}.productName.find("H100") != ""'}}])
    v = Validator(DRIVER, node_slices(), [cls])
    c = claim("c", 2)
    c["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "custom"
    verdict = v.validate(c)
    assert verdict.allowed, verdict.errors


def test_typos_next_to_unmodelled_functions_are_still_errors(validator: Validator) -> None:
    verdict = validator.validate(claim("c", selectors=[f'{D}.productName.fnd("H100") == ""']))
    assert "undeclared reference to 'fnd'" in verdict.errors[0].message
