"""Log lines that log pipelines parse: logfmt (the default, `--log-format text`) or one JSON
object a line (`--log-format json`), times in RFC 3339, UTC, to the millisecond.

The messages keep their own `key=value` words (`prepared claim=ns/name devices=2`); in logfmt the
whole message is the quoted `msg` value, so a parser reads every line, whatever a message holds.
"""

from __future__ import annotations

import json
import logging
import re
import time

FORMATS = ("text", "json")
# A logfmt value is written bare only when it has nothing a parser would split on.
_BARE = re.compile(r'^[^\s="\\\x00-\x1f\x7f]+$')


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


def _fields(record: logging.LogRecord, formatter: logging.Formatter) -> dict[str, str]:
    fields = {
        "time": rfc3339_utc(record.created),
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    if record.exc_info:
        fields["exc"] = formatter.formatException(record.exc_info)
    if record.stack_info:
        fields["stack"] = formatter.formatStack(record.stack_info)
    return fields


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={logfmt_value(v)}" for k, v in _fields(record, self).items())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record, self), ensure_ascii=False)


def formatter(log_format: str) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return LogfmtFormatter()
    raise ValueError(f"log format {log_format!r}: not one of {', '.join(FORMATS)}")
