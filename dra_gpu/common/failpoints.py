"""Named points where a test can make the process fail: `DRA_GPU_FAILPOINTS=name=action,...`, obeyed
only in a process started with `--enable-failpoints` (`enable()`): the variable alone is ignored,
with one warning, so that an environment a pod's spec or a node's defaults leak in cannot make a
production plugin kill itself or fail its prepares.

Actions: `kill` (SIGKILL to the process itself: no clean-up at all, as a crash or an OOM kill)
and `error` (raise FailpointError). Unset, a failpoint costs one environment lookup. Tests only:
nothing sets the variable or the flag in the chart or the image.

The kubelet plugin's failpoints are the constants below, in the order a claim meets them (`ALL`),
each with what exists when it is hit. e2e/tests/test_faults.py kills the plugin at each in turn.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

ENV = "DRA_GPU_FAILPOINTS"
FLAG = "--enable-failpoints"
ACTIONS = ("kill", "error")

# a checkpoint write: its temp file is synced, not yet renamed over the checkpoint (prepare's
# first write: `started` of a claim with sharing, else `completed` beside the spec); a kill here
# leaves the temp file, which the next start removes
CHECKPOINT_AFTER_TEMP = "checkpoint-after-temp"
# prepare: the `started` record is durable (its CDI spec may or may not be written yet)
PREPARE_AFTER_STARTED = "prepare-after-started"
# a round of CDI spec writes: the specs' temp files are synced, none is renamed yet (the claim's
# record is written beside it: durable or not)
CDI_SPEC_AFTER_TEMP = "cdi-spec-after-temp"
# prepare: `started` record and CDI spec both written, sharing not applied, not `completed`
PREPARE_AFTER_CDI_SPEC = "prepare-after-cdi-spec"
# prepare: `completed` is durable, the kubelet has not had the answer
PREPARE_AFTER_COMPLETED = "prepare-after-completed"
# MPS: the claim's GPUs are in their compute mode, its daemon not started
MPS_AFTER_COMPUTE_MODE = "mps-after-compute-mode"
# MPS: a control daemon answers with its limits, its start not yet reported to prepare
MPS_AFTER_DAEMON_START = "mps-after-daemon-start"
# dynamic MIG: the GPU instance exists and its ID is on record, no compute instance yet
MIG_AFTER_GPU_INSTANCE = "mig-after-gpu-instance"
# dynamic MIG: the compute instance exists, not yet on record
MIG_AFTER_COMPUTE_INSTANCE = "mig-after-compute-instance"
# unprepare: the claim's sharing (MPS daemons, compute modes) undone, its instances, spec and
# record still there
UNPREPARE_AFTER_SHARING = "unprepare-after-sharing"
# unprepare (and a failed prepare's roll-back): the MIG instances destroyed, spec and record not
UNPREPARE_AFTER_INSTANCES = "unprepare-after-instances"

ALL = (
    CHECKPOINT_AFTER_TEMP,
    PREPARE_AFTER_STARTED,
    CDI_SPEC_AFTER_TEMP,
    PREPARE_AFTER_CDI_SPEC,
    PREPARE_AFTER_COMPLETED,
    MPS_AFTER_COMPUTE_MODE,
    MPS_AFTER_DAEMON_START,
    MIG_AFTER_GPU_INSTANCE,
    MIG_AFTER_COMPUTE_INSTANCE,
    UNPREPARE_AFTER_SHARING,
    UNPREPARE_AFTER_INSTANCES,
)


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


class _Switch:
    enabled = False  # set by FLAG
    warned = False


def enable(on: bool = True) -> None:
    """Obey ENV in this process (the command line's FLAG); `enable(False)` turns it off again."""
    _Switch.enabled = on


def hit(name: str) -> None:
    """Fail here if failpoints are enabled and the environment asks for it."""
    if ENV not in os.environ:
        return
    if not _Switch.enabled:
        if not _Switch.warned:
            _Switch.warned = True
            log.warning("%s is set but %s was not given: failpoints ignored", ENV, FLAG)
        return
    action = _actions().get(name)
    if action is None:
        return
    log.warning("failpoint hit name=%s action=%s", name, action)
    if action == "kill":
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    raise FailpointError(f"failpoint {name}")
