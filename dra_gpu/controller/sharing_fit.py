"""Whether a claim's sharing config can be applied to the devices its requests can get.

The scheduler does not read opaque configs, so a TimeSlicing config on a MIG request, or MPS
limits on a GPU below compute capability 7.0, would only fail at prepare, with the pod stuck.
Said at admission instead: an error when no candidate device of the request can take the config,
a warning when only some cannot (the scheduler may pick one of those).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dra_gpu.controller.allocator_view import Cluster
from dra_gpu.controller.claim_requests import parse_requests
from dra_gpu.controller.published_devices import Device
from dra_gpu.model.config import ConfigError, GpuConfig, decode

MPS_LIMITS_MIN_CC = (7, 0)


def _compute_capability(d: Device) -> tuple[int, int] | None:
    found = d.attribute(f"{d.driver}/cudaComputeCapability")
    if found is None:
        return None
    try:
        major, minor, *_ = (int(x) for x in str(found[1]).split("."))
    except ValueError:
        return None
    return major, minor


def problem(config: GpuConfig, d: Device) -> str | None:
    """Why `config` cannot be applied to device `d` (None: it can)."""
    kind = (d.attribute(f"{d.driver}/type") or ("", ""))[1]
    strategy = config.sharing.strategy
    if strategy == "TimeSlicing" and kind == "mig":
        return f"sharing.strategy: TimeSlicing cannot be set on MIG device {d.name} (time slices are per GPU)"
    mps = config.sharing.mps
    if strategy == "MPS" and mps is not None:
        limits = [
            name
            for name, value in (
                ("defaultActiveThreadPercentage", mps.default_active_thread_percentage),
                ("defaultPinnedDeviceMemoryLimit", mps.default_pinned_device_memory_limit),
                ("defaultPerDevicePinnedMemoryLimit", mps.per_device_pinned_memory_limits or None),
            )
            if value is not None
        ]
        cc = _compute_capability(d)
        if limits and cc is not None and cc < MPS_LIMITS_MIN_CC:
            return (
                f"{mps.path}.{limits[0]}: device {d.name} has compute capability {cc[0]}.{cc[1]}; "
                "MPS limits need 7.0 or newer"
            )
    return None


def _configs(spec: Mapping[str, Any], driver: str) -> list[tuple[int, list[str], GpuConfig]]:
    out = []
    for i, c in enumerate((spec.get("devices") or {}).get("config") or []):
        opaque = c.get("opaque") if isinstance(c, dict) else None
        if not isinstance(opaque, dict) or opaque.get("driver") != driver:
            continue
        try:
            out.append((i, [str(r) for r in c.get("requests") or []], decode(opaque.get("parameters"))))
        except ConfigError:
            continue  # reported as invalid elsewhere
    return out


def check(cluster: Cluster, spec: Mapping[str, Any], driver: str) -> tuple[list[str], list[str]]:
    """(errors, warnings), each "config[i]: request 'r': ..."."""
    errors: list[str] = []
    warnings: list[str] = []
    configs = _configs(spec, driver)
    if not configs:
        return errors, warnings
    requests, _ = parse_requests(spec)
    for req in requests:
        for sub in req.alternatives:
            candidates = [
                d for node in cluster.nodes for d in cluster.candidates(node, sub) if d.driver == driver
            ]
            for i, names, config in configs:
                explicit = req.name in names or sub.name in names
                if names and not explicit:
                    continue
                for_mig = config.kind == "MigDeviceConfig"
                # A config of the other kind is skipped for a device, unless it names the request.
                total = [d for d in candidates if explicit or _is_mig(d) == for_mig]
                bad = []
                for d in total:
                    why = problem(config, d)
                    if why is None and _is_mig(d) != for_mig:
                        noun = "MIG device" if _is_mig(d) else "GPU"
                        why = f"kind: {config.kind} cannot configure {noun} {d.name}"
                    if why is not None:
                        bad.append(why)
                if not bad:
                    continue
                where = f"config[{i}]: request {sub.name!r}"
                if len(bad) == len(total):
                    errors.append(f"{where}: {bad[0]}")
                else:
                    warnings.append(
                        f"{where}: {bad[0]} ({len(bad)} of its {len(total)} candidate devices cannot "
                        "take this config; prepare fails on those)"
                    )
    return errors, warnings


def _is_mig(d: Device) -> bool:
    return (d.attribute(f"{d.driver}/type") or ("", ""))[1] == "mig"
