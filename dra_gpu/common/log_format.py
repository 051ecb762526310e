"""Log lines that log pipelines parse: logfmt (the default, `--log-format text`) or one JSON
object a line (`--log-format json`), times in RFC 3339, UTC, to the millisecond.

The messages keep their own `key=value` words (`prepared claim=ns/name devices=2`); in logfmt the
whole message is the quoted `msg` value, so a parser reads every line, whatever a message holds.

Verbosity, as klog's `-v=N` (0..10): `V(n)` is the logging level of a line shown from `-v=n` on, the
one place that maps the two. V(0) is INFO, V(1)..V(3) are INFO-1..INFO-3, V(4) is DEBUG and
V(5)..V(10) are DEBUG-1..DEBUG-6; `-v=n` sets the threshold to V(n). A line below INFO keeps a level
that log pipelines know (`info` for v1..v3, `debug` from v4 on) and says its verbosity in a `v`
field (`v=2`; a number in JSON), as klog's JSON lines do; lines at info and above have no `v`.
"""

from __future__ import annotations

import json
import logging
import re
import time

FORMATS = ("text", "json")
MAX_VERBOSITY = 10
# A logfmt value is written bare only when it has nothing a parser would split on.
_BARE = re.compile(r'^[^\s="\\\x00-\x1f\x7f]+$')


def V(n: int) -> int:  # klog's name: `log.log(V(2), ...)` reads as klog.V(2).Info
    """The logging level of a line shown from verbosity `n` (0..10) on, and `-v=n`'s threshold."""
    if not 0 <= n <= MAX_VERBOSITY:
        raise ValueError(f"verbosity {n}: not 0..{MAX_VERBOSITY}")
    if n < 4:
        return logging.INFO - n
    return logging.DEBUG - (n - 4)


def verbosity_of(levelno: int) -> int:
    """The verbosity from which a line of this level shows: 0 at INFO and above; the least `n` with
    V(n) <= levelno below (a library's level 15 is 4, as plain DEBUG); 10 under V(10)."""
    if levelno >= logging.INFO:
        return 0
    return next((n for n in range(1, MAX_VERBOSITY + 1) if V(n) <= levelno), MAX_VERBOSITY)


for _n in range(1, MAX_VERBOSITY + 1):
    if _n != 4:  # V(4) is DEBUG
        logging.addLevelName(V(_n), f"V{_n}")


def rfc3339_utc(created: float) -> str:
    """`created` (seconds since the epoch) as 2026-12-07T15:17:39.051Z."""
    seconds = int(created)
    return (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int((created - seconds) * 1000):03d}Z"
    )


def logfmt_value(value: str) -> str:
    if _BARE.match(value):
        return value
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    escaped = escaped.replace("\t", "\\t")
    return f'"{escaped}"'


def _fields(record: logging.LogRecord, formatter: logging.Formatter) -> dict[str, str | int]:
    v = verbosity_of(record.levelno)
    fields: dict[str, str | int] = {"time": rfc3339_utc(record.created)}
    if v:
        fields.update(level="debug" if v >= 4 else "info", v=v)
    else:
        fields["level"] = record.levelname.lower()
    fields.update(logger=record.name, msg=record.getMessage())
    if record.exc_info:
        fields["exc"] = formatter.formatException(record.exc_info)
    if record.stack_info:
        fields["stack"] = formatter.formatStack(record.stack_info)
    return fields


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={logfmt_value(str(v))}" for k, v in _fields(record, self).items())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record, self), ensure_ascii=False)


def formatter(log_format: str) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return LogfmtFormatter()
    raise ValueError(f"log format {log_format!r}: not one of {', '.join(FORMATS)}")
