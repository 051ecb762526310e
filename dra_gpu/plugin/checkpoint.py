"""The plugin's crash-safe record of prepared claims.

File layout (JSON), versioned so that an older reader never chokes on a newer writer:

    {"version": 1, "checksum": "<sha256 of canonical data>", "data": {
        "bootId": "...", "claims": {"<uid>": <entry>}}}

An entry is one claim's record (`record.ClaimRecord`, which alone reads and writes it):

    state         started | bound | completed
    namespace     the claim's namespace
    name          the claim's name
    devices       the prepared devices, as the kubelet was answered: [{"requestNames",
                  "poolName", "deviceName", "cdiDeviceIds", "shareId"?, "adminAccess"?}]
    cdiSpec       the claim's own part of its CDI spec (null until it is planned in full); the
                  file adds the driver's user space
    driverFiles   digest of the driver installation the spec was made with
    migInstances  dynamic MIG instances made or being made: [{"device", "parentUUID",
                  "profileId", "start", "size", "step": planned | gpu-instance | ready,
                  "giId"?, "ciId"?, "uuid"?}]
    sharing       what sharing applied (compute modes, MPS daemons), to undo or re-adopt
    rebuilt       true when the record was rebuilt from the CDI specs and the API
    deviceMetadata  what its device metadata files (KEP-5304) were made from, when they were
                  written: {"requests": [request names as allocated], "podClaimName"?}; the
                  devices' first of each request then carries the metadata's CDI ID

Readers keep fields they do not know (`ClaimRecord.extra`, written back as they were), and the
checksum is over canonical JSON of whatever is there, so adding a field never makes an old file
"corrupt". A checkpoint written during another boot is discarded: CDI specs under /var/run and
device state do not survive a reboot, and the kubelet prepares the claims again. So the file is
replaced atomically but not fsynced (dra_gpu.common.durable): a power loss leaves nothing to restore.

A power loss may tear a write that was not synced, though (an empty or half-written file on some
file systems), and a torn file of another boot must be discarded like an intact one, not taken
for a corrupt file of this boot and rebuilt. The boot mark (`checkpoint.json.boot`, the boot ID
of the last start, written durably once per boot) tells the two apart: a file unreadable at a
start whose mark names another boot was written in that boot, and is discarded.

A corrupt file of this boot (truncated, bytes flipped, not JSON) is moved aside with a log line
and replaced by an empty checkpoint marked `rebuildPending`: the plugin then rebuilds the records from what
survives (the claims' CDI specs and the claims allocated to this node in the API, see
reconcile.Reconciler.rebuild) before it serves, and the mark stays until that succeeded, so a crash or an
unreachable apiserver meanwhile never makes a later start take the empty file for the truth.
A file of a newer format version is refused (CheckpointVersionError) and left as it is: a newer
plugin may have recorded what this one cannot undo, and a downgrade must not lose it.

Each claim goes through two phases: `started` is written before anything is created for it and
`completed` after its CDI spec is in place, so a crash in between is rolled back at the next start;
a claim whose dynamic MIG instances were made before its pod was bound is `bound` until then.
A claim with dynamic MIG devices also records each instance's step (`migInstances`: planned, then
the GPU instance's ID, then the compute instance and MIG UUID), each written before the next NVML
call, so the rollback finds and destroys exactly what was made.

Two instances of the plugin share the file during a rolling update, one at a time (the instance
lock, dra_gpu.kubeletplugin.instance_lock). Each remembers the identity of the file it last read
or wrote (inode, mtime, size: every write is a new file renamed over the old); when the lock is
taken anew and the file is not the one remembered, the other instance wrote it and `reload` reads
it again (`changed_on_disk` is one stat, the single-instance path pays no more).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dra_gpu.common import failpoints
from dra_gpu.common.durable import replace_atomically, replace_durably
from dra_gpu.plugin.record import ClaimRecord, ClaimState

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
REBUILD_PENDING = "rebuildPending"
STARTED, COMPLETED, BOUND = ClaimState.STARTED, ClaimState.COMPLETED, ClaimState.BOUND
BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")
BOOT_MARK_SUFFIX = ".boot"  # beside the checkpoint: the boot ID of the plugin's last start


def _verified_data(doc: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint document's data when it verifies (a claims map, the checksum over it);
    ValueError saying what does not."""
    data = doc.get("data")
    if not isinstance(data, dict) or not isinstance(data.get("claims"), dict):
        raise ValueError("no claims map")
    if doc.get("checksum") != _checksum(data):
        raise ValueError("checksum mismatch")
    return data


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


class Checkpoint:
    """In-memory view of the checkpoint file. Prepare stages changes in memory and makes them
    durable with `write(encode())` (grouped, see journal.Journal.commit); reconcile's removals write
    at once. Only the journal changes it."""

    def __init__(self, path: Path, boot_id: str | None = None) -> None:
        self.path = path
        self.boot_mark = path.with_name(path.name + BOOT_MARK_SUFFIX)
        self.boot_id = boot_id or current_boot_id()
        self._data: dict[str, Any] = {"bootId": self.boot_id, "claims": {}}
        # uid -> (the entry, its canonical JSON): entries are replaced whole, never changed in
        # place, so an unchanged entry is not serialised again on every write.
        self._encoded: dict[str, tuple[dict[str, Any], str]] = {}
        # uid -> the parsed record of its entry (entries read from the file are parsed on first use).
        self._records: dict[str, ClaimRecord] = {}
        # uid -> (the record, the devices it holds): a prepare checks its devices against every
        # other claim's, and rebuilding each claim's set every time was quadratic in a burst.
        self._held: dict[str, tuple[ClaimRecord, frozenset[str]]] = {}
        # The file as this instance last read or wrote it (another instance may write it too).
        self._seen: tuple[int, int, int, int] | None = None
        marked = self._marked_boot()
        self._load(marked)
        if marked != self.boot_id:
            # After the load: until this is on disk, an unreadable file counts as another boot's.
            replace_durably(self.boot_mark, f"{self.boot_id}\n".encode())

    def _marked_boot(self) -> str | None:
        """The boot ID of the plugin's last start; None where no start wrote one (a first start,
        or a plugin that fsynced every checkpoint write)."""
        try:
            return self.boot_mark.read_text().strip() or None
        except (FileNotFoundError, UnicodeDecodeError):
            return None

    def _identity(self) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size

    def changed_on_disk(self) -> bool:
        """Whether the file is not the one this instance last read or wrote (one stat)."""
        return self._identity() != self._seen

    def reload(self) -> None:
        """Read the file again, as another instance of the plugin left it (under the instance
        lock). Raises CheckpointVersionError for a newer format and ValueError for a file that
        does not verify; the state in memory is then left as it was."""
        seen = self._identity()
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            self._seen = None
            return
        doc = json.loads(raw)
        version = doc.get("version", 0)
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise CheckpointVersionError(
                f"checkpoint {self.path} was rewritten by another instance of the plugin in format "
                f"version {version}, newer than this plugin's {FORMAT_VERSION}; this instance cannot "
                "read its records"
            )
        try:
            data = _verified_data(doc)
        except ValueError as exc:
            raise ValueError(f"checkpoint {self.path} as another instance wrote it: {exc}") from exc
        before = len(self._data["claims"])
        self._data = data
        self._encoded, self._records, self._held = {}, {}, {}
        self._seen = seen
        log.info(
            "checkpoint re-read, another plugin instance changed it path=%s claims_before=%d claims=%d",
            self.path,
            before,
            len(data["claims"]),
        )

    def _load(self, marked: str | None) -> None:
        try:
            self._seen = self._identity()
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
            data = _verified_data(doc)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if marked is not None and marked != self.boot_id:
                log.warning(
                    "checkpoint of another boot unreadable (a power loss tears a write that was not "
                    "synced), discarded path=%s error=%r",
                    self.path,
                    str(exc),
                )
                self._save()
                return
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
            self._save()  # the mark is on disk before anything relies on the empty state
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
        # Not fsynced: the records are scoped to the boot (module docstring, dra_gpu.common.durable).
        replace_atomically(self.path, blob, failpoint=failpoints.CHECKPOINT_AFTER_TEMP)
        self._seen = self._identity()

    def stage(self, uid: str, entry: ClaimRecord | Mapping[str, Any] | None) -> None:
        """Change the in-memory state only (the caller writes it). Records are frozen and replaced
        whole, so the one held is handed out as it is and its encoding is cached."""
        claims: dict[str, dict[str, Any]] = self._data["claims"]
        if entry is None:
            claims.pop(uid, None)
            self._records.pop(uid, None)
            self._held.pop(uid, None)
            return
        record = entry if isinstance(entry, ClaimRecord) else ClaimRecord.parse(uid, entry)
        claims[uid] = record.to_json()
        self._records[uid] = record

    def holder(self, names: set[str], other_than: str) -> tuple[str, ClaimRecord] | None:
        """The first claim but `other_than` whose record holds one of `names` (devices held for
        admin access excepted), with that device; None when they are all free."""
        if not names:
            return None
        for uid in self._data["claims"]:
            if uid == other_than:
                continue
            record = self._record(uid)
            held = self._held.get(uid)
            if held is None or held[0] is not record:
                held = self._held[uid] = (record, frozenset(record.device_names))
            clash = names & held[1]
            if clash:
                return min(clash), record
        return None

    def has(self, uid: str) -> bool:
        return uid in self._data["claims"]

    def _record(self, uid: str) -> ClaimRecord:
        record = self._records.get(uid)
        if record is None:  # read from the file: parsed once, on first use
            record = self._records[uid] = ClaimRecord.parse(uid, self._data["claims"][uid])
        return record

    def get(self, uid: str) -> ClaimRecord | None:
        return self._record(uid) if uid in self._data["claims"] else None

    def records(self) -> list[ClaimRecord]:
        return [self._record(uid) for uid in list(self._data["claims"])]

    def put(self, uid: str, entry: ClaimRecord | Mapping[str, Any]) -> None:
        """Stage and write at once (the start-up reconcile and tests)."""
        old = self.get(uid)
        self.stage(uid, entry)
        try:
            self._save()
        except BaseException:
            self.stage(uid, old)
            raise

    def remove(self, uid: str) -> bool:
        old = self.get(uid)
        if old is None:
            return False
        self.stage(uid, None)
        try:
            self._save()
        except BaseException:
            self.stage(uid, old)
            raise
        return True
