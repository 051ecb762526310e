"""The opaque config API decodes strictly and names the field path of every problem."""

from __future__ import annotations

from typing import Any

import pytest

from dra_gpu.model.config import API_VERSION, ConfigError, decode


def cfg(**sharing: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": sharing}


def test_defaults_and_full_mps_config() -> None:
    assert decode({"apiVersion": API_VERSION, "kind": "GpuConfig"}).sharing.strategy == "Exclusive"
    c = decode(
        cfg(
            strategy="MPS",
            mps={"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"},
        )
    )
    assert c.sharing.mps is not None
    assert c.sharing.mps.default_pinned_device_memory_limit == 10 << 30
    env = c.container_env(["GPU-a", "GPU-b"])
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "GPU-a=10240M,GPU-b=10240M"
    ts = decode(cfg(strategy="TimeSlicing", timeSlicing={"interval": "Long"}))
    assert ts.container_env([])["DRA_GPU_TIME_SLICE_INTERVAL"] == "Long"


@pytest.mark.parametrize(
    ("params", "path", "message"),
    [
        ({"apiVersion": "v1", "kind": "GpuConfig"}, "apiVersion", "must be 'gpu.dra-gpu.io/v1alpha1'"),
        ({"apiVersion": API_VERSION, "kind": "TpuConfig"}, "kind", "unknown value 'TpuConfig'"),
        ({"apiVersion": API_VERSION, "kind": "GpuConfig", "shareing": {}}, "shareing", "unknown field"),
        (cfg(strategy="Sometimes"), "sharing.strategy", "unknown value 'Sometimes'"),
        (
            cfg(strategy="MPS", mps={"defaultActiveThreadPercentage": 150}),
            "sharing.mps.defaultActiveThreadPercentage",
            "between 1 and 100, got 150",
        ),
        (
            cfg(strategy="MPS", mps={"defaultActiveThreadPercentage": "50"}),
            "sharing.mps.defaultActiveThreadPercentage",
            "must be an integer, got a string",
        ),
        (
            cfg(strategy="MPS", mps={"defaultPinnedDeviceMemoryLimit": "512Ki"}),
            "sharing.mps.defaultPinnedDeviceMemoryLimit",
            "at least 1Mi",
        ),
        (
            cfg(strategy="MPS", mps={"defaultPinnedDeviceMemoryLimit": "lots"}),
            "sharing.mps.defaultPinnedDeviceMemoryLimit",
            "not a quantity",
        ),
        (cfg(strategy="MPS", mps={"threads": 1}), "sharing.mps.threads", "unknown field"),
        (cfg(strategy="TimeSlicing", mps={}), "sharing.mps", "not allowed with strategy TimeSlicing"),
        (
            cfg(strategy="TimeSlicing", timeSlicing={"interval": "Forever"}),
            "sharing.timeSlicing.interval",
            "unknown value 'Forever'",
        ),
        (
            {"apiVersion": API_VERSION, "kind": "MigDeviceConfig", "sharing": {"strategy": "TimeSlicing"}},
            "sharing.strategy",
            "valid: Exclusive, MPS",
        ),
        (["not", "an", "object"], "", "must be an object"),
    ],
)
def test_invalid_configs_name_the_field(params: Any, path: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        decode(params)
    assert err.value.path == path
    assert message in str(err.value)


def test_a_field_name_that_is_not_a_string_is_refused_at_its_object() -> None:
    """YAML can give integer keys; with a string key beside one, sorting the unknown names used to
    raise TypeError instead of a ConfigError naming the object."""
    for api in ("gpu.dra-gpu.io/v1alpha1", "resource.nvidia.com/v1beta1"):
        with pytest.raises(ConfigError, match=r"^sharing: field names must be strings"):
            decode({"apiVersion": api, "kind": "GpuConfig", "sharing": {1: "x", "y": "z"}})
