"""The plugin's crash-safe record of prepared claims.

File layout (JSON), versioned so that an older reader never chokes on a newer writer:

    {"version": 1, "checksum": "<sha256 of canonical data>", "data": {
        "bootId": "...", "claims": {"<uid>": {"state": "started" | "completed", "namespace": ..,
        "name": .., "devices": [...], "cdiSpec": {...}}}}}

Readers keep fields they do not know (they stay in the dicts and are written back), and the
checksum is over canonical JSON of whatever is there, so adding a field never makes an old file
"corrupt". A checkpoint written during another boot is discarded: CDI specs under /var/run and
device state do not survive a reboot, and the kubelet prepares the claims again.

A corrupt file (truncated, bytes flipped, not JSON) is moved aside with a log line and replaced by
an empty checkpoint marked `rebuildPending`: the plugin then rebuilds the records from what
survives (the claims' CDI specs and the claims allocated to this node in the API, see
Preparer.rebuild) before it serves, and the mark stays until that succeeded, so a crash or an
unreachable apiserver meanwhile never makes a later start take the empty file for the truth.
A file of a newer format version is refused (CheckpointVersionError) and left as it is: a newer
plugin may have recorded what this one cannot undo, and a downgrade must not lose it.

Each claim goes through two phases: `started` is written before anything is created for it and
`completed` after its CDI spec is in place, so a crash in between is rolled back at the next start.
A claim with dynamic MIG devices also records each instance's step (`migInstances`: planned, then
the GPU instance's ID, then the compute instance and MIG UUID), each written before the next NVML
call, so the rollback finds and destroys exactly what was made.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dra_gpu.durable import atomic_write

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
REBUILD_PENDING = "rebuildPending"
STARTED, COMPLETED = "started", "completed"
# Dynamic MIG: the claim's instances were made before its pod was bound (binding conditions);
# prepare then only writes the CDI spec. Kept across restarts, like completed.
BOUND = "bound"
BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")


def current_boot_id(path: Path = BOOT_ID_FILE) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return "unknown"


def _compact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _checksum(data: dict[str, Any]) -> str:
    return hashlib.sha256(_compact(data).encode()).hexdigest()


class CheckpointVersionError(RuntimeError):
    """The checkpoint was written by a newer format version; nothing was read or changed."""


class CheckpointRebuildError(RuntimeError):
    """A corrupt checkpoint's records could not be rebuilt (the API did not answer); the mark
    stays, so the next start tries again."""


@dataclass
class ClaimRecord:
    uid: str
    raw: dict[str, Any]  # the stored entry, including fields this version does not know

    @property
    def state(self) -> str:
        return str(self.raw.get("state", ""))

    @property
    def namespace(self) -> str:
        return str(self.raw.get("namespace", ""))

    @property
    def name(self) -> str:
        return str(self.raw.get("name", ""))

    @property
    def devices(self) -> list[dict[str, Any]]:
        return list(self.raw.get("devices", []))

    @property
    def device_names(self) -> set[str]:
        return {d["deviceName"] for d in self.devices if not d.get("adminAccess")}

    @property
    def mig_instances(self) -> list[dict[str, Any]]:
        """Dynamic MIG instances made (or being made) for the claim, with the step reached."""
        value = self.raw.get("migInstances")
        return list(value) if isinstance(value, list) else []

    @property
    def cdi_spec(self) -> dict[str, Any] | None:
        spec = self.raw.get("cdiSpec")
        return spec if isinstance(spec, dict) else None

    def ref(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid})"


class Checkpoint:
    """In-memory view of the checkpoint file. Prepare stages changes in memory and makes them
    durable with `write(encode())` (grouped, see prepare._commit); reconcile's removals write at once."""

    def __init__(self, path: Path, boot_id: str | None = None) -> None:
        self.path = path
        self.boot_id = boot_id or current_boot_id()
        self._data: dict[str, Any] = {"bootId": self.boot_id, "claims": {}}
        # uid -> (the entry, its canonical JSON): entries are replaced whole, never changed in
        # place, so an unchanged entry is not serialised again on every write.
        self._encoded: dict[str, tuple[dict[str, Any], str]] = {}
        # uid -> (the entry, the devices it holds): a prepare checks its devices against every
        # other claim's, and rebuilding each claim's set every time was quadratic in a burst.
        self._held: dict[str, tuple[dict[str, Any], frozenset[str]]] = {}
        self._load()

    def _load(self) -> None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        try:
            doc = json.loads(raw)
            version = doc.get("version", 0)
            # Checked before anything else: a newer format may have another layout.
            if isinstance(version, int) and version > FORMAT_VERSION:
                raise CheckpointVersionError(
                    f"checkpoint {self.path} has format version {version}, newer than this plugin's "
                    f"{FORMAT_VERSION}: it was written by a newer dra-gpu, whose records this one cannot "
                    "read; run that version (or move the file away, losing its records), the file is "
                    "left unchanged"
                )
            data = doc["data"]
            if not isinstance(data, dict) or not isinstance(data.get("claims"), dict):
                raise ValueError("no claims map")
            if doc.get("checksum") != _checksum(data):
                raise ValueError("checksum mismatch")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            self.path.rename(aside)
            log.error(
                "checkpoint corrupt, moved aside; rebuilding its records from the CDI specs and the "
                "API path=%s moved_to=%s error=%r",
                self.path,
                aside,
                str(exc),
            )
            self._data[REBUILD_PENDING] = True
            self._save()  # the mark is durable before anything relies on the empty state
            return
        if data.get("bootId") != self.boot_id:
            log.warning(
                "checkpoint from another boot discarded path=%s claims=%d", self.path, len(data["claims"])
            )
            self._save()
            return
        self._data = data

    @property
    def rebuild_pending(self) -> bool:
        """The file was corrupt: its records must be rebuilt before the plugin serves."""
        return bool(self._data.get(REBUILD_PENDING))

    def rebuilt(self) -> None:
        """Clear the rebuild mark and write the rebuilt records, in one atomic write."""
        self._data.pop(REBUILD_PENDING, None)
        self._save()

    def _save(self) -> None:
        self.write(self.encode())

    def encode(self) -> bytes:
        """The file content for the current state (data serialised once, checksummed as is)."""
        canonical = self._canonical()
        checksum = hashlib.sha256(canonical.encode()).hexdigest()
        return (f'{{"version":{FORMAT_VERSION},"checksum":"{checksum}","data":{canonical}}}\n').encode()

    def _canonical(self) -> str:
        """`json.dumps(self._data, sort_keys=True, separators=(",", ":"))`, built from each claim's
        cached encoding (the only part that grows with the node's claims)."""
        claims: dict[str, dict[str, Any]] = self._data["claims"]
        parts = []
        encoded = {}
        for uid in sorted(claims):
            entry = claims[uid]
            cached = self._encoded.get(uid)
            if cached is None or cached[0] is not entry:
                cached = (entry, _compact(entry))
            encoded[uid] = cached
            parts.append(f"{json.dumps(uid)}:{cached[1]}")
        self._encoded = encoded
        top = []
        for key in sorted(self._data):
            value = "{" + ",".join(parts) + "}" if key == "claims" else _compact(self._data[key])
            top.append(f"{json.dumps(key)}:{value}")
        return "{" + ",".join(top) + "}"

    def write(self, blob: bytes) -> None:
        atomic_write(self.path, blob)

    def stage(self, uid: str, entry: dict[str, Any] | None) -> dict[str, Any] | None:
        """Change the in-memory state only (the caller writes it); returns the previous entry.

        The entry is taken over, not copied (a deep copy was the largest CPU cost of a prepare):
        the caller builds it fresh and never changes it afterwards; entries are replaced whole."""
        claims: dict[str, dict[str, Any]] = self._data["claims"]
        old = claims.get(uid)
        if entry is None:
            claims.pop(uid, None)
            self._held.pop(uid, None)
        else:
            claims[uid] = entry
        return old

    def holder(self, names: set[str], other_than: str) -> tuple[str, ClaimRecord] | None:
        """The first claim but `other_than` whose record holds one of `names` (devices held for
        admin access excepted), with that device; None when they are all free."""
        if not names:
            return None
        for uid, entry in self._data["claims"].items():
            if uid == other_than:
                continue
            held = self._held.get(uid)
            if held is None or held[0] is not entry:
                held = self._held[uid] = (entry, frozenset(ClaimRecord(uid, entry).device_names))
            clash = names & held[1]
            if clash:
                return min(clash), ClaimRecord(uid, entry)
        return None

    def has(self, uid: str) -> bool:
        return uid in self._data["claims"]

    def get(self, uid: str) -> ClaimRecord | None:
        raw = self._data["claims"].get(uid)
        return ClaimRecord(uid, copy.deepcopy(raw)) if raw is not None else None

    def view(self, uid: str) -> ClaimRecord | None:
        """Like get(), without copying: read-only use on the hot path."""
        raw = self._data["claims"].get(uid)
        return ClaimRecord(uid, raw) if raw is not None else None

    def records(self) -> list[ClaimRecord]:
        return [ClaimRecord(uid, copy.deepcopy(raw)) for uid, raw in self._data["claims"].items()]

    def views(self) -> list[ClaimRecord]:
        """Like records(), without copying: read-only use on the hot path."""
        return [ClaimRecord(uid, raw) for uid, raw in self._data["claims"].items()]

    def put(self, uid: str, entry: dict[str, Any]) -> None:
        old = self._data["claims"].get(uid)
        self._data["claims"][uid] = copy.deepcopy(entry)
        try:
            self._save()
        except BaseException:
            if old is None:
                self._data["claims"].pop(uid, None)
            else:
                self._data["claims"][uid] = old
            raise

    def remove(self, uid: str) -> bool:
        old = self._data["claims"].pop(uid, None)
        if old is None:
            return False
        self._held.pop(uid, None)
        try:
            self._save()
        except BaseException:
            self._data["claims"][uid] = old
            raise
        return True
