"""A sharing config (MPS, TimeSlicing) on an adminAccess request is refused, naming the claim and
the field: admin access gets a device another claim may hold exclusively, and a sharing config
would change that device under it (issue: tenant isolation)."""

from __future__ import annotations

from typing import Any

import pytest

from dra_gpu.controller.rules import Validator
from dra_gpu.model.config import API_VERSION

from .objects import DRIVER, GPU_CLASS, claim, node_slices


def sharing(strategy: str, requests: list[str] | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "opaque": {
            "driver": DRIVER,
            "parameters": {"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": {"strategy": strategy}},
        }
    }
    if requests is not None:
        entry["requests"] = requests
    return entry


def admin_claim(config: list[dict[str, Any]]) -> dict[str, Any]:
    c = claim("debug", config=config)
    c["metadata"]["namespace"] = "team-a"
    c["spec"]["devices"]["requests"][0]["exactly"]["adminAccess"] = True
    return c


def validator(classes: list[dict[str, Any]] | None = None) -> Validator:
    return Validator(DRIVER, slices=node_slices(), classes=classes or [GPU_CLASS])


@pytest.mark.parametrize("strategy", ["MPS", "TimeSlicing"])
@pytest.mark.parametrize("requests", [["gpus"], None], ids=["named", "all-requests"])
def test_sharing_on_admin_access_is_refused(strategy: str, requests: list[str] | None) -> None:
    v = validator().validate(admin_claim([sharing(strategy, requests)]))
    assert [(p.path, p.message) for p in v.errors] == [
        (
            "spec.devices.config[0].opaque.parameters.sharing.strategy",
            f"claim team-a/debug: sharing strategy {strategy} applies to request 'gpus', which has "
            "adminAccess: an admin-access device may be held exclusively by another claim, so it "
            "cannot be shared",
        )
    ]


def test_template_is_refused_too() -> None:
    inner = admin_claim([sharing("MPS")])
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "debug-tpl", "namespace": "team-a"},
        "spec": {"spec": inner["spec"]},
    }
    v = validator().validate(template)
    assert [p.path for p in v.errors] == ["spec.spec.devices.config[0].opaque.parameters.sharing.strategy"]
    assert "claim team-a/debug-tpl" in v.errors[0].message


def test_sharing_from_the_class_is_refused() -> None:
    shared_class = {**GPU_CLASS, "spec": {**GPU_CLASS["spec"], "config": [sharing("TimeSlicing")]}}
    v = validator([shared_class]).validate(admin_claim([]))
    assert [p.path for p in v.errors] == ["spec.devices.requests[0].exactly.deviceClassName"]
    assert "DeviceClass 'gpu.dra-gpu.io' configures sharing strategy TimeSlicing" in v.errors[0].message


def test_allowed_without_admin_access_or_sharing() -> None:
    exclusive = validator().validate(admin_claim([sharing("Exclusive")]))
    assert exclusive.allowed, exclusive.lines()
    plain = claim("shared", config=[sharing("MPS")])
    assert validator().validate(plain).allowed
    # A sharing config that names another, non-admin request only.
    two = admin_claim([sharing("MPS", ["other"])])
    two["spec"]["devices"]["requests"].append(
        {"name": "other", "exactly": {"deviceClassName": "gpu.dra-gpu.io"}}
    )
    assert validator().validate(two).allowed, validator().validate(two).lines()
