"""resource.nvidia.com/v1beta1: the opaque config API of NVIDIA's DRA driver (dra-driver-nvidia-gpu
v0.5.0), decoded as strictly as gpu.dra-gpu.io/v1alpha1 onto the same `GpuConfig`, so that claims
written for NVIDIA's driver run on dra-gpu unchanged. Facts about NVIDIA's API:
docs/reference/nvidia-dra-driver-v0.5.0.md, section 3.

    apiVersion: resource.nvidia.com/v1beta1
    kind: GpuConfig                         # or MigDeviceConfig
    sharing:                                # none: Exclusive
      strategy: MPS                         # TimeSlicing | MPS (required in `sharing`)
      timeSlicingConfig:                    # GpuConfig only, only with strategy TimeSlicing
        interval: Long                      # Default | Short | Medium | Long; none: Default
      mpsConfig:                            # only with strategy MPS
        defaultActiveThreadPercentage: 50   # 1..100
        defaultPinnedDeviceMemoryLimit: 10Gi            # a quantity >= 1Mi
        defaultPerDevicePinnedMemoryLimit: {"0": 4Gi}   # key: a device UUID or an index
        multiUser: false                    # true is refused

Strict as NVIDIA's own decoder (apimachinery's, `Strict: true`): an unknown field is an error, keys
are case-sensitive, a wrong type is an error; each names its field path. Where NVIDIA's driver
differs from dra-gpu's, this decoder says so instead of guessing:

- `strategy: TimeSlicing` with `timeSlicingConfig: {}` (no interval): NVIDIA's validation would
  dereference a nil interval (a panic, from reading its code); here the interval is Default.
- MigDeviceConfig with `strategy: TimeSlicing`: NVIDIA accepts it and applies nothing (time slices
  are set per GPU; a MIG device shared by a claim's containers is time-shared anyway), so it is
  dra-gpu's Exclusive. MigDeviceConfig has no `timeSlicingConfig` (an unknown field, as in NVIDIA's).
- `mpsConfig` with strategy TimeSlicing, or `timeSlicingConfig` with MPS: an error here (NVIDIA's
  GpuConfig fails at prepare; its MigDeviceConfig ignores the mpsConfig).
- `defaultActiveThreadPercentage: 0`: NVIDIA's validation allows 0..100, but NVIDIA's MPS control
  daemon refuses `set_default_active_thread_percentage 0` and keeps its previous value (seen with
  the daemons of drivers 535.261.03 and 550.163.01), so 0 would silently mean no limit: refused.
- `multiUser: true`: refused (dra-gpu does not start the daemon in multi-user mode).
- `defaultPerDevicePinnedMemoryLimit`: decoded here (values >= 1Mi, keys a device UUID `GPU-...` /
  `MIG-...` or a decimal index); which device a key names is known only at prepare, where a key
  naming none of the config's devices fails the claim (`Mps.pinned_memory_limits`).
- The kinds NVIDIA has that dra-gpu does not do (VFIO passthrough, ComputeDomains) are refused on
  `kind`, saying what they are; the feature gates NVIDIA needs for sharing are not needed here.
"""

from __future__ import annotations

from typing import Any

from dra_gpu.common.decoding import type_name
from dra_gpu.kube.values import parse_quantity
from dra_gpu.model.config.v1alpha1 import (
    INDEX_KEY,
    INTERVALS,
    MIN_PINNED_MEMORY,
    ConfigError,
    GpuConfig,
    Mps,
    Sharing,
    TimeSlicing,
    _mapping,
)
from dra_gpu.model.nvidia_compat import UNSUPPORTED_CONFIG_KINDS

GROUP = "resource.nvidia.com"
VERSION = "v1beta1"
API_VERSION = f"{GROUP}/{VERSION}"
KINDS = ("GpuConfig", "MigDeviceConfig")
STRATEGIES = ("TimeSlicing", "MPS")
SHARING_FIELDS = {
    "GpuConfig": {"strategy", "timeSlicingConfig", "mpsConfig"},
    "MigDeviceConfig": {"strategy", "mpsConfig"},
}
MPS_FIELDS = {
    "defaultActiveThreadPercentage",
    "defaultPinnedDeviceMemoryLimit",
    "defaultPerDevicePinnedMemoryLimit",
    "multiUser",
}
UUID_PREFIXES = ("GPU-", "MIG-")  # NVML's UUIDs of whole GPUs and MIG devices
MPS_PATH = "sharing.mpsConfig"


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(path, f"must be a string, got {type_name(value)}")
    return value


def _quantity(value: Any, path: str) -> int:
    """A pinned memory limit in bytes: a quantity (string or integer, as Kubernetes' Quantity reads
    JSON) of at least 1Mi (NVIDIA's driver hands the daemon whole MiB and refuses 0)."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ConfigError(path, f"must be a quantity such as 10Gi, got {type_name(value)}")
    try:
        q = parse_quantity(str(value))
    except ValueError as exc:
        raise ConfigError(path, f"{value!r} is not a quantity such as 10Gi") from exc
    if q < MIN_PINNED_MEMORY:
        raise ConfigError(path, f"must be at least 1Mi, got {value}")
    return int(q.to_integral_value())


def _percentage(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(path, f"must be an integer, got {type_name(value)}")
    if value == 0:
        raise ConfigError(
            path,
            "0 is refused: NVIDIA's driver accepts it, but NVIDIA's MPS control daemon rejects "
            "set_default_active_thread_percentage 0 ('Invalid percentage, expected between "
            "(0.0, 100.0]') and keeps its previous value, so the claim would run unlimited; give "
            "1..100, or leave it out for no limit",
        )
    if not 1 <= value <= 100:
        raise ConfigError(path, f"must be between 1 and 100, got {value}")
    return value


def _per_device(value: Any, path: str) -> tuple[tuple[str, int], ...]:
    if not isinstance(value, dict):
        raise ConfigError(
            path, f"must be an object (device UUID or index -> quantity), got {type_name(value)}"
        )
    out = []
    for key, limit in value.items():
        if not isinstance(key, str):
            raise ConfigError(path, f"keys must be strings (a device UUID or an index), got {type_name(key)}")
        where = f"{path}[{key}]"
        if not key.startswith(UUID_PREFIXES) and not INDEX_KEY.fullmatch(key):
            raise ConfigError(
                where,
                f"key {key!r} is neither a device UUID (GPU-... or MIG-...) nor a decimal index "
                "into the sorted UUIDs of the devices this config applies to",
            )
        out.append((key, _quantity(limit, where)))
    return tuple(sorted(out))


def _mps(value: Any, path: str) -> Mps:
    m = _mapping(value, path, MPS_FIELDS)
    pct = m.get("defaultActiveThreadPercentage")
    if pct is not None:
        pct = _percentage(pct, f"{path}.defaultActiveThreadPercentage")
    limit = m.get("defaultPinnedDeviceMemoryLimit")
    if limit is not None:
        limit = _quantity(limit, f"{path}.defaultPinnedDeviceMemoryLimit")
    per_device = m.get("defaultPerDevicePinnedMemoryLimit")
    if per_device is not None:
        per_device = _per_device(per_device, f"{path}.defaultPerDevicePinnedMemoryLimit")
    multi_user = m.get("multiUser")
    if multi_user is not None:
        if not isinstance(multi_user, bool):
            raise ConfigError(f"{path}.multiUser", f"must be a boolean, got {type_name(multi_user)}")
        if multi_user:
            raise ConfigError(
                f"{path}.multiUser",
                "dra-gpu does not run MPS in multi-user mode (NVIDIA's nvidia-cuda-mps-control -d "
                "-M): leave multiUser out or set it to false",
            )
    return Mps(
        default_active_thread_percentage=pct,
        default_pinned_device_memory_limit=limit,
        per_device_pinned_memory_limits=per_device or (),
        path=path,
    )


def _kind(value: Any) -> str:
    if value is None:
        raise ConfigError("kind", f"required: one of {', '.join(KINDS)}")
    kind = _string(value, "kind")
    what = UNSUPPORTED_CONFIG_KINDS.get(kind)
    if what is not None:
        noun = "device config" if kind.endswith("Config") else "custom resource, not a device config,"
        raise ConfigError("kind", f"{kind} is NVIDIA's {noun} for {what}, which dra-gpu does not do")
    if kind not in KINDS:
        raise ConfigError("kind", f"unknown kind {kind!r} of {API_VERSION} (known: {', '.join(KINDS)})")
    return kind


def _sharing(value: Any, kind: str) -> Sharing:
    s = _mapping(value, "sharing", SHARING_FIELDS[kind])
    strategy = s.get("strategy")
    if strategy is None:
        raise ConfigError("sharing.strategy", f"required: one of {', '.join(STRATEGIES)}")
    strategy = _string(strategy, "sharing.strategy")
    if strategy not in STRATEGIES:
        raise ConfigError(
            "sharing.strategy",
            f"unknown GPU sharing strategy {strategy!r} (supported: {', '.join(STRATEGIES)})",
        )
    ts_config, mps_config = s.get("timeSlicingConfig"), s.get("mpsConfig")
    if ts_config is not None and strategy != "TimeSlicing":
        raise ConfigError("sharing.timeSlicingConfig", f"not allowed with strategy {strategy}")
    if mps_config is not None and strategy != "MPS":
        raise ConfigError("sharing.mpsConfig", f"not allowed with strategy {strategy}")
    if strategy == "MPS":
        mps = _mps(mps_config, MPS_PATH) if mps_config is not None else Mps(path=MPS_PATH)
        return Sharing(strategy="MPS", mps=mps)
    if kind == "MigDeviceConfig":
        # NVIDIA's driver accepts TimeSlicing on a MIG device and applies nothing (time slices are
        # set per GPU); a MIG device shared by a claim's containers is time-shared anyway: Exclusive.
        return Sharing()
    interval = "Default"  # timeSlicingConfig missing, {} or without interval (NVIDIA would panic on {})
    if ts_config is not None:
        ts = _mapping(ts_config, "sharing.timeSlicingConfig", {"interval"})
        if ts.get("interval") is not None:
            interval = _string(ts["interval"], "sharing.timeSlicingConfig.interval")
            if interval not in INTERVALS:
                raise ConfigError(
                    "sharing.timeSlicingConfig.interval",
                    f"unknown time-slice interval {interval!r} (supported: {', '.join(INTERVALS)})",
                )
    return Sharing(strategy="TimeSlicing", time_slicing=TimeSlicing(interval))


def decode(parameters: Any) -> GpuConfig:
    """Decode NVIDIA's `opaque.parameters` strictly; raise ConfigError naming the field path."""
    if not isinstance(parameters, dict):
        raise ConfigError("", f"must be an object, got {type_name(parameters)}")
    api_version = parameters.get("apiVersion")
    if api_version is None:
        raise ConfigError("apiVersion", f"required: {API_VERSION!r}")
    if _string(api_version, "apiVersion") != API_VERSION:
        raise ConfigError("apiVersion", f"must be {API_VERSION!r}, got {api_version!r}")
    kind = _kind(parameters.get("kind"))
    doc = _mapping(parameters, "", {"apiVersion", "kind", "sharing"})
    sharing = Sharing() if doc.get("sharing") is None else _sharing(doc["sharing"], kind)
    return GpuConfig(kind=kind, sharing=sharing)
