"""Dynamic MIG's binder makes and destroys instances only under the hold it was given (the plugin's
instance lock during a rolling update), and releases it between tries."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.plugin.mig_binding import MigBinder
from dra_gpu.plugin.plan import BusyPrepareError


class FakePreparer:
    def __init__(self) -> None:
        self.held = False
        self.seen: list[tuple[str, bool]] = []
        self.busy = 1  # the first bind finds its placement held by a departing claim

    async def bind(self, ref: ClaimRef, claim: dict[str, Any]) -> dict[str, Any]:
        self.seen.append(("bind", self.held))
        if self.busy:
            self.busy -= 1
            raise BusyPrepareError("placement held")
        return {}

    def held_by_another_claim(self, ref: ClaimRef, claim: dict[str, Any]) -> bool:
        self.seen.append(("held_by_another_claim", self.held))
        return True

    async def release_gone_holders(self, ref: ClaimRef, claim: dict[str, Any]) -> bool:
        self.seen.append(("release_gone_holders", self.held))
        return True


def test_bind_and_release_run_under_the_hold_and_nothing_else_does() -> None:
    preparer = FakePreparer()
    said: list[str] = []

    @contextlib.asynccontextmanager
    async def hold(what: str) -> AsyncIterator[None]:
        said.append(what)
        preparer.held = True
        try:
            yield
        finally:
            preparer.held = False

    binder = MigBinder("gpu.dra-gpu.io", "node-1", preparer, None, hold=hold)  # type: ignore[arg-type]
    ref = ClaimRef("ns", "uid-1", "c")
    assert asyncio.run(binder._bind_when_free(ref, {})) == {}
    assert preparer.seen == [
        ("bind", True),
        ("held_by_another_claim", False),
        ("release_gone_holders", True),
        ("bind", True),
    ]
    assert said == ["a dynamic MIG binding"] * 3
