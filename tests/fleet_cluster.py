"""A small cluster's API objects for the `dra-gpu top` tests and bench: the slices the driver
publishes for simulated nodes, claims allocated from them (whole GPUs, memory shares, MIG), the
pods reserving them, device taints in slices and DeviceTaintRules."""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass, field
from typing import Any

from simnode.fake import discover_node

from dra_gpu.node.slices import build_slices
from tests.controller.objects import DRIVER


def slices_of(
    node: str, profile: str, *, dynamic_mig: bool = False, memory_shares: bool = False
) -> list[dict[str, Any]]:
    return build_slices(
        discover_node(node, profile, dynamic_mig=dynamic_mig), DRIVER, memory_shares=memory_shares
    )


def devices_of(slices: list[dict[str, Any]], node: str) -> list[str]:
    return [
        d["name"] for s in slices if s["spec"]["pool"]["name"] == node for d in s["spec"].get("devices") or []
    ]


@dataclass
class Cluster:
    slices: list[dict[str, Any]] = field(default_factory=list)
    claims: list[dict[str, Any]] = field(default_factory=list)
    pods: list[dict[str, Any]] = field(default_factory=list)
    rules: list[dict[str, Any]] = field(default_factory=list)

    def add_node(self, node: str, profile: str, **options: Any) -> list[str]:
        new = slices_of(node, profile, **options)
        self.slices += new
        return devices_of(new, node)

    def hold(
        self,
        namespace: str,
        claim: str,
        node: str,
        devices: list[str],
        pod: str | None = None,
        memory: str | None = None,
        phase: str = "Running",
    ) -> dict[str, Any]:
        """A claim allocated `devices` of `node` (each a share of `memory` when given), reserved
        by `pod` (made too), as the scheduler leaves it."""
        results = []
        for d in devices:
            r: dict[str, Any] = {"request": "gpus", "driver": DRIVER, "pool": node, "device": d}
            if memory is not None:
                r["shareID"] = str(uuid.uuid4())
                r["consumedCapacity"] = {"memory": memory}
            results.append(r)
        obj: dict[str, Any] = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": claim, "namespace": namespace, "uid": str(uuid.uuid4())},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER}}]}},
            "status": {"allocation": {"devices": {"results": results}}},
        }
        if pod is not None:
            obj["status"]["reservedFor"] = [{"resource": "pods", "name": pod, "uid": str(uuid.uuid4())}]
            self.pods.append(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": pod, "namespace": namespace},
                    "spec": {
                        "nodeName": node,
                        "resourceClaims": [{"name": "gpus", "resourceClaimName": claim}],
                    },
                    "status": {"phase": phase},
                }
            )
        self.claims.append(obj)
        return obj

    def taint_in_slice(self, node: str, device: str, key: str, value: str, effect: str) -> None:
        for s in self.slices:
            if s["spec"]["pool"]["name"] != node:
                continue
            for d in s["spec"].get("devices") or []:
                if d["name"] == device:
                    d.setdefault("taints", []).append({"key": key, "value": value, "effect": effect})
                    return
        raise KeyError(device)

    def taint_rule(self, name: str, node: str, device: str, key: str, effect: str) -> dict[str, Any]:
        rule = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceTaintRule",
            "metadata": {"name": name},
            "spec": {
                "deviceSelector": {"driver": DRIVER, "pool": node, "device": device},
                "taint": {"key": key, "effect": effect},
            },
        }
        self.rules.append(rule)
        return rule

    def copy(self) -> Cluster:
        return copy.deepcopy(self)
