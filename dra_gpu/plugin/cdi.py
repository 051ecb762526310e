"""Per-claim CDI specs: build, version, encode, find (journal.Journal writes and removes them).

One spec file per claim (`k8s.<driver>-claim_<claimUID>.json`), kind `k8s.<driver>/claim`, devices
named `<claimUID>-<device>` so no two files ever define the same device (the CDI cache deletes
devices defined twice at equal priority). Edits every device of the claim needs (control nodes,
`NVIDIA_VISIBLE_DEVICES=void` and `DRA_GPU_VISIBLE_DEVICES`, the driver's libraries, binaries,
firmware and sockets) are spec-level `containerEdits`.

Each spec is self-contained: there is no node-wide base spec that claims reference. A base spec is
rewritten on a driver upgrade or a plugin restart while claims prepared before still name it, so a
claim's next container could start with other driver files than it was prepared with, or name a
device the base spec no longer has. A claim's own spec is written once, atomically, and removed
with the claim; the shared part is computed once per node and reused (driver_files), and measured
prepare latency is the same (bench/RESULTS.md).
"""

from __future__ import annotations

import errno
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLASS = "claim"
SPEC_MODE = 0o644  # containerd reads the specs; nothing in them is secret
_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
# The claim's GPU / MIG UUIDs, for programs in the container that want them.
VISIBLE_DEVICES_ENV = "DRA_GPU_VISIBLE_DEVICES"
# NVIDIA's "no devices" for its runtime's volume-mount device list, as NVIDIA's own CDI specs carry it.
VOID_MOUNT = {
    "hostPath": "/dev/null",
    "containerPath": "/var/run/nvidia-container-devices/void",
    "options": ["ro", "nosuid", "nodev", "bind"],
}
_DEVICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*[A-Za-z0-9]$|^[A-Za-z0-9]$")


def visible_devices_env(uuids: list[str]) -> dict[str, str]:
    """A claim's env: `NVIDIA_VISIBLE_DEVICES=void` (with VOID_MOUNT), so that an NVIDIA runtime or
    hook on the node (GPU Operator, nvidia-container-runtime) injects nothing a second time, as
    NVIDIA's own CDI specs do; the claim's UUIDs go to VISIBLE_DEVICES_ENV."""
    return {"NVIDIA_VISIBLE_DEVICES": "void", VISIBLE_DEVICES_ENV: ",".join(uuids)}


class CdiWriteError(OSError):
    """A spec that could not be written (directory full, read-only, ...); says which file."""

    def __init__(self, errno_: int | None, strerror: str | None, path: Path) -> None:
        super().__init__(errno_, strerror)
        self.path = path

    def __str__(self) -> str:
        name = errno.errorcode.get(self.errno or 0, "")
        return f"CDI spec {self.path}: {self.strerror}" + (f" ({name})" if name else "")


@dataclass(frozen=True)
class DeviceNode:
    path: str  # inside the container
    host_path: str  # on the host (differs from `path` on a simulated node)

    def to_cdi(self) -> dict[str, Any]:
        node: dict[str, Any] = {"path": self.path}
        if self.host_path != self.path:
            node["hostPath"] = self.host_path
        return node


@dataclass
class CdiDevice:
    name: str  # the pool's device name; the spec device is "<claimUID>-<name>"
    device_nodes: list[DeviceNode]
    env: dict[str, str] = field(default_factory=dict)
    mounts: list[dict[str, Any]] = field(default_factory=list)  # CDI mounts (an MPS pipe dir)
    hooks: list[dict[str, Any]] = field(default_factory=list)  # OCI hooks (a share's memory limit)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def minimum_version(spec: dict[str, Any]) -> str:
    """The lowest cdiVersion that can express `spec` (runtimes reject versions they don't know)."""
    need = "0.3.0"

    def bump(v: str) -> None:
        nonlocal need
        if _VERSIONS.index(v) > _VERSIONS.index(need):
            need = v

    edits = [spec.get("containerEdits", {})] + [d.get("containerEdits", {}) for d in spec["devices"]]
    if spec.get("annotations") or any(d.get("annotations") for d in spec["devices"]):
        bump("0.6.0")
    if "." in spec["kind"].split("/", 1)[1]:
        bump("0.6.0")
    if any(d["name"][0].isdigit() for d in spec["devices"]):
        bump("0.5.0")
    for e in edits:
        if any("hostPath" in n for n in e.get("deviceNodes", [])):
            bump("0.5.0")
        if any("type" in m for m in e.get("mounts", [])):
            bump("0.4.0")
        if e.get("additionalGids") or e.get("intelRdt"):
            bump("0.7.0")
        if e.get("netDevices"):
            bump("1.1.0")
    return need


class CdiSpecs:
    """The driver's per-claim specs in one CDI directory."""

    def __init__(self, cdi_dir: Path, driver: str) -> None:
        self.dir = cdi_dir
        self.vendor = f"k8s.{driver}"
        self.kind = f"{self.vendor}/{CLASS}"
        self.prefix = f"{self.vendor}-{CLASS}_"
        # The driver's edits (the same object until the installation changes), serialised once:
        # (the edits, each key's list items as JSON, the cdiVersion they need).
        self._driver_json: tuple[dict[str, Any], dict[str, str], str] | None = None

    def path(self, claim_uid: str) -> Path:
        return self.dir / f"{self.prefix}{claim_uid}.json"

    def is_spec_name(self, name: str) -> bool:
        """True for the name of one of this driver's claim spec files (what `path` makes)."""
        return name.startswith(self.prefix) and name.endswith(".json") and len(name) > len(self.prefix) + 5

    def device_id(self, claim_uid: str, device: str) -> str:
        return f"{self.kind}={claim_uid}-{device}"

    def build(
        self,
        claim_uid: str,
        devices: list[CdiDevice],
        control_nodes: list[DeviceNode],
        common_env: dict[str, str],
    ) -> dict[str, Any]:
        """The claim's own part of its spec (devices, control nodes, env); see `compose`."""
        spec_devices = []
        for dev in devices:
            name = f"{claim_uid}-{dev.name}"
            if not _DEVICE_NAME.match(name):
                raise ValueError(f"CDI device name {name!r} is not valid")
            edits: dict[str, Any] = {"deviceNodes": [n.to_cdi() for n in dev.device_nodes]}
            if dev.env:
                edits["env"] = [f"{k}={v}" for k, v in sorted(dev.env.items())]
            if dev.mounts:
                edits["mounts"] = list(dev.mounts)
            if dev.hooks:
                edits["hooks"] = list(dev.hooks)
            spec_devices.append({"name": name, "containerEdits": edits})
        spec: dict[str, Any] = {
            "cdiVersion": "",
            "kind": self.kind,
            "devices": spec_devices,
            "containerEdits": {
                "env": [f"{k}={v}" for k, v in sorted(common_env.items())],
                "deviceNodes": [n.to_cdi() for n in control_nodes],
                "mounts": [dict(VOID_MOUNT)],
            },
        }
        spec["cdiVersion"] = minimum_version(spec)
        return spec

    @staticmethod
    def compose(claim_spec: dict[str, Any], driver_edits: dict[str, Any]) -> dict[str, Any]:
        """The spec file's content: the claim's own part plus the node's driver user space (the
        same for every claim, see driver_files; shared, never copied or changed). The checkpoint
        records only the claim's part, so its size does not grow with the driver's files."""
        if not driver_edits:
            return claim_spec
        edits = dict(claim_spec["containerEdits"])
        for key, value in driver_edits.items():
            edits[key] = [*edits.get(key, []), *value]
        spec = {**claim_spec, "containerEdits": edits}
        spec["cdiVersion"] = minimum_version(spec)
        return spec

    def encode_composed(self, claim_spec: dict[str, Any], driver_edits: dict[str, Any]) -> bytes:
        """`encode(compose(claim_spec, driver_edits))`, byte for byte, with the driver's part
        (most of the file, the same for every claim) serialised once per driver installation."""
        if not driver_edits:
            return self.encode(claim_spec)
        if self._driver_json is None or self._driver_json[0] is not driver_edits:
            items = {k: _compact(v)[1:-1] for k, v in driver_edits.items()}
            needs = minimum_version({"kind": self.kind, "devices": [], "containerEdits": driver_edits})
            self._driver_json = (driver_edits, items, needs)
        _, items, needs = self._driver_json
        mine = claim_spec["containerEdits"]
        edits = []
        for key in [*mine, *(k for k in items if k not in mine)]:
            joined = ",".join(p for p in (_compact(mine.get(key, []))[1:-1], items.get(key, "")) if p)
            edits.append(f"{_compact(key)}:[{joined}]")
        version = max(claim_spec["cdiVersion"], needs, key=_VERSIONS.index)
        fields = []
        for key, value in claim_spec.items():
            if key == "containerEdits":
                encoded = "{" + ",".join(edits) + "}"
            else:
                encoded = _compact(version if key == "cdiVersion" else value)
            fields.append(f"{_compact(key)}:{encoded}")
        return ("{" + ",".join(fields) + "}\n").encode()

    @staticmethod
    def encode(spec: dict[str, Any]) -> bytes:
        # Compact: the C encoder (indent= falls back to the pure-Python one, ~4x slower).
        return _compact(spec).encode() + b"\n"

    def read(self, claim_uid: str) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads(self.path(claim_uid).read_bytes())
            return data
        except (FileNotFoundError, ValueError):
            return None

    def owned(self) -> dict[str, Path]:
        """Claim UID -> spec file, for every spec file of this driver in the directory."""
        if not self.dir.is_dir():
            return {}
        out = {}
        for path in self.dir.glob(f"{self.prefix}*.json"):
            out[path.name[len(self.prefix) : -len(".json")]] = path
        return out
