"""A prepared claim as the checkpoint records it: frozen, typed, parsed once.

`ClaimRecord.parse` reads one entry of the checkpoint's `claims` map and `to_json` writes it back
in the same shape. Fields this version does not know are kept (`extra`) and written back as they
were, so a file written by a newer plugin of the same format version loses nothing here; a known
field missing from an older entry reads as its default and stays missing when written back (an
empty optional field, `migInstances`, `sharing`, `rebuilt` or `deviceMetadata`, is not written).
The entry's fields are `ENTRY_FIELDS`; the checkpoint module's documentation of the file is
checked against them (tests/plugin/test_checkpoint_cdi.py).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

# The checkpoint's entry fields, each with what it holds; the checkpoint's docstring lists them all.
ENTRY_FIELDS: dict[str, str] = {
    "state": "started | bound | completed (ClaimState)",
    "namespace": "the claim's namespace",
    "name": "the claim's name",
    "devices": "the prepared devices, as the kubelet was answered",
    "cdiSpec": "the claim's own part of its CDI spec (null until it is planned in full)",
    "driverFiles": "digest of the driver installation the spec was made with",
    "migInstances": "dynamic MIG instances made or being made, each with its step",
    "sharing": "what sharing applied (compute modes, MPS daemons), to undo or re-adopt",
    "rebuilt": "true when the record was rebuilt from the CDI specs and the API",
    "deviceMetadata": "what its device metadata files (KEP-5304) were made from, when written",
}


class ClaimState(enum.StrEnum):
    # `started` is written before anything is made for the claim, `completed` after its CDI spec
    # is in place; a claim neither completed nor bound is rolled back at the next start.
    STARTED = "started"
    COMPLETED = "completed"
    # Dynamic MIG: the claim's instances were made before its pod was bound (binding conditions);
    # prepare then only writes the CDI spec. Kept across restarts, like completed.
    BOUND = "bound"
    UNKNOWN = ""  # missing, or written by a newer plugin (the value is kept in `extra`)


class MigStage(enum.StrEnum):
    """Steps of a dynamic MIG instance, recorded before each NVML call that makes something."""

    PLANNED = "planned"
    GPU_INSTANCE = "gpu-instance"
    READY = "ready"


MIG_PLANNED, MIG_GPU_INSTANCE, MIG_READY = MigStage.PLANNED, MigStage.GPU_INSTANCE, MigStage.READY

_MIG_KEYS = ("device", "parentUUID", "profileId", "start", "size", "step", "giId", "ciId", "uuid")
_DEVICE_KEYS = (
    "requestNames",
    "poolName",
    "deviceName",
    "cdiDeviceIds",
    "shareId",
    "adminAccess",
    "memoryLimit",
)


@dataclass(frozen=True)
class MigStep:
    """One dynamic MIG instance of a claim and the step it reached."""

    device: str
    parent_uuid: str
    profile_id: int
    start: int
    size: int
    step: str  # a MigStage (kept as written when a newer plugin wrote another)
    gi_id: int | None = None
    ci_id: int | None = None
    uuid: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> MigStep:
        def opt_int(key: str) -> int | None:
            value = raw.get(key)
            return None if value is None else int(value)

        return cls(
            device=str(raw.get("device")),
            parent_uuid=str(raw.get("parentUUID")),
            profile_id=int(raw.get("profileId", 0)),
            start=int(raw.get("start", 0)),
            size=int(raw.get("size", 0)),
            step=str(raw.get("step", "")),
            gi_id=opt_int("giId"),
            ci_id=opt_int("ciId"),
            uuid=None if raw.get("uuid") is None else str(raw["uuid"]),
            extra={k: v for k, v in raw.items() if k not in _MIG_KEYS},
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            **self.extra,
            "device": self.device,
            "parentUUID": self.parent_uuid,
            "profileId": self.profile_id,
            "start": self.start,
            "size": self.size,
            "step": str(self.step),
        }
        for key, value in (("giId", self.gi_id), ("ciId", self.ci_id), ("uuid", self.uuid)):
            if value is not None:
                out[key] = value
        return out

    @property
    def slices(self) -> set[int]:
        return set(range(self.start, self.start + self.size))


@dataclass(frozen=True)
class PreparedDevice:
    """A device of a prepared claim, as the kubelet is answered and the record keeps it."""

    request_names: list[str]
    pool_name: str
    device_name: str
    cdi_device_ids: list[str]
    share_id: str | None = None
    admin_access: bool = False
    # A memory share's: {"enforcedBy": "driver" | "cooperative", "reason": ...} (memory_limits)
    memory_limit: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "requestNames": list(self.request_names),
            "poolName": self.pool_name,
            "deviceName": self.device_name,
            "cdiDeviceIds": list(self.cdi_device_ids),
        }
        if self.share_id is not None:
            d["shareId"] = self.share_id
        if self.admin_access:
            d["adminAccess"] = True
        if self.memory_limit is not None:
            d["memoryLimit"] = dict(self.memory_limit)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PreparedDevice:
        """Lenient: a missing field reads as empty (the checkpoint's entries are not trusted)."""
        return cls(
            request_names=list(d.get("requestNames", [])),
            pool_name=str(d.get("poolName", "")),
            device_name=str(d.get("deviceName", "")),
            cdi_device_ids=list(d.get("cdiDeviceIds", [])),
            share_id=d.get("shareId"),
            admin_access=bool(d.get("adminAccess", False)),
            memory_limit=_memory_limit(d.get("memoryLimit")),
        )


def _memory_limit(raw: Any) -> dict[str, str] | None:
    if not isinstance(raw, Mapping):
        return None
    return {"enforcedBy": str(raw.get("enforcedBy", "")), "reason": str(raw.get("reason", ""))}


def _parse_device(raw: Mapping[str, Any]) -> tuple[PreparedDevice, dict[str, Any]]:
    return PreparedDevice.from_dict(raw), {k: v for k, v in raw.items() if k not in _DEVICE_KEYS}


@dataclass(frozen=True)
class MetadataInputs:
    """What a claim's device metadata files (KEP-5304, dra_gpu.plugin.device_metadata) are made
    from beyond its devices: the request names as allocated (`req` or `req/sub`, one per base
    request, in allocation order) and the pod's name for a claim made from a template."""

    requests: tuple[str, ...]
    pod_claim_name: str | None = None

    @property
    def base_requests(self) -> tuple[str, ...]:
        return tuple(r.split("/", 1)[0] for r in self.requests)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"requests": list(self.requests)}
        if self.pod_claim_name is not None:
            out["podClaimName"] = self.pod_claim_name
        return out

    @classmethod
    def parse(cls, raw: Any) -> MetadataInputs | None:
        """Lenient like the rest of the entry: anything but an object with a list of names is none."""
        if not isinstance(raw, Mapping) or not isinstance(raw.get("requests"), list):
            return None
        pod_claim_name = raw.get("podClaimName")
        return cls(
            requests=tuple(str(r) for r in raw["requests"]),
            pod_claim_name=None if pod_claim_name is None else str(pod_claim_name),
        )


@dataclass(frozen=True)
class ClaimRecord:
    """One claim's checkpoint entry. Replaced whole (`evolve`), never changed in place: the
    checkpoint hands out the record it holds, and caches its encoding."""

    uid: str
    state: ClaimState
    namespace: str = ""
    name: str = ""
    devices: tuple[PreparedDevice, ...] = ()
    cdi_spec: dict[str, Any] | None = None  # CDI's own JSON, not changed once recorded
    driver_files: str | None = None
    mig_steps: tuple[MigStep, ...] = ()
    sharing: dict[str, Any] | None = None  # dra_gpu.plugin.sharing's record
    rebuilt: bool = False
    metadata: MetadataInputs | None = None  # None: no device metadata written for the claim
    # Unknown fields (kept and written back), the unknown keys of each device, and the known
    # fields an older entry lacks (not written back, so the entry keeps its shape).
    extra: Mapping[str, Any] = field(default_factory=dict)
    device_extra: tuple[Mapping[str, Any], ...] = ()
    absent: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, uid: str, raw: Mapping[str, Any]) -> ClaimRecord:
        extra = {k: v for k, v in raw.items() if k not in ENTRY_FIELDS}
        state_value = raw.get("state", "")
        try:
            state = ClaimState(state_value)
        except ValueError:
            state = ClaimState.UNKNOWN
        if state == ClaimState.UNKNOWN and "state" in raw:
            extra["state"] = state_value
        parsed = [_parse_device(d) for d in raw.get("devices") or []]
        spec = raw.get("cdiSpec")
        steps = raw.get("migInstances")
        sharing = raw.get("sharing")
        return cls(
            uid=uid,
            state=state,
            namespace=str(raw.get("namespace", "")),
            name=str(raw.get("name", "")),
            devices=tuple(d for d, _ in parsed),
            cdi_spec=spec if isinstance(spec, dict) else None,
            driver_files=None if raw.get("driverFiles") is None else str(raw["driverFiles"]),
            mig_steps=tuple(MigStep.parse(m) for m in steps) if isinstance(steps, list) else (),
            sharing=sharing if isinstance(sharing, dict) else None,
            rebuilt=bool(raw.get("rebuilt", False)),
            metadata=MetadataInputs.parse(raw.get("deviceMetadata")),
            extra=extra,
            device_extra=tuple(e for _, e in parsed) if any(e for _, e in parsed) else (),
            absent=frozenset(
                k for k in ("namespace", "name", "devices", "cdiSpec", "driverFiles") if k not in raw
            ),
        )

    def to_json(self) -> dict[str, Any]:
        """The entry as the checkpoint file holds it (a new dict each call)."""
        out: dict[str, Any] = dict(self.extra)
        if self.state != ClaimState.UNKNOWN:
            out["state"] = str(self.state)
        devices = []
        for i, device in enumerate(self.devices):
            kept = self.device_extra[i] if i < len(self.device_extra) else {}
            devices.append({**kept, **device.to_dict()})
        fields: dict[str, Any] = {
            "namespace": self.namespace,
            "name": self.name,
            "devices": devices,
            "cdiSpec": self.cdi_spec,
            "driverFiles": self.driver_files,
        }
        out.update((k, v) for k, v in fields.items() if k not in self.absent)
        if self.mig_steps:
            out["migInstances"] = [m.to_json() for m in self.mig_steps]
        if self.sharing:
            out["sharing"] = self.sharing
        if self.rebuilt:
            out["rebuilt"] = True
        if self.metadata is not None:
            out["deviceMetadata"] = self.metadata.to_json()
        return out

    def evolve(self, **changes: Any) -> ClaimRecord:
        """A copy with `changes`; a known field changed is written even if the entry lacked it."""
        absent = self.absent - {_JSON_NAME.get(k, k) for k in changes}
        if "devices" in changes:
            changes["device_extra"] = ()
        return replace(self, **changes, absent=absent)

    # -- the views tests and tools read (JSON-shaped) ----------------------------------------------

    @property
    def raw(self) -> dict[str, Any]:
        """The entry as JSON (a new dict: changing it changes nothing)."""
        return self.to_json()

    @property
    def mig_instances(self) -> list[dict[str, Any]]:
        """The MIG steps as JSON."""
        return [m.to_json() for m in self.mig_steps]

    @property
    def device_names(self) -> set[str]:
        """The devices the claim holds (those held for admin access excepted)."""
        return {d.device_name for d in self.devices if not d.admin_access}

    def status_devices(self) -> list[dict[str, Any]]:
        """The devices as the claim's status is written from them: as recorded, and a dynamic-MIG
        device's instance UUID (`migUUID`) once made."""
        made = {m.device: m.uuid for m in self.mig_steps if m.uuid is not None}
        out = []
        for d in self.devices:
            entry = d.to_dict()
            if d.device_name in made:
                entry["migUUID"] = made[d.device_name]
            out.append(entry)
        return out

    @property
    def settled(self) -> bool:
        """Completed or bound: kept across restarts (anything else is rolled back)."""
        return self.state in (ClaimState.COMPLETED, ClaimState.BOUND)

    def ref(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid})"


_JSON_NAME = {
    "cdi_spec": "cdiSpec",
    "driver_files": "driverFiles",
}  # of the fields in `absent`, those named otherwise in JSON
