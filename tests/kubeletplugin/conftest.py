"""A GPU-free driver for the kubelet-plugin layer: the layer must work with any driver."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dra_gpu.kubeletplugin.driver import ClaimError, ClaimRef, DeviceHealth, Health

DRIVER = "gpu.example.com"
NODE = "node-a"


@dataclass(frozen=True)
class Device:
    request_names: list[str]
    pool_name: str
    device_name: str
    cdi_device_ids: list[str]
    share_id: str | None = None


def slice_of(name: str, devices: list[str], generation: int, count: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": generation, "resourceSliceCount": count},
            "devices": [{"name": d, "capacity": {"memory": {"value": "1Gi"}}} for d in devices],
        },
    }


@dataclass
class FakeClaims:
    """The apiserver's ResourceClaims, by name: each exists with the UID `uids` gives it (default
    `uid-<name>`), except those named `gone-*`."""

    uids: dict[str, str] = field(default_factory=dict)
    gets: int = 0

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.gets += 1
        if name.startswith("gone-"):
            return None
        return {"metadata": {"namespace": namespace, "name": name, "uid": self.uids.get(name, f"uid-{name}")}}


@dataclass
class FakeDriver:
    """Devices `dev-0`..; a claim named `bad-*` fails with a ClaimError, `bug-*` with a bug."""

    devices: list[str] = field(default_factory=lambda: ["dev-0", "dev-1", "dev-2"])
    slices_per_node: int = 1
    unhealthy: set[str] = field(default_factory=set)
    prepared: dict[str, list[Device]] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)
    dropped: frozenset[str] = frozenset()  # what the publisher said the apiserver drops

    async def prepare(self, claim: ClaimRef, resource_claim: Mapping[str, Any]) -> list[Device]:
        assert resource_claim["metadata"]["uid"] == claim.uid  # the layer checked it
        self.calls.append(("prepare", claim.name))
        await asyncio.sleep(0)  # claims of one batch run concurrently
        _fail_if_asked(claim)
        devices = [
            Device(["gpus"], NODE, self.devices[0], [f"k8s.{DRIVER}/claim={claim.uid}"], share_id="share-1"),
            Device([], NODE, self.devices[1], []),
        ]
        self.prepared[claim.uid] = devices
        return devices

    async def unprepare(self, claim: ClaimRef) -> None:
        self.calls.append(("unprepare", claim.name))
        _fail_if_asked(claim)
        self.prepared.pop(claim.uid, None)

    def prepared_device_count(self) -> int:
        return sum(len(d) for d in self.prepared.values())

    def resource_slices(self, generation: int) -> list[dict[str, Any]]:
        n = self.slices_per_node
        return [slice_of(f"{NODE}-{DRIVER}-{i}", self.devices[i::n], generation, count=n) for i in range(n)]

    def slice_fields_dropped(self, fields: frozenset[str]) -> None:
        self.dropped = fields

    def device_health(self) -> list[DeviceHealth]:
        return [
            DeviceHealth(NODE, d, Health.UNHEALTHY if d in self.unhealthy else Health.HEALTHY)
            for d in self.devices
        ]


def _fail_if_asked(claim: ClaimRef) -> None:
    if claim.name.startswith("bad-"):
        raise ClaimError(f"claim {claim}: not allocated")
    if claim.name.startswith("bug-"):
        raise KeyError("allocation")
