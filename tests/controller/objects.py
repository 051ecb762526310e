"""Objects for the controller tests: published slices of simulated nodes, the GPU DeviceClass, claims."""

from __future__ import annotations

from typing import Any

from simnode.fake import discover_node

from dra_gpu.node.slices import build_slices

DRIVER = "gpu.dra-gpu.io"
GPU_SELECTOR = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "gpu"'
GPU_CLASS: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": "gpu.dra-gpu.io"},
    "spec": {"selectors": [{"cel": {"expression": GPU_SELECTOR}}]},
}


def node_slices(node: str = "node-a", profile: str = "hgx-2x4") -> list[dict[str, Any]]:
    return build_slices(discover_node(node, profile), DRIVER)


def claim(
    name: str,
    count: int = 1,
    selectors: list[str] | None = None,
    constraints: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    request: dict[str, Any] = {"deviceClassName": "gpu.dra-gpu.io", "count": count}
    if selectors:
        request["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    devices: dict[str, Any] = {"requests": [{"name": "gpus", "exactly": request}]}
    if constraints:
        devices["constraints"] = constraints
    devices.update(extra)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": devices},
    }


def allocated(name: str, pool: str, devices: list[str]) -> dict[str, Any]:
    c = claim(name, count=len(devices))
    c["status"] = {
        "allocation": {
            "devices": {
                "results": [{"request": "gpus", "driver": DRIVER, "pool": pool, "device": d} for d in devices]
            }
        }
    }
    return c


NVLINK = [{"matchAttribute": f"{DRIVER}/nvlinkDomain"}]


def device_names(slices: list[dict[str, Any]]) -> list[str]:
    return [d["name"] for s in slices for d in s["spec"]["devices"]]
