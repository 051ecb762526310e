"""The command line's stdout and stderr, safe for any text an object holds.

Names and messages printed come from manifests and the API server: any text, including lone
surrogates (a JSON `\\ud800` escape), characters the terminal's encoding lacks (LANG=C), and
terminal control sequences (`\\x1b[2J` clears the screen, OSC 8 forges links, `\\r` overwrites a
line). Rather than each command escaping each name, the streams themselves escape what cannot or
must not reach a terminal, as Python's backslashreplace writes it (`\\x1b`, `\\ud800`).
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from typing import Any, TextIO, cast

# C0 controls but tab and newline, DEL, C1 controls, zero-width and bidirectional formatting
# characters (text that reads other than it is), line/paragraph separators, byte-order mark, and
# lone surrogates (no encoding can write them).
_UNSAFE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff\ud800-\udfff]"
)


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: str) -> str:
    """`text` with every control, formatting character and lone surrogate backslash-escaped."""
    return text if _UNSAFE.search(text) is None else _UNSAFE.sub(_escape, text)


class EscapingStream:
    """A text stream that writes through to `raw`, escaped by `escape_controls`; everything else
    (flush, isatty, fileno, encoding...) is `raw`'s."""

    def __init__(self, raw: TextIO) -> None:
        self.raw = raw

    def write(self, text: str) -> int:
        self.raw.write(escape_controls(text))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


def _safe(stream: TextIO | None, escape: bool) -> TextIO | None:
    if stream is None or isinstance(stream, EscapingStream):
        return stream
    # What the encoding lacks ("é" under LANG=C) is written as "\xe9", not an UnicodeEncodeError.
    with contextlib.suppress(AttributeError, ValueError):
        stream.reconfigure(errors="backslashreplace")  # type: ignore[attr-defined]
    return cast(TextIO, EscapingStream(stream)) if escape else stream


@contextlib.contextmanager
def safe_streams(escape_stdout: bool = True) -> Iterator[None]:
    """sys.stdout and sys.stderr escaped while it lasts (a logging handler made meanwhile keeps
    the escaping one). `escape_stdout` False: stdout only gets backslashreplace, for a command that
    writes its own terminal sequences and escapes what it shows (`top`)."""
    saved = sys.stdout, sys.stderr
    sys.stdout = _safe(sys.stdout, escape_stdout)
    sys.stderr = _safe(sys.stderr, True)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
