"""gpu.dra-gpu.io/v1alpha1: the opaque per-claim (and per-class) configuration of the driver.

Claims carry it in `spec.devices.config[].opaque.parameters` with `driver: gpu.dra-gpu.io`. The
admission webhook and the kubelet plugin both decode it with `decode()`, strictly: an unknown
field, a wrong type or an out-of-range value is an error naming the field path.

    apiVersion: gpu.dra-gpu.io/v1alpha1
    kind: GpuConfig                 # or MigDeviceConfig
    sharing:
      strategy: Exclusive           # Exclusive (default) | TimeSlicing (GpuConfig only) | MPS
      timeSlicing:                  # only with strategy TimeSlicing
        interval: Default           # Default | Short | Medium | Long
      mps:                          # only with strategy MPS
        defaultActiveThreadPercentage: 50      # 1..100
        defaultPinnedDeviceMemoryLimit: 10Gi   # a quantity >= 1Mi
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dra_gpu.common.decoding import type_name
from dra_gpu.kube.values import parse_quantity

GROUP = "gpu.dra-gpu.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KINDS = ("GpuConfig", "MigDeviceConfig")
STRATEGIES = {"GpuConfig": ("Exclusive", "TimeSlicing", "MPS"), "MigDeviceConfig": ("Exclusive", "MPS")}
INTERVALS = ("Default", "Short", "Medium", "Long")
MIN_PINNED_MEMORY = 1 << 20


class ConfigError(ValueError):
    """An invalid opaque config. `path` is the field path inside `parameters`."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.message = message


@dataclass(frozen=True)
class TimeSlicing:
    interval: str = "Default"


@dataclass(frozen=True)
class Mps:
    default_active_thread_percentage: int | None = None
    default_pinned_device_memory_limit: int | None = None  # bytes


@dataclass(frozen=True)
class Sharing:
    strategy: str = "Exclusive"
    time_slicing: TimeSlicing | None = None
    mps: Mps | None = None


@dataclass(frozen=True)
class GpuConfig:
    """Configuration for whole GPUs (kind GpuConfig) or MIG devices (kind MigDeviceConfig)."""

    kind: str
    sharing: Sharing

    def container_env(self, uuids: list[str]) -> dict[str, str]:
        """Environment the devices' containers get for this configuration."""
        env = {"DRA_GPU_SHARING_STRATEGY": self.sharing.strategy}
        if self.sharing.time_slicing is not None:
            env["DRA_GPU_TIME_SLICE_INTERVAL"] = self.sharing.time_slicing.interval
        mps = self.sharing.mps
        if mps is not None and mps.default_active_thread_percentage is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(mps.default_active_thread_percentage)
        if mps is not None and mps.default_pinned_device_memory_limit is not None:
            mib = mps.default_pinned_device_memory_limit >> 20
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(f"{u}={mib}M" for u in uuids)
        return env


DEFAULT_GPU_CONFIG = GpuConfig(kind="GpuConfig", sharing=Sharing())
DEFAULT_MIG_CONFIG = GpuConfig(kind="MigDeviceConfig", sharing=Sharing())


def _mapping(value: Any, path: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(path, f"must be an object, got {type_name(value)}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ConfigError(where, f"unknown field (known: {', '.join(sorted(allowed))})")
    return value


def _choice(value: Any, path: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise ConfigError(path, f"must be a string, got {type_name(value)}")
    if value not in choices:
        raise ConfigError(path, f"unknown value {value!r} (valid: {', '.join(choices)})")
    return value


def _mps(value: Any, path: str) -> Mps:
    m = _mapping(value, path, {"defaultActiveThreadPercentage", "defaultPinnedDeviceMemoryLimit"})
    pct = m.get("defaultActiveThreadPercentage")
    if pct is not None:
        p = f"{path}.defaultActiveThreadPercentage"
        if isinstance(pct, bool) or not isinstance(pct, int):
            raise ConfigError(p, f"must be an integer, got {type_name(pct)}")
        if not 1 <= pct <= 100:
            raise ConfigError(p, f"must be between 1 and 100, got {pct}")
    limit = m.get("defaultPinnedDeviceMemoryLimit")
    limit_bytes = None
    if limit is not None:
        p = f"{path}.defaultPinnedDeviceMemoryLimit"
        if not isinstance(limit, str | int) or isinstance(limit, bool):
            raise ConfigError(p, f"must be a quantity such as 10Gi, got {type_name(limit)}")
        try:
            q = parse_quantity(str(limit))
        except ValueError as exc:
            raise ConfigError(p, f"{limit!r} is not a quantity such as 10Gi") from exc
        if q < MIN_PINNED_MEMORY:
            raise ConfigError(p, f"must be at least 1Mi, got {limit}")
        limit_bytes = int(q.to_integral_value())
    return Mps(default_active_thread_percentage=pct, default_pinned_device_memory_limit=limit_bytes)


def decode(parameters: Any) -> GpuConfig:
    """Decode `opaque.parameters` strictly; raise ConfigError naming the field path."""
    doc = _mapping(parameters, "", {"apiVersion", "kind", "sharing"})
    api_version = doc.get("apiVersion")
    if api_version != API_VERSION:
        raise ConfigError("apiVersion", f"must be {API_VERSION!r}, got {api_version!r}")
    kind = _choice(doc.get("kind"), "kind", KINDS)
    sharing = Sharing()
    if doc.get("sharing") is not None:
        s = _mapping(doc["sharing"], "sharing", {"strategy", "timeSlicing", "mps"})
        strategy = _choice(s.get("strategy", "Exclusive"), "sharing.strategy", STRATEGIES[kind])
        time_slicing = mps = None
        if s.get("timeSlicing") is not None:
            if strategy != "TimeSlicing":
                raise ConfigError("sharing.timeSlicing", f"not allowed with strategy {strategy}")
            ts = _mapping(s["timeSlicing"], "sharing.timeSlicing", {"interval"})
            time_slicing = TimeSlicing(
                _choice(ts.get("interval", "Default"), "sharing.timeSlicing.interval", INTERVALS)
            )
        elif strategy == "TimeSlicing":
            time_slicing = TimeSlicing()
        if s.get("mps") is not None:
            if strategy != "MPS":
                raise ConfigError("sharing.mps", f"not allowed with strategy {strategy}")
            mps = _mps(s["mps"], "sharing.mps")
        elif strategy == "MPS":
            mps = Mps()
        sharing = Sharing(strategy=strategy, time_slicing=time_slicing, mps=mps)
    return GpuConfig(kind=kind, sharing=sharing)
