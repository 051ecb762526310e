"""A check's verdict, and the report of all of them as a table or JSON.

Every check ends as one or more `Result`s; a check that cannot run is SKIP with the reason, one
that crashed is FAIL with the exception's words, so the command itself never shows a traceback.
"""

from __future__ import annotations

import enum
import json
import logging
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from dra_gpu.common.exit_codes import EXIT_INVALID, EXIT_OK

log = logging.getLogger(__name__)


class Status(enum.Enum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass(frozen=True)
class Result:
    check: str  # stable id, e.g. "node/device-nodes" or "cluster/slices/node-1"
    status: Status
    detail: str  # what was found
    fix: str = ""  # one line: what to do (for WARN and FAIL)

    def to_dict(self) -> dict[str, str]:
        return {"check": self.check, "status": self.status.value, "detail": self.detail, "fix": self.fix}


def ok(check: str, detail: str) -> Result:
    return Result(check, Status.OK, detail)


def warn(check: str, detail: str, fix: str) -> Result:
    return Result(check, Status.WARN, detail, fix)


def fail(check: str, detail: str, fix: str) -> Result:
    return Result(check, Status.FAIL, detail, fix)


def skip(check: str, why: str) -> Result:
    return Result(check, Status.SKIP, why)


def crashed(check: str, exc: BaseException) -> Result:
    """The FAIL that stands for a check that raised."""
    log.debug("check %s crashed", check, exc_info=exc)
    return fail(
        check,
        f"the check itself failed: {type(exc).__name__}: {first_line(exc)}",
        "run `dra-gpu -v doctor` for details and report it",
    )


def guarded(check: str, run: Callable[[], Iterable[Result]]) -> list[Result]:
    """The results of `run`, or one FAIL naming the exception: a broken check must not hide the rest."""
    try:
        return list(run())
    except Exception as exc:
        return [crashed(check, exc)]


def first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0][:300] if text else type(exc).__name__


def exit_code(results: Iterable[Result]) -> int:
    return EXIT_INVALID if any(r.status is Status.FAIL for r in results) else EXIT_OK


def summary(results: list[Result]) -> dict[str, int]:
    return {s.value: sum(1 for r in results if r.status is s) for s in Status}


def report_document(results: list[Result]) -> dict[str, Any]:
    """The report as one document (-o json|yaml)."""
    return {
        "checks": [r.to_dict() for r in results],
        "summary": summary(results),
        "exitCode": exit_code(results),
    }


def render_json(results: list[Result]) -> str:
    return json.dumps(report_document(results), indent=2)


def render_table(results: list[Result], width: int = 110) -> str:
    """CHECK / STATUS / DETAIL columns; under each problem, its fix on a line of its own."""
    check_w = max([len("CHECK"), *(len(r.check) for r in results)])
    detail_w = max(30, width - check_w - 8)
    lines = [f"{'CHECK':<{check_w}}  {'STATUS':<6}  DETAIL"]
    indent = " " * (check_w + 10)
    for r in results:
        wrapped = textwrap.wrap(r.detail, detail_w) or [""]
        lines.append(f"{r.check:<{check_w}}  {r.status.value:<6}  {wrapped[0]}")
        lines.extend(indent + more for more in wrapped[1:])
        if r.fix and r.status in (Status.WARN, Status.FAIL):
            fix = textwrap.wrap("fix: " + r.fix, detail_w, subsequent_indent="     ")
            lines.extend(indent + f for f in fix)
    counts = summary(results)
    lines.append("")
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)
