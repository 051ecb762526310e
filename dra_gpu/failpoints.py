"""Named points where a test can make the process fail: `DRA_GPU_FAILPOINTS=name=action,...`.

Actions: `kill` (SIGKILL to the process itself: no clean-up at all, as a crash or an OOM kill)
and `error` (raise FailpointError). Unset, a failpoint costs one environment lookup.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

ENV = "DRA_GPU_FAILPOINTS"
ACTIONS = ("kill", "error")


class FailpointError(RuntimeError):
    """Raised at a failpoint set to `error`."""


def _actions() -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in os.environ.get(ENV, "").split(","))):
        name, _, action = item.partition("=")
        if action not in ACTIONS:
            raise ValueError(f"{ENV}: {item!r}: action must be one of {', '.join(ACTIONS)}")
        out[name] = action
    return out


def hit(name: str) -> None:
    """Fail here if the environment asks for it."""
    action = _actions().get(name)
    if action is None:
        return
    log.warning("failpoint hit name=%s action=%s", name, action)
    if action == "kill":
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    raise FailpointError(f"failpoint {name}")
