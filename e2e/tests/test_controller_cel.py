"""The controller (issue 5) against the real cluster: the validator's CEL against the real
kube-apiserver's, selector expression by expression.
"""

from __future__ import annotations

import sys

import pytest
from controller_support import GPU_CLASS, HGX, RESOURCE, make_claim, request, status_of

pytestmark = pytest.mark.e2e


def status_of_create(api, obj) -> int:
    try:
        api.create(body=obj, namespace=obj["metadata"]["namespace"], dry_run="All")
    except Exception as exc:
        if status_of(exc) is None:
            raise
        return int(status_of(exc) or 0)
    return 201


def cel_conformance() -> list[tuple[str, str]]:
    """Selector expressions and how the validator relates to the apiserver on them:
    "same": both accept or both refuse; "stricter": the apiserver accepts, the validator denies
    because the selector can never match (always false or a runtime error on every device);
    "gap": the apiserver refuses, the validator lets it through (the apiserver's own error then)."""
    h = f'device.attributes["{HGX}"]'
    q = f'device.capacity["{HGX}"].memory'
    v = f"{h}.driverVersion"
    return [
        (f"sign({q}) == 1", "same"),  # a global function in Kubernetes...
        (f"{q}.sign() == 1", "same"),  # ... not a member one
        (f"{q}.add(1).isGreaterThan({q}) && {q}.sub({q}).asInteger() == 0", "same"),
        (f"{q}.asApproximateFloat() > 1.0 && {q}.isInteger()", "same"),
        (f'{v}.major() == 570 && semver("v1.2", true).minor() == 2 && isSemver("1.2", true)', "same"),
        (f"{h}.index > 2.5 && {h}.index < 6u && {h}.index != 3.0", "same"),  # cross-type comparisons
        (f"{h}.numaNode != null && {h}.?index.orValue(0.5) >= 0", "same"),
        ("1 == 1.0", "same"),  # literals are typed: no heterogeneous equality at compile time
        (f'{h}.productName.reverse() != ""', "same"),  # strings extension version 3: not in Kubernetes
        (
            f'"%s".format(["a"]) == "a" && strings.quote("a") != "" && {h}.productName.charAt(0) == "N"',
            "same",
        ),
        (f'{h}.productName.matches("[")', "same"),
        ('timestamp("2020-01-01T00:00:00Z") < now', "same"),
        (f'dyn({h}.index) > 2.5 && double({h}.index) > -1.0 && string({h}.index) != ""', "same"),
        (f"{h}.productName == 1", "stricter"),  # always false
        (f"{h}.index.size() == 1", "stricter"),  # a runtime error on every device
        (f"{h}.index + 1.0 > 2.0", "stricter"),  # no int + double at runtime either
        (f"{h}.index in [1, 2.0]", "gap"),  # homogeneous aggregate literals
        (f"type({h}.index) == int", "gap"),
    ]


def test_cel_conformance_with_the_apiserver(dyn, namespace, published):
    from dra_gpu.controller.rules import Validator

    claims_api = dyn.resources.get(api_version=RESOURCE, kind="ResourceClaim")
    validator = Validator(HGX, published["slices"][HGX], published["classes"])
    wrong = []
    for i, (expr, relation) in enumerate(cel_conformance()):
        claim = make_claim(f"cel{i}", [request("gpus", GPU_CLASS, 1, [expr])])
        claim["metadata"]["namespace"] = namespace
        api_ok = status_of_create(claims_api, claim) == 201
        verdict = validator.validate(claim)
        got = "same" if api_ok == verdict.allowed else "stricter" if api_ok else "gap"
        if got != relation:
            api = "accepts" if api_ok else "refuses"
            wrong.append(
                f"{expr}: expected {relation}, got {got} (apiserver {api}, "
                f"validator {[p.message for p in verdict.errors] or 'allows'})"
            )
    print(
        f"\n[cel] {len(cel_conformance())} selector expressions against the apiserver, "
        f"{len(wrong)} unexpected",
        file=sys.stderr,
    )
    assert not wrong, "\n".join(wrong)
