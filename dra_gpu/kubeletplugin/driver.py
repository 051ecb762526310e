"""What a DRA driver implements to plug into this layer (Go: kubeletplugin.DRAPlugin).

The layer speaks the kubelet's protocols and the Kubernetes API; the driver only answers for
claims (the layer reads each claim and checks its UID first, dra_gpu.kubeletplugin.claims), names
the devices it publishes and says how healthy they are. One claim at a time: the
layer fans a kubelet batch out concurrently, so one claim's failure or bug never fails the batch,
and it counts and times every claim the same way for every driver.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ClaimRef:
    """A ResourceClaim as the kubelet names it in NodePrepareResources / NodeUnprepareResources."""

    namespace: str
    uid: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid})"


class ClaimError(RuntimeError):
    """A claim that cannot be prepared or unprepared; the message goes back to the kubelet as is."""


class Device(Protocol):
    """One prepared device as the kubelet needs it (the DRA `Device` message)."""

    @property
    def request_names(self) -> Sequence[str]: ...
    @property
    def pool_name(self) -> str: ...
    @property
    def device_name(self) -> str: ...
    @property
    def cdi_device_ids(self) -> Sequence[str]: ...
    @property
    def share_id(self) -> str | None: ...


class Health(enum.Enum):
    UNKNOWN = "Unknown"
    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


@dataclass(frozen=True)
class DeviceHealth:
    pool_name: str
    device_name: str
    health: Health
    message: str = ""  # why, for the pod's status (the kubelet keeps <= 1024 characters)


class Driver(Protocol):
    async def prepare(self, ref: ClaimRef, claim: Mapping[str, Any]) -> Sequence[Device]:
        """The claim's devices with their CDI IDs; idempotent. `claim`: the ResourceClaim as read
        for this call, its UID the kubelet's. Raises ClaimError for a bad claim."""
        ...

    async def unprepare(self, claim: ClaimRef) -> None:
        """Undo prepare; a claim that was never prepared is fine. Raises ClaimError on failure."""
        ...

    def prepared_device_count(self) -> int:
        """Devices held by prepared claims (a metric)."""
        ...

    def resource_slices(self, generation: int) -> list[dict[str, Any]]:
        """This node's ResourceSlice objects with the given pool generation."""
        ...

    def device_health(self) -> list[DeviceHealth]:
        """The health of every published device, polled for the kubelet's health stream."""
        ...

    def slice_fields_dropped(self, fields: frozenset[str]) -> None:
        """The apiserver drops these fields of the slices (their feature gates are off there;
        names of publisher.GATED_SLICE_FIELDS): build the slices from now on without what would
        be wrong without them."""
        ...
