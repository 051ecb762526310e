"""Names read from files (or the API server) printed by `dra-gpu`: a lone surrogate, a character
the terminal's encoding lacks, or a terminal control sequence is shown escaped, never a
traceback and never raw on the terminal. Run as a user would: the installed console script."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dra_gpu.common.exit_codes import EXIT_INVALID, EXIT_OK, EXIT_UNALLOCATABLE, EXIT_USAGE
from dra_gpu.common.safe_output import safe_streams

DRA_GPU = shutil.which("dra-gpu") or str(Path(sys.executable).with_name("dra-gpu"))
ASCII_TERMINAL = {"PYTHONIOENCODING": "ascii", "LANG": "C", "LC_ALL": "C"}
UTF8_TERMINAL = {"PYTHONIOENCODING": "utf-8", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
SURROGATE = "bad\ud800name"  # "\ud800" as a JSON escape in the file
CLEAR_SCREEN = "clear\x1b[2Jscreen"
LINK = "pod\x1b]8;;http://evil\x07x"  # OSC 8: a forged hyperlink


def run(*args: str | bytes, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [DRA_GPU, *args], capture_output=True, timeout=60, env={**os.environ, **env}, check=False
    )


def claim(name: str, namespace: str = "default", count: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": "gpu.dra-gpu.io", "count": count}}
                ]
            }
        },
    }


def manifest(tmp_path: Path, *items: dict[str, Any]) -> str:
    """One JSON document (a List), as `kubectl get -o json` writes: non-ASCII as \\u escapes."""
    path = tmp_path / "objects.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": list(items)}))
    assert "\\ud800" in path.read_text() or "\\u001b" in path.read_text()
    return str(path)


def no_traceback(out: subprocess.CompletedProcess[bytes]) -> None:
    assert b"Traceback" not in out.stderr, out.stderr.decode(errors="replace")
    assert b"UnicodeEncodeError" not in out.stderr, out.stderr.decode(errors="replace")


def raw_controls(data: bytes) -> list[int]:
    return [b for b in data if (b < 0x20 and b not in b"\t\n") or b == 0x7F]


@pytest.mark.parametrize("terminal", [ASCII_TERMINAL, UTF8_TERMINAL], ids=["ascii", "utf-8"])
def test_validate_shows_untrusted_names_escaped(tmp_path: Path, terminal: dict[str, str]) -> None:
    path = manifest(tmp_path, claim(SURROGATE, count=0), claim(CLEAR_SCREEN, count=0))
    out = run("validate", "-f", path, env=terminal)
    no_traceback(out)
    assert out.returncode == EXIT_INVALID  # count 0: the normal verdict, not a crash
    lines = out.stdout.decode("ascii").splitlines()
    assert (
        "ResourceClaim/bad\\ud800name: spec.devices.requests[0].exactly.count: 0: must be a positive integer"
        in lines
    )
    assert any(line.startswith("ResourceClaim/clear\\x1b[2Jscreen: ") for line in lines)
    assert raw_controls(out.stdout) == []


def test_stderr_lines_show_names_escaped(tmp_path: Path) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": LINK + "\ud800"}}
    path = manifest(tmp_path, claim("ok"), pod)
    out = run("validate", "-f", path, env=ASCII_TERMINAL)
    no_traceback(out)
    assert out.returncode == EXIT_OK
    assert b"Pod/pod\\x1b]8;;http://evil\\x07x\\ud800: skipped: not a DRA object" in out.stderr
    assert raw_controls(out.stderr) == []


def test_explain_shows_names_escaped_and_what_the_encoding_lacks_as_escapes(tmp_path: Path) -> None:
    path = manifest(tmp_path, claim(SURROGATE + "\x1b[2J", namespace="caf\u00e9"))
    ascii_out = run("explain", "-f", path, env=ASCII_TERMINAL)
    no_traceback(ascii_out)
    assert ascii_out.returncode == EXIT_UNALLOCATABLE
    assert ascii_out.stdout.startswith(b"caf\\xe9/bad\\ud800name\\x1b[2J: not allocatable: ")
    # A terminal that has the character shows it as it is: only what cannot be shown is escaped.
    utf8_out = run("explain", "-f", path, env=UTF8_TERMINAL)
    assert utf8_out.stdout.startswith("café/bad\\ud800name\\x1b[2J: not allocatable: ".encode())


def test_a_file_name_argument_of_any_bytes_is_shown_escaped() -> None:
    # A file name that is not UTF-8 (or holds a control) reaches the error message as it was typed.
    out = run("validate", "-f", b"/nonexistent/\xff\x1b[2J", env=ASCII_TERMINAL)
    no_traceback(out)
    assert out.returncode == EXIT_USAGE
    assert b"cannot read /nonexistent/\\udcff\\x1b[2J: No such file or directory" in out.stderr


def test_a_log_handler_made_under_the_cli_streams_escapes(monkeypatch: pytest.MonkeyPatch) -> None:
    # The command's logging.basicConfig runs inside them: its handler writes through them.
    buffer = io.BytesIO()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(buffer, encoding="ascii", write_through=True))
    logger = logging.getLogger("test_cli_untrusted_names")
    logger.propagate = False
    with safe_streams():
        handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    try:
        logger.warning("claim %s on caf\u00e9", SURROGATE + "\x1b[2J")
    finally:
        logger.removeHandler(handler)
    assert buffer.getvalue() == b"claim bad\\ud800name\\x1b[2J on caf\\xe9\n"


def test_top_keeps_its_own_terminal_sequences(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `top` draws with colours and a clear-screen of its own, and escapes names itself
    # (dra_gpu.fleet.text); its errors still go through the escaping stderr.
    from dra_gpu import cli

    def top(args: object) -> int:
        print("\x1b[1mheading\x1b[0m")
        print("bad\x1b[2J", file=sys.stderr)
        return EXIT_OK

    monkeypatch.setattr(cli, "cmd_top", top)
    assert cli.main(["top"]) == EXIT_OK
    out, err = capsys.readouterr()
    assert out == "\x1b[1mheading\x1b[0m\n"
    assert err == "bad\\x1b[2J\n"
