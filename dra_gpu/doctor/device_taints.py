"""Which devices of the driver are tainted, by their slices or by DeviceTaintRules, and the slices
as the scheduler sees them (the rules' taints added to their devices)."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from dra_gpu.doctor.cluster_view import ClusterView, object_name, object_spec
from dra_gpu.doctor.report import Result, ok, skip, warn
from dra_gpu.doctor.settings import ClusterSettings


def _rule_matches(rule: Mapping[str, Any], driver: str, pool: str, device: str) -> bool:
    sel = object_spec(rule).get("deviceSelector") or {}
    return all(
        not sel.get(field) or sel.get(field) == value
        for field, value in (("driver", driver), ("pool", pool), ("device", device))
    )


def _taint_text(t: Mapping[str, Any]) -> str:
    value = f"={t.get('value')}" if t.get("value") else ""
    return f"{t.get('key')}{value}:{t.get('effect')}"


def device_taints(view: ClusterView, driver: str) -> list[tuple[str, str, str]]:
    """(pool/device, taint, source) for every taint on a device of `driver`."""
    out = []
    for s in view.slices_of(driver):
        pool = str((object_spec(s).get("pool") or {}).get("name", ""))
        for d in object_spec(s).get("devices") or []:
            dev = str(d.get("name"))
            for t in d.get("taints") or []:
                out.append((f"{pool}/{dev}", _taint_text(t), "slice"))
            for rule in view.taint_rules:
                if _rule_matches(rule, driver, pool, dev):
                    taint = object_spec(rule).get("taint") or {}
                    out.append((f"{pool}/{dev}", _taint_text(taint), f"DeviceTaintRule {object_name(rule)}"))
    return out


def slices_with_rule_taints(view: ClusterView) -> list[dict[str, Any]]:
    """The slices as the scheduler sees them: DeviceTaintRules' taints added to their devices."""
    out = []
    for s in view.slices:
        s = copy.deepcopy(s)
        spec = object_spec(s)
        pool = str((spec.get("pool") or {}).get("name", ""))
        for d in spec.get("devices") or []:
            for rule in view.taint_rules:
                if _rule_matches(rule, str(spec.get("driver")), pool, str(d.get("name"))):
                    d.setdefault("taints", []).append(dict(object_spec(rule).get("taint") or {}))
        out.append(s)
    return out


def check_device_taints(view: ClusterView, settings: ClusterSettings) -> Iterable[Result]:
    name = "cluster/device-taints"
    if "slices" in view.errors:
        yield skip(name, view.errors["slices"])
        return
    taints = device_taints(view, settings.driver)
    if not taints:
        rules = "" if "devicetaintrules" in view.v1_resources else " (DeviceTaintRule not served)"
        yield ok(name, f"no device of {settings.driver} is tainted{rules}")
        return
    listed = "; ".join(f"{dev} {taint} ({src})" for dev, taint, src in taints[:10])
    more = f" and {len(taints) - 10} more" if len(taints) > 10 else ""
    rule_names = sorted({src.split(" ", 1)[1] for _, _, src in taints if src != "slice"})
    fix = "find the cause on the node (`dmesg | grep -i xid`, `nvidia-smi -q -d ECC,PAGE_RETIREMENT`)"
    if rule_names:
        fix += f"; once repaired: kubectl delete devicetaintrule {' '.join(rule_names)}"
    else:
        fix += "; the plugin clears its health taints after recovery"
    yield warn(name, f"{len(taints)} tainted: {listed}{more}", fix)
