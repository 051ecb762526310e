"""`-o/--output`: one set of formats for every `dra-gpu` command, as kubectl names them.

`text` is for people (each command's own layout), `json` and `yaml` print the same document for
scripts, `wide` (where a command offers it) is `text` with more detail. `table`, the name some
commands used before, is still taken as `text`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

FORMATS = ("text", "json", "yaml")
WIDE = "wide"
_ALIASES = {"table": "text"}


def _format(value: str) -> str:
    return _ALIASES.get(value, value)


def add_output_flag(parser: argparse.ArgumentParser, *, wide: bool = False) -> None:
    """Add -o/--output; `wide`: the command has a wider text layout."""
    choices = [*FORMATS, *([WIDE] if wide else [])]
    parser.add_argument(
        "-o",
        "--output",
        type=_format,
        choices=choices,
        default="text",
        help=f"output format: {'|'.join(choices)} (default: text)",
    )


def dump(document: Any, fmt: str) -> str:
    """`document` as JSON or YAML text, ending with a newline."""
    if fmt == "json":
        return json.dumps(document, indent=2) + "\n"
    if fmt == "yaml":
        import yaml  # only for -o yaml

        return str(yaml.safe_dump(document, sort_keys=False, allow_unicode=False))
    raise ValueError(f"{fmt!r}: not a document format")
