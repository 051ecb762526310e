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

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
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


# A per-device key that is an index (into the sorted UUIDs of the devices a config applies to), as
# NVIDIA's driver reads one (Go's strconv.Atoi: an optional "+", decimal digits; [0-9], not \d).
INDEX_KEY = re.compile(r"\+?[0-9]+")
_MAX_INDEX_DIGITS = 18  # more is past any claim's devices (and Python's int() of huge strings)


@dataclass(frozen=True)
class Mps:
    default_active_thread_percentage: int | None = None
    default_pinned_device_memory_limit: int | None = None  # bytes
    # (key, bytes), sorted by key: a key is a device UUID or an index into the sorted UUIDs of the
    # devices the config applies to (resource.nvidia.com/v1beta1's defaultPerDevicePinnedMemoryLimit;
    # a tuple, not a dict, so that configs stay hashable: sharing groups devices by config).
    per_device_pinned_memory_limits: tuple[tuple[str, int], ...] = ()
    # Where these fields are in the config's parameters, for messages (sharing.mps in v1alpha1,
    # sharing.mpsConfig in v1beta1); not part of the value.
    path: str = field(default="sharing.mps", compare=False)

    def pinned_memory_limits(self, uuids: Collection[str]) -> dict[str, int]:
        """The pinned device memory limit (bytes) of each device this config applies to (`uuids`:
        all of them, in any order): the default for each, then the per-device limits, each for the
        device its key names (a UUID, or an index into the UUIDs sorted). ConfigError naming the key
        when it names none of the devices, or a device another key names too."""
        devices = sorted(set(uuids))
        default = self.default_pinned_device_memory_limit
        limits = dict.fromkeys(devices, default) if default is not None else {}
        named: dict[str, str] = {}
        for key, limit in self.per_device_pinned_memory_limits:
            path = f"{self.path}.defaultPerDevicePinnedMemoryLimit[{key}]"
            uuid = _device_of_key(key, devices)
            if uuid is None:
                listed = ", ".join(devices) or "none"
                raise ConfigError(
                    path,
                    f"names none of the {len(devices)} devices this config applies to (a key is one "
                    f"of their UUIDs or an index 0..{len(devices) - 1} into them sorted: {listed})",
                )
            if uuid in named:
                raise ConfigError(path, f"names device {uuid}, which key {named[uuid]!r} names too")
            named[uuid] = key
            limits[uuid] = limit
        return limits


def _device_of_key(key: str, devices: list[str]) -> str | None:
    """The device (of `devices`, sorted) a per-device key names: a UUID of them or an index."""
    if key in devices:
        return key
    if not INDEX_KEY.fullmatch(key):
        return None
    digits = key.lstrip("+").lstrip("0") or "0"
    if len(digits) > _MAX_INDEX_DIGITS:
        return None
    index = int(digits)
    return devices[index] if index < len(devices) else None


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

    def container_env(self, uuids: list[str], pinned: Mapping[str, int] | None = None) -> dict[str, str]:
        """Environment the devices' (`uuids`) containers get for this configuration. `pinned`: the
        pinned memory limit (bytes) by UUID, as `Mps.pinned_memory_limits` resolved it over every
        device the config applies to; None: resolved over `uuids` (ConfigError as it raises)."""
        env = {"DRA_GPU_SHARING_STRATEGY": self.sharing.strategy}
        if self.sharing.time_slicing is not None:
            env["DRA_GPU_TIME_SLICE_INTERVAL"] = self.sharing.time_slicing.interval
        mps = self.sharing.mps
        if mps is not None and mps.default_active_thread_percentage is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(mps.default_active_thread_percentage)
        if mps is not None:
            limits = mps.pinned_memory_limits(uuids) if pinned is None else pinned
            parts = [f"{u}={limits[u] >> 20}M" for u in uuids if u in limits]
            if parts:
                env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(parts)
        return env


DEFAULT_GPU_CONFIG = GpuConfig(kind="GpuConfig", sharing=Sharing())
DEFAULT_MIG_CONFIG = GpuConfig(kind="MigDeviceConfig", sharing=Sharing())


def _mapping(value: Any, path: str, allowed: set[str]) -> dict[str, Any]:
    """`value` as an object whose fields are all in `allowed` (shared by both opaque APIs)."""
    if not isinstance(value, dict):
        raise ConfigError(path, f"must be an object, got {type_name(value)}")
    for key in value:  # YAML can give other keys than strings
        if not isinstance(key, str):
            raise ConfigError(path, f"field names must be strings, got {type_name(key)}")
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
