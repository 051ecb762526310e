"""NVIDIA's opaque config API resource.nvidia.com/v1beta1 decodes strictly onto dra-gpu's GpuConfig:
every field, every refusal at its field path, the configs of NVIDIA's demo manifests, and nothing
but ConfigError on any JSON-like input."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from dra_gpu.model.config import API_VERSION, NVIDIA_API_VERSION, ConfigError, decode, nvidia_v1beta1
from dra_gpu.model.config.v1alpha1 import GpuConfig, Mps, Sharing, TimeSlicing
from dra_gpu.model.nvidia_compat import UNSUPPORTED_CONFIG_KINDS
from tests.controller.generators import json_values, like
from tests.mutation import fuzz_settings, paths, reach, reaches, replace_at

V1BETA1 = "resource.nvidia.com/v1beta1"
GIB = 1 << 30


def gpu(sharing: Any = None, kind: str = "GpuConfig") -> dict[str, Any]:
    params: dict[str, Any] = {"apiVersion": V1BETA1, "kind": kind}
    if sharing is not None:
        params["sharing"] = sharing
    return params


def mig(sharing: Any = None) -> dict[str, Any]:
    return gpu(sharing, "MigDeviceConfig")


def mps(**config: Any) -> dict[str, Any]:
    return {"strategy": "MPS", "mpsConfig": config}


# -- what is accepted ------------------------------------------------------------------------------


def test_the_api_version_is_nvidias() -> None:
    assert NVIDIA_API_VERSION == V1BETA1 == nvidia_v1beta1.API_VERSION


@pytest.mark.parametrize("kind", ["GpuConfig", "MigDeviceConfig"])
def test_no_sharing_is_exclusive(kind: str) -> None:
    for params in (gpu(kind=kind), {**gpu(kind=kind), "sharing": None}):
        assert decode(params) == GpuConfig(kind=kind, sharing=Sharing())


@pytest.mark.parametrize("interval", ["Default", "Short", "Medium", "Long"])
def test_time_slicing_interval(interval: str) -> None:
    c = decode(gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}))
    assert c == GpuConfig("GpuConfig", Sharing("TimeSlicing", time_slicing=TimeSlicing(interval)))


@pytest.mark.parametrize(
    "sharing",
    [
        {"strategy": "TimeSlicing"},
        {"strategy": "TimeSlicing", "timeSlicingConfig": None},
        {"strategy": "TimeSlicing", "timeSlicingConfig": {}},  # NVIDIA's validation would panic here
        {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": None}},
    ],
)
def test_time_slicing_without_an_interval_is_default(sharing: dict[str, Any]) -> None:
    assert decode(gpu(sharing)).sharing == Sharing("TimeSlicing", time_slicing=TimeSlicing("Default"))


def test_every_mps_field() -> None:
    c = decode(
        gpu(
            mps(
                defaultActiveThreadPercentage=1,
                defaultPinnedDeviceMemoryLimit="10Gi",
                defaultPerDevicePinnedMemoryLimit={
                    "1": "4Gi",
                    "GPU-8a3f0c1e-0000-4000-8000-000000000001": 2 * GIB,
                    "MIG-5c9d9a3e-0000-4000-8000-000000000002": "1Mi",
                    "+02": "1500Mi",
                },
                multiUser=False,
            )
        )
    )
    assert c.kind == "GpuConfig" and c.sharing.strategy == "MPS"
    assert c.sharing.mps == Mps(
        default_active_thread_percentage=1,
        default_pinned_device_memory_limit=10 * GIB,
        per_device_pinned_memory_limits=(
            ("+02", 1500 << 20),
            ("1", 4 * GIB),
            ("GPU-8a3f0c1e-0000-4000-8000-000000000001", 2 * GIB),
            ("MIG-5c9d9a3e-0000-4000-8000-000000000002", 1 << 20),
        ),
    )
    assert c.sharing.mps.path == "sharing.mpsConfig"  # messages name NVIDIA's field


@pytest.mark.parametrize(
    "mps_config", [None, {}, {"multiUser": None, "defaultPerDevicePinnedMemoryLimit": {}}]
)
def test_mps_without_settings(mps_config: Any) -> None:
    c = decode(gpu({"strategy": "MPS", "mpsConfig": mps_config}))
    assert c.sharing == Sharing("MPS", mps=Mps())


def test_mig_device_config_mps_and_time_slicing() -> None:
    c = decode(mig(mps(defaultActiveThreadPercentage=25)))
    assert c == GpuConfig("MigDeviceConfig", Sharing("MPS", mps=Mps(default_active_thread_percentage=25)))
    # NVIDIA accepts TimeSlicing on a MIG device and applies nothing: dra-gpu's Exclusive.
    assert decode(mig({"strategy": "TimeSlicing"})) == GpuConfig("MigDeviceConfig", Sharing())


def test_v1alpha1_configs_decode_as_before() -> None:
    params = {
        "apiVersion": API_VERSION,
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 50}},
    }
    c = decode(params)
    assert c.sharing.mps == Mps(default_active_thread_percentage=50)
    assert c.sharing.mps.path == "sharing.mps"
    with pytest.raises(ConfigError) as err:  # v1beta1's field names are not v1alpha1's
        decode({**params, "sharing": {"strategy": "MPS", "mpsConfig": {}}})
    assert err.value.path == "sharing.mpsConfig"


# NVIDIA's demo manifests' configs (demo/specs/quickstart/v1/gpu-test5.yaml, gpu-test6.yaml,
# gpu-test-mps.yaml), written here in the same shape.
DEMO_CLAIMS = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: multiple-gpus, namespace: gpu-test5}
spec:
  spec:
    devices:
      requests:
      - name: ts-gpu
        exactly: {deviceClassName: gpu.nvidia.com}
      - name: mps-gpu
        exactly: {deviceClassName: gpu.nvidia.com}
      config:
      - requests: [ts-gpu]
        opaque:
          driver: gpu.nvidia.com
          parameters:
            apiVersion: resource.nvidia.com/v1beta1
            kind: GpuConfig
            sharing:
              strategy: TimeSlicing
              timeSlicingConfig:
                interval: Long
      - requests: [mps-gpu]
        opaque:
          driver: gpu.nvidia.com
          parameters:
            apiVersion: resource.nvidia.com/v1beta1
            kind: GpuConfig
            sharing:
              strategy: MPS
              mpsConfig:
                defaultActiveThreadPercentage: 50
                defaultPinnedDeviceMemoryLimit: 10Gi
"""


def test_nvidias_demo_configs() -> None:
    doc = yaml.safe_load(DEMO_CLAIMS)
    ts, mps_ = (decode(c["opaque"]["parameters"]) for c in doc["spec"]["spec"]["devices"]["config"])
    assert ts == GpuConfig("GpuConfig", Sharing("TimeSlicing", time_slicing=TimeSlicing("Long")))
    assert mps_ == GpuConfig(
        "GpuConfig",
        Sharing(
            "MPS", mps=Mps(default_active_thread_percentage=50, default_pinned_device_memory_limit=10 * GIB)
        ),
    )
    assert mps_.container_env(["GPU-b", "GPU-a"]) == {
        "DRA_GPU_SHARING_STRATEGY": "MPS",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "GPU-b=10240M,GPU-a=10240M",
    }


# -- per-device limits, resolved over the devices a config applies to ---------------------------------

UUIDS = ["GPU-c", "GPU-a", "GPU-b"]  # sorted: GPU-a (0), GPU-b (1), GPU-c (2)


def per_device(limits: dict[str, str], default: str | None = None) -> Mps:
    config: dict[str, Any] = {"defaultPerDevicePinnedMemoryLimit": limits}
    if default is not None:
        config["defaultPinnedDeviceMemoryLimit"] = default
    m = decode(gpu(mps(**config))).sharing.mps
    assert m is not None
    return m


@pytest.mark.parametrize(
    ("limits", "default", "want"),
    [
        ({"0": "1Gi"}, None, {"GPU-a": GIB}),
        ({"2": "1Gi", "GPU-a": "2Gi"}, "3Gi", {"GPU-a": 2 * GIB, "GPU-b": 3 * GIB, "GPU-c": GIB}),
        ({"+1": "1Gi", "002": "2Gi"}, None, {"GPU-b": GIB, "GPU-c": 2 * GIB}),  # as Go's Atoi reads them
        ({}, "1Gi", dict.fromkeys(UUIDS, GIB)),
    ],
)
def test_per_device_keys_name_a_uuid_or_an_index_into_the_sorted_uuids(
    limits: dict[str, str], default: str | None, want: dict[str, int]
) -> None:
    assert per_device(limits, default).pinned_memory_limits(UUIDS) == want


def test_container_env_gives_each_device_its_own_limit() -> None:
    c = decode(gpu(mps(defaultPinnedDeviceMemoryLimit="2Gi", defaultPerDevicePinnedMemoryLimit={"0": "1Gi"})))
    assert c.container_env(UUIDS)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "GPU-c=2048M,GPU-a=1024M,GPU-b=2048M"
    assert c.sharing.mps is not None
    pinned = c.sharing.mps.pinned_memory_limits(UUIDS)
    # One device's env, resolved over all three: index 0 is GPU-a, not the device itself.
    assert c.container_env(["GPU-c"], pinned)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "GPU-c=2048M"
    assert c.container_env(["GPU-a"], pinned)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "GPU-a=1024M"
    only = decode(gpu(mps(defaultPerDevicePinnedMemoryLimit={"GPU-b": "1Gi"})))
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in only.container_env(["GPU-a"], {"GPU-b": GIB})


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("3", "names none of the 3 devices this config applies to"),
        ("GPU-d", "names none of the 3 devices"),
        ("MIG-a", "names none of the 3 devices"),
        ("9" * 40, "names none of the 3 devices"),  # an index past any claim, not a crash
    ],
)
def test_a_key_naming_no_device_is_an_error_naming_the_key(key: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        per_device({key: "1Gi"}).pinned_memory_limits(UUIDS)
    assert err.value.path == f"sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[{key}]"
    assert message in err.value.message and "GPU-a, GPU-b, GPU-c" in err.value.message


def test_two_keys_naming_one_device_is_an_error() -> None:
    with pytest.raises(ConfigError) as err:
        per_device({"0": "1Gi", "GPU-a": "2Gi"}).pinned_memory_limits(UUIDS)
    assert err.value.path == "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[GPU-a]"
    assert "names device GPU-a, which key '0' names too" in err.value.message


# -- what is refused, at its field ----------------------------------------------------------------

REFUSED: list[tuple[str, Any, str, str]] = [
    ("not an object", ["GpuConfig"], "", "must be an object, got a list"),
    (
        "no apiVersion",
        {"kind": "GpuConfig"},
        "apiVersion",
        f"must be {API_VERSION!r} or {V1BETA1!r}, got None",
    ),
    (
        "other apiVersion",
        {"apiVersion": "resource.nvidia.com/v1", "kind": "GpuConfig"},
        "apiVersion",
        "or 'resource.nvidia.com/v1beta1', got 'resource.nvidia.com/v1'",
    ),
    ("apiVersion not a string", {"apiVersion": 1, "kind": "GpuConfig"}, "apiVersion", "got an integer"),
    ("no kind", {"apiVersion": V1BETA1}, "kind", "required: one of GpuConfig, MigDeviceConfig"),
    (
        "kind not a string",
        {"apiVersion": V1BETA1, "kind": ["GpuConfig"]},
        "kind",
        "must be a string, got a list",
    ),
    (
        "unknown kind",
        gpu(kind="TpuConfig"),
        "kind",
        "unknown kind 'TpuConfig' of resource.nvidia.com/v1beta1 (known: GpuConfig, MigDeviceConfig)",
    ),
    ("kind in lower case", gpu(kind="gpuConfig"), "kind", "known: GpuConfig, MigDeviceConfig"),
    (
        "unknown top-level field",
        {**gpu(), "metadata": {}},
        "metadata",
        "unknown field (known: apiVersion, kind, sharing)",
    ),
    ("keys are case-sensitive", {**gpu(), "Sharing": {}}, "Sharing", "unknown field"),
    ("sharing not an object", gpu("MPS"), "sharing", "must be an object, got a string"),
    (
        "unknown sharing field",
        gpu({"strategy": "MPS", "mps": {}}),
        "sharing.mps",
        "unknown field (known: mpsConfig, strategy, timeSlicingConfig)",
    ),
    ("no strategy", gpu({}), "sharing.strategy", "required: one of TimeSlicing, MPS"),
    ("strategy not a string", gpu({"strategy": 1}), "sharing.strategy", "must be a string, got an integer"),
    (
        "unknown strategy",
        gpu({"strategy": "Exclusive"}),
        "sharing.strategy",
        "unknown GPU sharing strategy 'Exclusive' (supported: TimeSlicing, MPS)",
    ),
    ("strategy in lower case", gpu({"strategy": "mps"}), "sharing.strategy", "supported: TimeSlicing, MPS"),
    (
        "both configs",
        gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {}, "mpsConfig": {}}),
        "sharing.mpsConfig",
        "not allowed with strategy TimeSlicing",
    ),
    (
        "both configs, MPS",
        gpu({"strategy": "MPS", "timeSlicingConfig": {}, "mpsConfig": {}}),
        "sharing.timeSlicingConfig",
        "not allowed with strategy MPS",
    ),
    (
        "mpsConfig with TimeSlicing",
        gpu({"strategy": "TimeSlicing", "mpsConfig": {}}),
        "sharing.mpsConfig",
        "not allowed with strategy TimeSlicing",
    ),
    (
        "timeSlicingConfig with MPS",
        gpu({"strategy": "MPS", "timeSlicingConfig": {"interval": "Long"}}),
        "sharing.timeSlicingConfig",
        "not allowed with strategy MPS",
    ),
    (
        "timeSlicingConfig not an object",
        gpu({"strategy": "TimeSlicing", "timeSlicingConfig": "Long"}),
        "sharing.timeSlicingConfig",
        "must be an object",
    ),
    (
        "unknown timeSlicingConfig field",
        gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {"Interval": "Long"}}),
        "sharing.timeSlicingConfig.Interval",
        "unknown field (known: interval)",
    ),
    (
        "interval not a string",
        gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": 3}}),
        "sharing.timeSlicingConfig.interval",
        "must be a string, got an integer",
    ),
    (
        "unknown interval",
        gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "long"}}),
        "sharing.timeSlicingConfig.interval",
        "unknown time-slice interval 'long' (supported: Default, Short, Medium, Long)",
    ),
    (
        "mpsConfig not an object",
        gpu({"strategy": "MPS", "mpsConfig": []}),
        "sharing.mpsConfig",
        "must be an object, got a list",
    ),
    (
        "unknown mpsConfig field",
        gpu(mps(defaultActiveThreadPercent=5)),
        "sharing.mpsConfig.defaultActiveThreadPercent",
        "unknown field (known: defaultActiveThreadPercentage, defaultPerDevicePinnedMemoryLimit, "
        "defaultPinnedDeviceMemoryLimit, multiUser)",
    ),
    (
        "percentage as a string",
        gpu(mps(defaultActiveThreadPercentage="50")),
        "sharing.mpsConfig.defaultActiveThreadPercentage",
        "must be an integer, got a string",
    ),
    (
        "percentage as a number",
        gpu(mps(defaultActiveThreadPercentage=50.0)),
        "sharing.mpsConfig.defaultActiveThreadPercentage",
        "must be an integer, got a number",
    ),
    (
        "percentage as a boolean",
        gpu(mps(defaultActiveThreadPercentage=True)),
        "sharing.mpsConfig.defaultActiveThreadPercentage",
        "must be an integer, got a boolean",
    ),
    (
        "percentage 0",
        gpu(mps(defaultActiveThreadPercentage=0)),
        "sharing.mpsConfig.defaultActiveThreadPercentage",
        "0 is refused: NVIDIA's driver accepts it, but NVIDIA's MPS control daemon rejects "
        "set_default_active_thread_percentage 0",
    ),
    (
        "percentage negative",
        gpu(mps(defaultActiveThreadPercentage=-1)),
        "sharing.mpsConfig.defaultActiveThreadPercentage",
        "must be between 1 and 100, got -1",
    ),
    (
        "percentage over 100",
        gpu(mps(defaultActiveThreadPercentage=101)),
        "sharing.mpsConfig.defaultActiveThreadPercentage",
        "must be between 1 and 100, got 101",
    ),
    (
        "limit not a quantity",
        gpu(mps(defaultPinnedDeviceMemoryLimit="10 GB")),
        "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
        "'10 GB' is not a quantity such as 10Gi",
    ),
    (
        "limit as an object",
        gpu(mps(defaultPinnedDeviceMemoryLimit={"value": 1})),
        "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
        "must be a quantity such as 10Gi, got an object",
    ),
    (
        "limit as a boolean",
        gpu(mps(defaultPinnedDeviceMemoryLimit=True)),
        "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
        "got a boolean",
    ),
    (
        "limit under 1Mi",
        gpu(mps(defaultPinnedDeviceMemoryLimit="1023Ki")),
        "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
        "must be at least 1Mi, got 1023Ki",
    ),
    (
        "limit 0",
        gpu(mps(defaultPinnedDeviceMemoryLimit=0)),
        "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
        "must be at least 1Mi, got 0",
    ),
    (
        "per-device not an object",
        gpu(mps(defaultPerDevicePinnedMemoryLimit=["1Gi"])),
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit",
        "must be an object (device UUID or index -> quantity), got a list",
    ),
    (
        "per-device empty list",
        gpu(mps(defaultPerDevicePinnedMemoryLimit=[])),
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit",
        "must be an object",
    ),
    (
        "per-device key neither",
        gpu(mps(defaultPerDevicePinnedMemoryLimit={"gpu0": "1Gi"})),
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[gpu0]",
        "key 'gpu0' is neither a device UUID (GPU-... or MIG-...) nor a decimal index",
    ),
    (
        "per-device negative index",
        gpu(mps(defaultPerDevicePinnedMemoryLimit={"-1": "1Gi"})),
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[-1]",
        "is neither",
    ),
    (
        "per-device non-ASCII digits",
        gpu(mps(defaultPerDevicePinnedMemoryLimit={"\u0661": "1Gi"})),
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[\u0661]",
        "is neither",
    ),
    (
        "per-device lower-case UUID",
        gpu(mps(defaultPerDevicePinnedMemoryLimit={"gpu-1": "1Gi"})),
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[gpu-1]",
        "is neither",
    ),
    (
        "per-device value too small",
        gpu(mps(defaultPerDevicePinnedMemoryLimit={"0": "512Ki"})),
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[0]",
        "must be at least 1Mi, got 512Ki",
    ),
    (
        "per-device value null",
        gpu(mps(defaultPerDevicePinnedMemoryLimit={"0": None})),
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[0]",
        "must be a quantity such as 10Gi, got null",
    ),
    (
        "multiUser true",
        gpu(mps(multiUser=True)),
        "sharing.mpsConfig.multiUser",
        "dra-gpu does not run MPS in multi-user mode",
    ),
    (
        "multiUser not a boolean",
        gpu(mps(multiUser="false")),
        "sharing.mpsConfig.multiUser",
        "must be a boolean, got a string",
    ),
    (
        "MIG has no timeSlicingConfig",
        mig({"strategy": "TimeSlicing", "timeSlicingConfig": {}}),
        "sharing.timeSlicingConfig",
        "unknown field (known: mpsConfig, strategy)",
    ),
    (
        "MIG mpsConfig with TimeSlicing",
        mig({"strategy": "TimeSlicing", "mpsConfig": {}}),
        "sharing.mpsConfig",
        "not allowed with strategy TimeSlicing",
    ),
    (
        "MIG unknown strategy",
        mig({"strategy": "Exclusive"}),
        "sharing.strategy",
        "supported: TimeSlicing, MPS",
    ),
    (
        "MIG percentage 0",
        mig(mps(defaultActiveThreadPercentage=0)),
        "sharing.mpsConfig.defaultActiveThreadPercentage",
        "0 is refused",
    ),
]


@pytest.mark.parametrize(("params", "path", "message"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused_at_its_field(params: Any, path: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        decode(params)
    assert err.value.path == path
    assert message in err.value.message, err.value.message


@pytest.mark.parametrize("kind", sorted(UNSUPPORTED_CONFIG_KINDS))
def test_nvidias_kinds_dra_gpu_does_not_do_are_refused_on_kind_saying_what_they_are(kind: str) -> None:
    # Their own fields are never reached: the kind is the problem.
    fields = {"iommu": {"backendPolicy": "LegacyOnly"}} if kind == "VfioDeviceConfig" else {"domainID": "d"}
    with pytest.raises(ConfigError) as err:
        decode({**gpu(kind=kind), **fields})
    assert err.value.path == "kind"
    assert err.value.message.startswith(f"{kind} is NVIDIA's ")
    assert err.value.message.endswith("which dra-gpu does not do")
    what = "VFIO passthrough" if kind == "VfioDeviceConfig" else "ComputeDomains and IMEX channels"
    assert what in err.value.message


def test_the_webhook_path_of_a_refusal_is_the_decoders() -> None:
    """The decoder's path is what the admission rules and the plugin append to
    `...opaque.parameters` (tests/controller/test_rules_nvidia_config.py checks the rules)."""
    with pytest.raises(ConfigError) as err:
        nvidia_v1beta1.decode(gpu(mps(defaultActiveThreadPercentage=0)))
    assert str(err.value).startswith("sharing.mpsConfig.defaultActiveThreadPercentage: 0 is refused")


# -- any JSON-like input: a GpuConfig or a ConfigError, nothing else ------------------------------------


@st.composite
def nvidia_configs(draw: st.DrawFn) -> Any:
    """A valid config of NVIDIA's, every field drawn (mutated by the test's caller)."""
    kind = draw(st.sampled_from(["GpuConfig", "MigDeviceConfig"]))
    params: dict[str, Any] = {"apiVersion": V1BETA1, "kind": kind}
    strategy = draw(st.sampled_from([None, "TimeSlicing", "MPS", "MPS"]))
    if strategy is None:
        return params
    sharing: dict[str, Any] = {"strategy": strategy}
    params["sharing"] = sharing
    if strategy == "TimeSlicing" and kind == "GpuConfig" and draw(st.booleans()):
        interval = draw(st.sampled_from(["Default", "Short", "Medium", "Long", None]))
        sharing["timeSlicingConfig"] = {"interval": interval} if interval else {}
    if strategy == "MPS" and draw(st.integers(0, 3)):
        fields = {
            "defaultActiveThreadPercentage": st.integers(1, 100),
            "defaultPinnedDeviceMemoryLimit": st.sampled_from(["1Mi", "10Gi", "1.5Gi", 1 << 30]),
            "defaultPerDevicePinnedMemoryLimit": st.dictionaries(
                st.sampled_from(["0", "1", "+2", "GPU-a", "MIG-b"]),
                st.sampled_from(["1Gi", "4Mi"]),
                max_size=3,
            ),
            "multiUser": st.just(False),
        }
        chosen = draw(st.lists(st.sampled_from(sorted(fields)), unique=True))
        sharing["mpsConfig"] = {k: draw(fields[k]) for k in chosen}
    return params


@st.composite
def mutated_deep(draw: st.DrawFn, valid: Any) -> Any:
    """`valid` itself, or with one value replaced (mostly by one of its type), mostly below
    `sharing`: the top-level fields are few and would take most mutations."""
    if draw(st.booleans()):
        return valid
    obj = copy.deepcopy(valid)
    every = paths(obj)
    deep = [p for p in every if len(p) >= 2]
    below = bool(deep) and draw(st.integers(0, 3)) > 0
    where = draw(st.sampled_from(deep if below else every))
    old = obj
    for key in where:
        old = old[key]
    return replace_at(obj, where, draw(like(old)) if draw(st.integers(0, 3)) else draw(json_values))


@reaches(0.15, "decoded")
@reaches(0.12, "refused below the top level")
@fuzz_settings(300)
@given(
    st.one_of(json_values, *[nvidia_configs().flatmap(mutated_deep)] * 3),
    st.lists(st.sampled_from(["GPU-a", "GPU-b", "MIG-b", "GPU-c"]), max_size=3),
)
def test_decode_raises_nothing_but_config_error(params: Any, uuids: list[str]) -> None:
    try:
        config = decode(params)
    except ConfigError as exc:
        assert exc.path is not None and exc.message
        reach(
            "refused below the top level"
            if "." in exc.path or exc.path == "sharing"
            else "refused at the top"
        )
        return
    assert isinstance(config, GpuConfig)
    reach("decoded")
    # Resolved over any devices (at prepare): limits and an environment, or a ConfigError naming a key.
    try:
        env = config.container_env(uuids)
    except ConfigError as exc:
        assert config.sharing.mps is not None and "defaultPerDevicePinnedMemoryLimit[" in exc.path
        return
    assert all(isinstance(v, str) for v in env.values())
    if config.sharing.mps is not None:
        limits = config.sharing.mps.pinned_memory_limits(uuids)
        assert set(limits) <= set(uuids) and all(v >= 1 << 20 for v in limits.values())


# -- why 0 is refused: what NVIDIA's real MPS control daemon does with it -----------------------------

PROBE = r"""
import json, sys
from pathlib import Path
from dra_gpu.plugin.driver_programs import DriverProgram
from dra_gpu.plugin.mps import MpsDaemon, MpsDaemons

root, work = Path(sys.argv[1]), Path(sys.argv[2])
lib = next(root.glob("usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.5*"))
program = DriverProgram(root / "usr/bin/nvidia-cuda-mps-control", lib, [root / "usr/bin", root / "usr/sbin"])
daemons = MpsDaemons(work, lambda: program)
daemons.start(MpsDaemon("claim-0", ["GPU-1"], 25, {}))
out = [daemons.control("claim-0", [c]).strip() for c in (
    "set_default_active_thread_percentage 0", "get_default_active_thread_percentage",
    "set_default_active_thread_percentage 1", "get_default_active_thread_percentage")]
out.append([l for l in (work / "claim-0/log/control.log").read_text().splitlines() if "Invalid" in l])
daemons.stop("claim-0")
print(json.dumps(out))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare (a private namespace, as tests/plugin/test_mps_real_daemon.py)",
)
@pytest.mark.parametrize("suite", ["bookworm", "trixie"])
def test_nvidias_mps_daemon_rejects_a_default_active_thread_percentage_of_0(
    suite: str, tmp_path: Path
) -> None:
    from tests.driver_root import debian_root, run_probe_in_private_namespace

    root = debian_root(suite)
    stdout = run_probe_in_private_namespace(PROBE, root, tmp_path)
    set0, after0, set1, after1, invalid = json.loads(stdout.strip().splitlines()[-1])
    assert (set0, after0) == ("25.0", "25.0")  # 0 not taken: the value it had stays
    assert (set1, after1) == ("1.0", "1.0")
    assert len(invalid) == 1 and "Invalid percentage, expected between (0.0, 100.0]" in invalid[0]
