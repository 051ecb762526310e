"""The admission rules decode NVIDIA's resource.nvidia.com/v1beta1 opaque configs as they decode
dra-gpu's own: a valid one is admitted, an invalid one is denied at its field path under
`...opaque.parameters`; as dra-gpu (gpu.dra-gpu.io) and in NVIDIA-compatible mode (gpu.nvidia.com)."""

from __future__ import annotations

from typing import Any

import pytest

from dra_gpu.controller.rules import Validator
from dra_gpu.model import nvidia_compat

from .objects import DRIVER, GPU_CLASS, claim, node_slices

V1BETA1 = "resource.nvidia.com/v1beta1"
CONFIG = "spec.devices.config[0].opaque.parameters"


def with_config(params: Any, driver: str = DRIVER) -> dict[str, Any]:
    return claim(
        "nvidia-cfg", config=[{"requests": ["gpus"], "opaque": {"driver": driver, "parameters": params}}]
    )


def gpu_config(sharing: dict[str, Any] | None = None, kind: str = "GpuConfig") -> dict[str, Any]:
    params: dict[str, Any] = {"apiVersion": V1BETA1, "kind": kind}
    if sharing is not None:
        params["sharing"] = sharing
    return params


@pytest.fixture(scope="module")
def validator() -> Validator:
    return Validator(DRIVER, node_slices(), [GPU_CLASS])


VALID = [
    gpu_config(),
    gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
    gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {}}),
    gpu_config(
        {
            "strategy": "MPS",
            "mpsConfig": {
                "defaultActiveThreadPercentage": 50,
                "defaultPinnedDeviceMemoryLimit": "10Gi",
                # The webhook cannot know the devices' UUIDs: a key is checked for its form only.
                "defaultPerDevicePinnedMemoryLimit": {
                    "7": "1Gi",
                    "GPU-00000000-0000-0000-0000-000000000000": "2Gi",
                },
                "multiUser": False,
            },
        }
    ),
]


@pytest.mark.parametrize("params", VALID, ids=range(len(VALID)))
def test_valid_nvidia_configs_are_admitted(validator: Validator, params: dict[str, Any]) -> None:
    verdict = validator.validate(with_config(params))
    assert verdict.allowed, verdict.errors
    assert verdict.concerned


DENIED: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "unknown field",
        gpu_config({"strategy": "MPS", "mps": {}}),
        f"{CONFIG}.sharing.mps",
        "unknown field (known: mpsConfig, strategy, timeSlicingConfig)",
    ),
    (
        "percentage 0",
        gpu_config({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}),
        f"{CONFIG}.sharing.mpsConfig.defaultActiveThreadPercentage",
        "0 is refused",
    ),
    (
        "multi-user MPS",
        gpu_config({"strategy": "MPS", "mpsConfig": {"multiUser": True}}),
        f"{CONFIG}.sharing.mpsConfig.multiUser",
        "dra-gpu does not run MPS in multi-user mode",
    ),
    (
        "per-device key of no form",
        gpu_config({"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"first": "1Gi"}}}),
        f"{CONFIG}.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[first]",
        "is neither a device UUID",
    ),
    (
        "MIG time slicing config",
        gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {}}, kind="MigDeviceConfig"),
        f"{CONFIG}.sharing.timeSlicingConfig",
        "unknown field",
    ),
    (
        "VFIO",
        gpu_config(kind="VfioDeviceConfig"),
        f"{CONFIG}.kind",
        "VfioDeviceConfig is NVIDIA's device config for VFIO passthrough",
    ),
    ("unknown kind", gpu_config(kind="GPUConfig"), f"{CONFIG}.kind", "known: GpuConfig, MigDeviceConfig"),
    (
        "other version",
        {"apiVersion": "resource.nvidia.com/v1", "kind": "GpuConfig"},
        f"{CONFIG}.apiVersion",
        "must be 'gpu.dra-gpu.io/v1alpha1' or 'resource.nvidia.com/v1beta1'",
    ),
]


@pytest.mark.parametrize(("params", "path", "message"), [d[1:] for d in DENIED], ids=[d[0] for d in DENIED])
def test_invalid_nvidia_configs_are_denied_at_their_field(
    validator: Validator, params: dict[str, Any], path: str, message: str
) -> None:
    verdict = validator.validate(with_config(params))
    assert not verdict.allowed
    assert any(p.path == path and message in p.message for p in verdict.errors), verdict.errors


def test_as_nvidias_driver_name_the_same_configs_are_checked() -> None:
    """NVIDIA-compatible mode: the driver is gpu.nvidia.com and its claims' configs name it."""
    v = Validator(nvidia_compat.DRIVER_NAME, [], [])
    ok = v.validate(with_config(VALID[1], nvidia_compat.DRIVER_NAME))
    assert ok.allowed and ok.concerned, ok.errors
    bad = v.validate(with_config(DENIED[1][1], nvidia_compat.DRIVER_NAME))
    assert [p.path for p in bad.errors] == [f"{CONFIG}.sharing.mpsConfig.defaultActiveThreadPercentage"]
