"""The only writer of the plugin's claim state: the checkpoint's claim records, the claims'
CDI spec files and their device metadata files (device_metadata). All are replaced atomically
but not fsynced: they are scoped to the boot (the checkpoint's records of another boot are
discarded, `/var/run/cdi` is a tmpfs, and a spec or metadata file left in a persistent directory is
removed by the start-up reconcile), so a power loss leaves nothing to protect and a process crash
loses nothing the page cache does not keep (dra_gpu.common.durable).

Prepare stages a record in memory under the state lock (`stage`) and makes it durable with
`commit`: whoever writes, writes all that is staged, so 100 claims in flight need far fewer than
100 checkpoint writes (group commit). The specs of concurrent claims are written and removed in
rounds (write_rounds: one worker-thread job per round); the
checkpoint's writes run beside them. The start-up reconcile, which runs before serving and alone,
writes at once (`*_now`).

Checks that look across claims (a device held by another claim, sharing that cannot sit beside
another claim's) read the staged state and run under the same state lock as `stage`, so two
claims can never both be prepared with the same device.

During a rolling update a second instance of the plugin writes the same files, never at the same
time as this one (the instance lock); `refresh`, run whenever this instance takes that lock anew,
re-reads the checkpoint when the other one changed it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from pathlib import Path
from typing import Any

from dra_gpu.common import failpoints
from dra_gpu.common.durable import remove_file, remove_stale_temps, replace_atomically
from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.plugin.cdi import SPEC_MODE, CdiSpecs, CdiWriteError
from dra_gpu.plugin.checkpoint import Checkpoint
from dra_gpu.plugin.device_metadata import DIR_MODE, FILE_MODE, DeviceMetadata, MetadataWriteError
from dra_gpu.plugin.plan import BusyPrepareError, PrepareError
from dra_gpu.plugin.record import ClaimRecord
from dra_gpu.plugin.sharing import Sharing
from dra_gpu.plugin.write_rounds import WriteRounds


class Journal:
    def __init__(self, checkpoint: Checkpoint, cdi: CdiSpecs, metadata: DeviceMetadata) -> None:
        self.checkpoint = checkpoint
        self.cdi = cdi
        self.metadata = metadata
        # Checks across claims and `stage` run under it.
        self.state_lock = asyncio.Lock()
        self._commit_lock = asyncio.Lock()
        self.spec_rounds = WriteRounds(durable=False, failpoint=failpoints.CDI_SPEC_AFTER_TEMP)
        self._staged = 0
        self._written = 0

    async def refresh(self) -> None:
        """The checkpoint as another instance of the plugin left it: re-read when the file is not
        the one this instance last read or wrote (one stat when it is)."""
        if not self.checkpoint.changed_on_disk():
            return
        async with self.state_lock:
            await asyncio.to_thread(self.checkpoint.reload)

    # -- reads ---------------------------------------------------------------------------------

    def get(self, uid: str) -> ClaimRecord | None:
        return self.checkpoint.get(uid)

    def records(self) -> list[ClaimRecord]:
        return self.checkpoint.records()

    def holder(self, names: set[str], other_than: str) -> tuple[str, ClaimRecord] | None:
        """The first claim but `other_than` that holds one of `names`, with that device."""
        return self.checkpoint.holder(names, other_than)

    def other_sharing(self, uid: str) -> list[dict[str, Any]]:
        """The sharing records of every claim but `uid`."""
        return [o.sharing for o in self.records() if o.uid != uid and o.sharing]

    def check_free(self, ref: ClaimRef, exclusive: set[str], sharing: dict[str, Any]) -> None:
        """Refuse a claim whose devices another claim holds, or whose sharing cannot be applied
        beside another claim's (call under the state lock, before staging)."""
        held = self.holder(exclusive, other_than=ref.uid)
        if held is not None:
            device, other = held
            raise BusyPrepareError(
                f"claim {ref}: device {device} is already prepared for claim "
                f"{other.ref()}; refusing to hand it to two claims"
            )
        if sharing:
            others = [(o.ref(), o.sharing) for o in self.records() if o.uid != ref.uid and o.sharing]
            problem = Sharing.conflict(sharing, others)
            if problem:
                raise PrepareError(f"claim {ref}: {problem}")

    # -- staged, committed in groups -------------------------------------------------------------

    def stage(self, uid: str, record: ClaimRecord | None) -> None:
        """Change the checkpoint in memory (call under the state lock, then `commit`)."""
        self._staged += 1
        self.checkpoint.stage(uid, record)

    async def commit(self) -> None:
        """Write everything staged so far. Whoever writes, writes all that is staged."""
        target = self._staged
        async with self._commit_lock:
            if self._written >= target:
                return  # an earlier write already carried this change
            version = self._staged
            blob = self.checkpoint.encode()
            await asyncio.to_thread(self.checkpoint.write, blob)
            self._written = version

    async def commit_then(self, failpoint: str) -> None:
        await self.commit()
        failpoints.hit(failpoint)

    async def write_spec(self, uid: str, content: bytes) -> None:
        path = self.cdi.path(uid)
        try:
            await self.spec_rounds.write(path, content, SPEC_MODE)
        except OSError as exc:
            raise CdiWriteError(exc.errno, exc.strerror, path) from exc
        failpoints.hit(failpoints.PREPARE_AFTER_CDI_SPEC)  # the spec is written, its record maybe not

    async def remove_spec(self, uid: str) -> bool:
        return await self.spec_rounds.remove(self.cdi.path(uid))

    async def write_metadata(self, record: ClaimRecord) -> None:
        """The claim's device metadata files and their CDI specs (none when the record has no
        metadata), in the spec's rounds. MetadataWriteError names the first file that failed;
        the others are written or not (the caller rolls the claim back)."""
        try:
            files = self.metadata.files(record)
        except ValueError as exc:
            raise PrepareError(f"claim {record.ref()}: device metadata: {exc}") from exc
        if not files:
            return
        # Queued at once, before this coroutine first waits: beside the claim's spec, when that
        # was queued just before, in its round (one worker-thread job).
        outcomes = await self.spec_rounds.write_all(files, FILE_MODE, dir_mode=DIR_MODE)
        for (path, _), outcome in zip(files, outcomes, strict=True):
            if isinstance(outcome, OSError):
                raise MetadataWriteError(outcome.errno, outcome.strerror or str(outcome), path) from outcome
            if isinstance(outcome, BaseException):
                raise outcome

    async def remove_metadata(self, record: ClaimRecord | None) -> None:
        """Remove the claim's device metadata (its directory; the files of another record of the
        same namespace and name stay) and their CDI specs."""
        if record is None or record.metadata is None:
            return
        others = [
            o
            for o in self.records()
            if o.uid != record.uid
            and o.namespace == record.namespace
            and o.name == record.name
            and o.metadata
        ]
        try:
            files, trees = self.metadata.removals(record, others)
        except ValueError as exc:  # a record whose names cannot make a path: it made no file either
            raise PrepareError(f"claim {record.ref()}: device metadata: {exc}") from exc
        # Queued at once, beside the claim's spec when that was queued just before (one round).
        for outcome in await self.spec_rounds.remove_all(files, trees):
            if outcome is not None:
                raise outcome

    # -- at once (the start-up reconcile and rebuild, before serving) ----------------------------

    def remove_stale_temps(self, plugin_files: Collection[str] = ()) -> list[Path]:
        """The temp files of the plugin's own writes that a kill left behind, removed: the claim
        specs' in the CDI directory, the checkpoint's and `plugin_files`' in the plugin directory
        (durable.remove_stale_temps; nothing of another program's naming is touched)."""
        plugin_dir = self.checkpoint.path.parent
        names = {self.checkpoint.path.name, self.checkpoint.boot_mark.name, *plugin_files}
        return [
            *remove_stale_temps(
                self.cdi.dir, lambda n: self.cdi.is_spec_name(n) or self.metadata.is_spec_name(n)
            ),
            *remove_stale_temps(plugin_dir, names.__contains__),
        ]

    def write_spec_now(self, uid: str, spec: dict[str, Any]) -> None:
        path = self.cdi.path(uid)
        try:
            replace_atomically(path, self.cdi.encode(spec), mode=SPEC_MODE)
        except OSError as exc:
            raise CdiWriteError(exc.errno, exc.strerror, path) from exc

    def remove_spec_now(self, uid: str) -> bool:
        path = self.cdi.path(uid)
        if not path.is_symlink() and not path.exists():
            return False  # nothing to do, also on a read-only directory (unlink says EROFS there)
        return remove_file(path)

    def forget_now(self, uid: str) -> bool:
        """Remove the claim's record and write the checkpoint."""
        return self.checkpoint.remove(uid)

    def stage_rebuilt(self, record: ClaimRecord) -> None:
        """A record rebuilt from the specs and the API (written by `rebuilt`)."""
        self.checkpoint.stage(record.uid, record)

    def rebuilt(self) -> None:
        """Clear the checkpoint's rebuild mark and write the rebuilt records, in one write."""
        self.checkpoint.rebuilt()
