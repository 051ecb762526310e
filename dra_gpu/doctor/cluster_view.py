"""Everything the cluster checks read, listed once with bounded calls: the API groups served,
nodes, slices, classes, claims, Pending pods, prepare-failure events, DeviceTaintRules and the
webhook configurations. A list that fails (RBAC, an API not served) is recorded, not raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dra_gpu.doctor.report import first_line
from dra_gpu.kube.api import RESOURCE_V1, Kube

FAILED_PREPARE = "FailedPrepareDynamicResources"  # the kubelet's event reason
LIST_KINDS = {"slices": "ResourceSlice", "classes": "DeviceClass", "claims": "ResourceClaim"}
WEBHOOKS = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"


@dataclass
class ClusterView:
    server_version: str = ""
    resource_versions: list[str] = field(default_factory=list)  # served versions of resource.k8s.io
    v1_resources: set[str] = field(default_factory=set)  # resource names in resource.k8s.io/v1
    nodes: list[dict[str, Any]] = field(default_factory=list)
    slices: list[dict[str, Any]] = field(default_factory=list)
    classes: list[dict[str, Any]] = field(default_factory=list)
    claims: list[dict[str, Any]] = field(default_factory=list)
    pending_pods: list[dict[str, Any]] = field(default_factory=list)
    prepare_events: list[dict[str, Any]] = field(default_factory=list)
    taint_rules: list[dict[str, Any]] = field(default_factory=list)
    webhook_configs: list[dict[str, Any]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # what could not be listed -> why

    def slices_of(self, driver: str) -> list[dict[str, Any]]:
        """The slices `driver` published."""
        return [s for s in self.slices if object_spec(s).get("driver") == driver]


async def load_view(kube: Kube, namespace: str | None, timeout: float) -> ClusterView:
    """Read the cluster; raises only when the API server cannot be reached at all."""
    view = ClusterView()
    version = await asyncio.wait_for(kube.get_json("/version"), timeout)
    view.server_version = str((version or {}).get("gitVersion", "?"))
    group = await asyncio.wait_for(kube.get_json("/apis/resource.k8s.io"), timeout)
    view.resource_versions = [str(v.get("version")) for v in (group or {}).get("versions") or []]
    if "v1" in view.resource_versions:
        v1 = await asyncio.wait_for(kube.get_json(RESOURCE_V1), timeout)
        view.v1_resources = {str(r.get("name")) for r in (v1 or {}).get("resources") or []}
    pods = f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"
    events = f"/api/v1/namespaces/{namespace}/events" if namespace else "/api/v1/events"
    lists: dict[str, tuple[str, str | None]] = {
        "nodes": ("/api/v1/nodes", None),
        "webhook_configs": (WEBHOOKS, None),
        "pending_pods": (pods, "status.phase=Pending"),
        "prepare_events": (events, f"reason={FAILED_PREPARE}"),
    }
    if "v1" in view.resource_versions:
        lists.update(
            slices=(f"{RESOURCE_V1}/resourceslices", None),
            classes=(f"{RESOURCE_V1}/deviceclasses", None),
            claims=(f"{RESOURCE_V1}/resourceclaims", None),
        )
        if "devicetaintrules" in view.v1_resources:
            lists["taint_rules"] = (f"{RESOURCE_V1}/devicetaintrules", None)

    async def one(attr: str, path: str, selector: str | None) -> None:
        try:
            items, _ = await asyncio.wait_for(kube.list_objects(path, selector), timeout)
            kind = LIST_KINDS.get(attr)
            for item in items if kind else ():  # a list's items carry no kind; the validator needs it
                item.setdefault("apiVersion", "resource.k8s.io/v1")
                item.setdefault("kind", kind)
            setattr(view, attr, items)
        except Exception as exc:  # RBAC, timeouts: that list is missing, the rest still runs
            view.errors[attr] = f"list {path}: {first_line(exc)}"

    await asyncio.gather(*(one(a, p, s) for a, (p, s) in lists.items()))
    return view


def object_meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """An object's metadata; empty when it has none or not a mapping."""
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def object_spec(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """An object's spec; empty when it has none or not a mapping."""
    spec = obj.get("spec")
    return spec if isinstance(spec, dict) else {}


def object_name(obj: Mapping[str, Any]) -> str:
    return str(object_meta(obj).get("name", ""))
