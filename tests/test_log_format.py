"""Log lines a log pipeline parses: logfmt by default, JSON with --log-format json, RFC 3339 UTC
times; checked on the console script's own stderr, as a collector would read it."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from dra_gpu.common.log_format import JsonFormatter, LogfmtFormatter
from tests.simnode_support import needs_root, needs_toolchain, nvml_h  # noqa: F401 - a fixture

DRA_GPU = shutil.which("dra-gpu") or str(Path(sys.executable).with_name("dra-gpu"))

# logfmt as go-logfmt reads it: key=value pairs split on spaces, a value bare (no space, quote or
# '=') or double-quoted with backslash escapes.
PAIR = re.compile(r'([^\s="]+)=("(?:[^"\\]|\\.)*"|[^\s="]*)')


def parse_logfmt(line: str) -> dict[str, str]:
    pairs = PAIR.findall(line)
    assert " ".join(f"{k}={v}" for k, v in pairs) == line, f"not logfmt: {line!r}"
    return {k: json.loads(v) if v.startswith('"') else v for k, v in pairs}


def record(msg: str, *args: object) -> logging.LogRecord:
    rec = logging.LogRecord("dra_gpu.test", logging.WARNING, __file__, 1, msg, args, None)
    rec.created = 1796656659.051  # 2026-12-07T15:17:39.051Z
    return rec


@pytest.mark.parametrize(
    "message",
    [
        "prepared claim=ns/a devices=2",
        'a "quoted" word, a back\\slash, key=value = and  two spaces',
        "two\nlines\tand a tab",
        "",
    ],
)
def test_any_message_is_one_logfmt_line_that_reads_back(message: str) -> None:
    line = LogfmtFormatter().format(record("%s", message))
    assert "\n" not in line
    fields = parse_logfmt(line)
    assert fields == {
        "time": "2026-12-07T15:17:39.051Z",
        "level": "warning",
        "logger": "dra_gpu.test",
        "msg": message,
    }


def test_json_lines_hold_the_same_fields() -> None:
    doc = json.loads(JsonFormatter().format(record("released claim=%s", "ns/b")))
    assert doc == {
        "time": "2026-12-07T15:17:39.051Z",
        "level": "warning",
        "logger": "dra_gpu.test",
        "msg": "released claim=ns/b",
    }


@needs_toolchain
@needs_root
@pytest.mark.usefixtures("nvml_h")  # a simulated node's libnvidia-ml.so.1, compiled on first use
@pytest.mark.parametrize("where", ["before", "after"])
def test_the_commands_logs_in_either_format(where: str) -> None:
    """A command's real log lines (inventory -v of a simulated node: NVML's loading and its debug
    lines) in both formats, the flags before or after the subcommand."""
    flags = ["-v", "--log-format", "json"]
    command = ["inventory", "--profile", "hgx-2x4", "--node-name", "node-a"]
    argv = [*flags, *command] if where == "before" else [*command, *flags]
    started = datetime.now(UTC)
    out = subprocess.run([DRA_GPU, *argv], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    assert lines and {d["level"] for d in lines} <= {"debug", "info", "warning", "error"}
    for d in lines:
        assert (datetime.fromisoformat(d["time"]) - started).total_seconds() > -1  # UTC, not local time
    text = subprocess.run(
        [DRA_GPU, "-v", *command], capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )
    assert [parse_logfmt(line)["logger"] for line in text.stderr.splitlines()] == [d["logger"] for d in lines]
