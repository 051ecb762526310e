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

from dra_gpu.common.log_format import JsonFormatter, LogfmtFormatter, V
from tests.simnode_support import needs_root, needs_toolchain, nvml_h  # noqa: F401 - a fixture

DRA_GPU = shutil.which("dra-gpu") or str(Path(sys.executable).with_name("dra-gpu"))

# logfmt as go-logfmt reads it: key=value pairs split on spaces, a value bare (no space, quote or
# '=') or double-quoted with backslash escapes.
PAIR = re.compile(r'([^\s="]+)=("(?:[^"\\]|\\.)*"|[^\s="]*)')


def parse_logfmt(line: str) -> dict[str, str]:
    pairs = PAIR.findall(line)
    assert " ".join(f"{k}={v}" for k, v in pairs) == line, f"not logfmt: {line!r}"
    return {k: json.loads(v) if v.startswith('"') else v for k, v in pairs}


def record(msg: str, *args: object, level: int = logging.WARNING) -> logging.LogRecord:
    rec = logging.LogRecord("dra_gpu.test", level, __file__, 1, msg, args, None)
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


@pytest.mark.parametrize(
    ("level", "fields"),
    [
        (logging.ERROR, {"level": "error"}),
        (logging.INFO, {"level": "info"}),  # v=0: no v field
        (V(1), {"level": "info", "v": 1}),
        (V(2), {"level": "info", "v": 2}),
        (V(3), {"level": "info", "v": 3}),
        (logging.DEBUG, {"level": "debug", "v": 4}),
        (V(5), {"level": "debug", "v": 5}),
        (V(10), {"level": "debug", "v": 10}),
        (15, {"level": "debug", "v": 4}),  # a library's own level between the two
    ],
)
def test_verbosity_keeps_a_level_pipelines_know_and_says_v(level: int, fields: dict[str, object]) -> None:
    """Below info: `info` or `debug`, never `v2` or `level 18`, and the verbosity in `v`, a number
    in JSON, as klog's JSON lines have it; logfmt and JSON still read back."""
    rec = record("kubelet call claims=%d", 1, level=level)
    line = LogfmtFormatter().format(rec)
    want = {"time": "2026-12-07T15:17:39.051Z", **fields, "logger": "dra_gpu.test"}
    want["msg"] = "kubelet call claims=1"
    assert parse_logfmt(line) == {k: str(v) for k, v in want.items()}
    assert list(parse_logfmt(line)) == list(want)  # v right after level
    assert json.loads(JsonFormatter().format(rec)) == want


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
    assert any(d["level"] == "debug" for d in lines)  # a bare -v is -v=4: debug, said as v=4
    assert all(d.get("v") == 4 for d in lines if d["level"] == "debug")
    for d in lines:
        assert (datetime.fromisoformat(d["time"]) - started).total_seconds() > -1  # UTC, not local time
    text = subprocess.run(
        [DRA_GPU, "-v", *command], capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )
    assert [parse_logfmt(line)["logger"] for line in text.stderr.splitlines()] == [d["logger"] for d in lines]
    # -v=3 (and the same from $DRA_GPU_VERBOSITY): the info lines without the debug ones.
    for v3, env in ((["-v=3"], {}), ([], {"DRA_GPU_VERBOSITY": "3"})):
        out = subprocess.run(
            [DRA_GPU, *v3, *command, "--log-format", "json"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **env},
        )
        assert out.returncode == 0, out.stderr
        assert [json.loads(line)["logger"] for line in out.stderr.splitlines()] == [
            d["logger"] for d in lines if d["level"] != "debug"
        ]
