"""One plugin instance at a time changes the node's claims (Go: the helper's `serialize.lock`).

During a rolling update with maxSurge two instances of the plugin run on a node, each with its own
sockets (helper.Sockets.for_instance), and the kubelet may send a call to either. Their prepares,
unprepares and start-up work are serialised by an flock on `serialize.lock` in the plugin
directory, as upstream's helper does with rolling updates on.

Within one process the lock is shared: the first holder takes the flock, later ones join it, and
the last to leave releases it, so the calls of one instance still run concurrently and only the
two instances exclude each other. Whenever this process takes the flock anew, `on_acquired` runs
first: another instance may have changed what this one keeps in memory (the plugin re-reads its
checkpoint when the file changed).

The wait is bounded (`timeout`): a kubelet call that cannot get the lock fails and the kubelet
retries it. It is polled (a non-blocking flock, retried with tenacity's exponential backoff), so no
thread blocks in flock and a cancelled call leaves nothing behind. Without a path (a single
instance: no pod UID) the lock is only the in-process count, with no system call.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential, wait_random

log = logging.getLogger(__name__)

LOCK_FILE = "serialize.lock"  # upstream's name, in the plugin directory
LOCK_TIMEOUT = 20.0  # well inside the kubelet's 45 s call deadline
WAIT_INITIAL = 0.005
WAIT_MAXIMUM = 0.25


class InstanceLockTimeout(RuntimeError):
    """The other instance held the lock for longer than the timeout."""


class InstanceLock:
    def __init__(
        self,
        path: Path | None,
        timeout: float = LOCK_TIMEOUT,
        on_acquired: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """`path`: the lock file (None: one instance, no file lock); `on_acquired`: run each time
        this process takes the file lock anew, before any holder goes on (it may fail the hold)."""
        self.path = path
        self.timeout = timeout
        self.on_acquired = on_acquired
        self._fd: int | None = None  # open for the process's life once used
        self._locked = False
        self._holders = 0
        self._gate = asyncio.Lock()  # one coroutine takes the flock, the others wait for it

    @classmethod
    def in_dir(cls, plugin_dir: Path, rolling: bool, timeout: float = LOCK_TIMEOUT) -> InstanceLock:
        """The lock of the plugin directory's instances; with `rolling` off, none on the file."""
        return cls(plugin_dir / LOCK_FILE if rolling else None, timeout)

    @property
    def held(self) -> bool:
        return self._holders > 0

    @contextlib.asynccontextmanager
    async def hold(self, what: str = "") -> AsyncIterator[None]:
        """Held for the block, shared with this process's other holders; InstanceLockTimeout
        when another instance kept it for `timeout` (`what` says who waited, in that error)."""
        if self.path is None:
            self._holders += 1
            try:
                yield
            finally:
                self._holders -= 1
            return
        async with self._gate:
            if not self._locked:
                await self._acquire(what)
            self._holders += 1  # no wait between the check and the count
        try:
            yield
        finally:
            self._holders -= 1
            if self._holders == 0 and self._locked:
                self._release()

    async def _acquire(self, what: str) -> None:
        assert self.path is not None
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fd = self._fd
        start = time.monotonic()
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(BlockingIOError),
                wait=wait_exponential(multiplier=WAIT_INITIAL, max=WAIT_MAXIMUM)
                + wait_random(0, WAIT_INITIAL),
                stop=stop_after_delay(self.timeout),
                reraise=True,
            ):
                with attempt:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InstanceLockTimeout(
                f"another instance of this plugin on the node has held {self.path} for more than "
                f"{self.timeout:g}s (a rolling update runs two); {what or 'the call'} was not done, "
                "the kubelet retries it"
            ) from None
        self._locked = True
        waited = time.monotonic() - start
        if waited > 0.1:
            log.info(
                "waited for the other plugin instance lock=%s seconds=%.3f for=%s", self.path, waited, what
            )
        if self.on_acquired is not None:
            try:
                await self.on_acquired()
            except BaseException:
                self._release()
                raise

    def _release(self) -> None:
        self._locked = False
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Release and close the file (at exit; the file itself stays for the other instance)."""
        if self._fd is not None:
            if self._locked:
                self._release()
            os.close(self._fd)
            self._fd = None
