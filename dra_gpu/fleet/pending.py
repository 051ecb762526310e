"""Why a Pending pod's claims are not allocated: `dra-gpu explain` over the cluster as `top` read it.

A pod the scheduler has not placed, with a claim that has no allocation, gets the one line
`explain` gives for that claim: why no node can give it devices now ("largest free NVLink domain:
2 GPUs"), or where it would fit (then the scheduler has not come to it yet, or something else of
the pod holds it back).

The explanation runs as a child process (`python -m dra_gpu.cli explain -f - -o json`) fed the
objects on stdin. The command line is single-threaded, so it bounds each claim's simulation in a
forked child (dra_gpu.controller.bounded); `top` holds the API client's threads, where a fork is
not safe. A child that does not answer within the timeout is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from dataclasses import dataclass
from typing import Any

from dra_gpu.common.decoding import MAX_FILE_BYTES
from dra_gpu.common.exit_codes import EXIT_OK, EXIT_UNALLOCATABLE
from dra_gpu.fleet.snapshot import Pod, Snapshot, WaitingClaim

MAX_EXPLAINED = 20  # claims explained per drawing: a job of 1,000 Pending pods costs 20 simulations


@dataclass(frozen=True)
class PendingClaim:
    namespace: str
    pod: str
    claim: str
    fits: bool | None  # None: not explained (`reason` says why)
    node: str = ""  # where it would fit now
    devices: tuple[str, ...] = ()
    reason: str = ""  # why it cannot fit, or why it was not explained


class ExplainFailed(Exception):
    """The explanation did not come back; the message says why, in a line."""


def waiting_for_allocation(snapshot: Snapshot) -> list[tuple[Pod, WaitingClaim]]:
    """Each unscheduled pod's claims that have no allocation, pods by namespace and name."""
    waiting = {(w.namespace, w.name): w for w in snapshot.waiting}
    return [
        (pod, waiting[(pod.namespace, name)])
        for pod in sorted(snapshot.pods, key=lambda p: (p.namespace, p.name))
        if pod.unscheduled
        for name in pod.claims
        if (pod.namespace, name) in waiting
    ]


async def explain_pending(snapshot: Snapshot, timeout: float) -> tuple[PendingClaim, ...]:
    """The Pending pods' waiting claims that ask for the driver's devices, each with its explanation."""
    pairs = waiting_for_allocation(snapshot)
    if not pairs:
        return ()
    asked = list(dict.fromkeys(claim for _, claim in pairs))[:MAX_EXPLAINED]
    try:
        answers = await _explain(snapshot, asked, timeout)
    except ExplainFailed as exc:
        return tuple(
            PendingClaim(pod.namespace, pod.name, claim.name, None, reason=f"not explained: {exc}")
            for pod, claim in pairs
        )
    out = []
    for pod, claim in pairs:
        answer = answers.get((claim.namespace, claim.name))
        if answer is None:
            out.append(
                PendingClaim(
                    pod.namespace,
                    pod.name,
                    claim.name,
                    None,
                    reason=f"not explained: more than {MAX_EXPLAINED} claims wait",
                )
            )
        elif answer.get("concernsDriver", True):  # another driver's claim is not ours to explain
            out.append(
                PendingClaim(
                    pod.namespace,
                    pod.name,
                    claim.name,
                    bool(answer.get("allocatable")),
                    str(answer.get("node") or ""),
                    tuple(str(d) for d in answer.get("devices") or []),
                    str(answer.get("reason") or ""),
                )
            )
    return tuple(out)


async def _explain(
    snapshot: Snapshot, asked: list[WaitingClaim], timeout: float
) -> dict[tuple[str, str], dict[str, Any]]:
    items = [
        *snapshot.slice_objects,
        *(c.obj for c in snapshot.classes),
        *(c.obj for c in snapshot.claims),  # what is allocated is not free
        *(c.obj for c in asked),
    ]
    data = json.dumps({"apiVersion": "v1", "kind": "List", "items": items}).encode()
    if len(data) > MAX_FILE_BYTES:
        raise ExplainFailed(f"the cluster's objects are {len(data) >> 20} MiB, more than explain reads")
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "dra_gpu.cli",
        "explain",
        "-f",
        "-",
        "-o",
        "json",
        "--driver-name",
        snapshot.driver,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(child.communicate(data), timeout)
    except TimeoutError:
        raise ExplainFailed(f"dra-gpu explain did not answer within {timeout:g}s") from None
    finally:
        if child.returncode is None:  # timed out or cancelled (a redraw, Ctrl-C): nothing left running
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            await child.wait()
    if child.returncode not in (EXIT_OK, EXIT_UNALLOCATABLE):  # answered, each claim fitting or not
        lines = err.decode(errors="replace").strip().splitlines()
        raise ExplainFailed(f"dra-gpu explain: {lines[0] if lines else f'exit {child.returncode}'}")
    try:
        claims = json.loads(out)["claims"]
        return {(str(c["namespace"]), str(c["name"])): c for c in claims}
    except (ValueError, KeyError, TypeError) as exc:
        raise ExplainFailed(f"dra-gpu explain answered no claims ({exc})") from None
