"""Skipped tests fail the run unless declared expected: a skip is a test that did not run, and a
green run must mean every test ran that nobody said could not (a non-root run skipped the whole
e2e tier and passed). Registered by the unit tier's and the e2e tier's conftest.py.

Declarations, each a pytest node id pattern (fnmatch, the id relative to the repository:
`tests/test_simdriver.py::*`, `e2e/tests/*`) and the reason the skip is expected:
- e2e/expected-skips.txt: skips expected on every machine that runs the suite as documented (CI's:
  root, Debian, no GPU); one `PATTERN REASON` a line, `#` comments;
- $DRA_GPU_EXPECTED_SKIPS: this machine's, `PATTERN [REASON]` entries separated by `;` or lines.

The terminal summary names every skip, declared or not, with its reason.

Standard library only at run time, as the rest of the harness; pytest is imported where a pytest
session calls in.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

ENV = "DRA_GPU_EXPECTED_SKIPS"
REPO = Path(__file__).resolve().parents[2]
FILE = REPO / "e2e" / "expected-skips.txt"
PLUGIN_NAME = "dra-gpu-expected-skips"
ENV_REASON = f"declared for this machine by ${ENV}"


class DeclarationError(ValueError):
    """A declaration that cannot be read (no pattern, or no reason in the file)."""


@dataclass(frozen=True)
class Expected:
    """A declared expected skip: the tests it covers, why, and where it was declared."""

    pattern: str
    reason: str
    source: str

    def matches(self, test_id: str) -> bool:
        return fnmatch.fnmatchcase(test_id, self.pattern)


@dataclass(frozen=True)
class Skip:
    """A test (or a whole file, skipped at collection) that did not run, and the reason it gave."""

    test_id: str
    reason: str


@dataclass(frozen=True)
class Verdict:
    skip: Skip
    expected: Expected | None  # the first declaration that covers it; None: undeclared


def parse_file(text: str, source: str) -> list[Expected]:
    """The declarations of an expected-skips file: `PATTERN REASON` a line; a reason is required
    (the file speaks for every machine, so it says which condition of theirs makes the skip)."""
    out = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        if len(parts) < 2:
            raise DeclarationError(
                f"{source}:{lineno}: pattern {parts[0]!r} has no reason: write `PATTERN REASON`"
            )
        out.append(Expected(parts[0], parts[1].strip(), f"{source}:{lineno}"))
    return out


def parse_env(value: str) -> list[Expected]:
    """The declarations of $DRA_GPU_EXPECTED_SKIPS: `PATTERN [REASON]` entries separated by `;`
    or new lines (the reason may be left out: setting the variable is itself the declaration)."""
    out = []
    for entry in value.replace("\n", ";").split(";"):
        parts = entry.strip().split(None, 1)
        if parts:
            reason = parts[1].strip() if len(parts) > 1 else ENV_REASON
            out.append(Expected(parts[0], reason, f"${ENV}"))
    return out


def declared(file: Path = FILE, environ: Mapping[str, str] = os.environ) -> list[Expected]:
    """The file's declarations (none when it is absent), then the environment's."""
    out = []
    if file.is_file():
        out += parse_file(file.read_text(), _shown(file))
    return out + parse_env(environ.get(ENV, ""))


def judge(skips: Iterable[Skip], expected: list[Expected]) -> list[Verdict]:
    return [Verdict(s, next((e for e in expected if e.matches(s.test_id)), None)) for s in skips]


def summary_lines(verdicts: list[Verdict]) -> list[str]:
    """One line per file, reason and declaration: the skipped tests named, undeclared ones first."""
    groups: dict[tuple[bool, str, str, Expected | None], list[str]] = {}
    for v in verdicts:
        path, sep, name = v.skip.test_id.partition("::")
        key = (v.expected is not None, path, v.skip.reason, v.expected)
        groups.setdefault(key, []).append(name if sep else "")
    lines = []
    for (ok, path, reason, exp), names in sorted(groups.items(), key=lambda kv: kv[0][:3]):
        tests = ", ".join(n for n in names if n)
        where = f"{path}::{{{tests}}}" if len(names) > 1 else (f"{path}::{tests}" if tests else path)
        said = f" [expected: {exp.reason} ({exp.source})]" if exp else ""
        lines.append(f"{'SKIPPED' if ok else 'SKIPPED, NOT DECLARED'} {where}: {reason}{said}")
    return lines


def undeclared_message(verdicts: list[Verdict]) -> list[str]:
    """How to go on from undeclared skips (empty when every skip is declared)."""
    n = sum(v.expected is None for v in verdicts)
    if not n:
        return []
    return [
        f"{n} skipped test(s) not declared expected: the run fails, as they did not run.",
        "Make them run here (see each reason), or declare them expected with a node id pattern (fnmatch)",
        f"and the reason: for this machine, {ENV}='PATTERN REASON; ...' (e.g. {ENV}='e2e/tests/* not root');",
        f"for every machine the suite runs on (CI's included), a `PATTERN REASON` line in {_shown(FILE)}.",
    ]


def _shown(path: Path) -> str:
    """A path as the repository names it (a file elsewhere as it is)."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _reason(longrepr: object) -> str:
    # A skip's report carries (path, line, "Skipped: <reason>").
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return str(text).removeprefix("Skipped: ")


class SkipGate:
    """The pytest plugin: gathers the session's skips, fails a passing session on an undeclared one
    and names every skip in the terminal summary."""

    def __init__(self, expected: list[Expected], rootpath: Path, base: Path = REPO) -> None:
        self.expected = expected
        self.rootpath = rootpath
        self.base = base
        self.skips: dict[str, Skip] = {}

    def test_id(self, nodeid: str) -> str:
        """The node id with its path relative to the repository (rootdir may be elsewhere)."""
        path, sep, rest = nodeid.partition("::")
        full = (self.rootpath / path).resolve()
        if not full.is_relative_to(self.base):
            return nodeid
        return full.relative_to(self.base).as_posix() + sep + rest

    def _record(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):  # an xfail ran
            test_id = self.test_id(report.nodeid)
            self.skips[test_id] = Skip(test_id, _reason(report.longrepr))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._record(report)

    def verdicts(self) -> list[Verdict]:
        return judge(self.skips.values(), self.expected)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        # Runs before the terminal reporter's summary, and pytest exits with session.exitstatus.
        # Only a passing status changes (one that failed already says more), and "no tests
        # collected" (5): every file skipped at collection, as declared, is a pass.
        verdicts = self.verdicts()
        undeclared = any(v.expected is None for v in verdicts)
        if session.exitstatus == 0 and undeclared:
            session.exitstatus = 1
        elif session.exitstatus == 5 and verdicts and not undeclared:
            session.exitstatus = 0

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        verdicts = self.verdicts()
        if not verdicts:
            return
        bad = undeclared_message(verdicts)
        n = len(verdicts)
        terminalreporter.section(
            f"{n} skipped: {n - sum(v.expected is None for v in verdicts)} declared expected", red=bool(bad)
        )
        for line in summary_lines(verdicts):
            terminalreporter.write_line(line, red=line.startswith("SKIPPED, NOT"))
        for line in bad:
            terminalreporter.write_line(line, red=True, bold=True)


def register(config: pytest.Config, file: Path = FILE, base: Path = REPO) -> None:
    """Register the gate once per session (both tiers' conftest.py may ask)."""
    import pytest

    if config.pluginmanager.get_plugin(PLUGIN_NAME) is not None:
        return
    try:
        expected = declared(file)
    except DeclarationError as exc:
        raise pytest.UsageError(str(exc)) from exc
    config.pluginmanager.register(SkipGate(expected, config.rootpath, base), PLUGIN_NAME)
