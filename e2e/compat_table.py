#!/usr/bin/env python3
"""The compatibility table of docs/development.md, from the compatibility suite's records
(e2e/tests/test_compat.py writes one JSON file a cluster into $DRA_GPU_COMPAT_RESULTS; e2e/compat.sh
runs it on every release).

    e2e/compat_table.py RESULTS_DIR [--readme docs/development.md]

Prints the table (Markdown); with --readme, replaces the table between its markers in that file
(temp file + rename). A table is only ever made from records: a cell no run filled says so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

START, END = "<!-- compat-table:start -->", "<!-- compat-table:end -->"
FEATURES = ("core path", "device taints (GPU health)", "memory shares", "dynamic MIG")
GATES = {"default": "its default gates", "all": "all DRA gates on", "pinned": "the e2e's gates"}


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.lstrip("v").split(".") if x.isdigit())


def column(doc: dict) -> str:
    kube, kubelet = doc["kube"], doc["kubelet"]
    head = kube if kube == kubelet else f"{kube}, kubelet {kubelet}"
    return f"{head} ({GATES.get(doc['gates'], doc['gates'] or 'gates as set')})"


def table(docs: list[dict]) -> str:
    docs = sorted(docs, key=lambda d: (_version_key(d["kube"]), _version_key(d["kubelet"]), d["gates"]))
    heads = [column(d) for d in docs]
    lines = ["| feature | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    for feature in FEATURES:
        cells = []
        for d in docs:
            r = d["results"].get(feature)
            cells.append("not run" if r is None else r["status"].replace("needs ", "needs gate "))
        lines.append(f"| {feature} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def replace_in(readme: Path, text: str) -> None:
    old = readme.read_text()
    if START not in old or END not in old:
        raise SystemExit(f"{readme}: no {START} ... {END} markers")
    before, rest = old.split(START, 1)
    _, after = rest.split(END, 1)
    new = f"{before}{START}\n{text}{END}{after}"
    fd, tmp = tempfile.mkstemp(dir=readme.parent, prefix=f".{readme.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(new)
    os.replace(tmp, readme)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--readme", type=Path)
    args = ap.parse_args(argv)
    docs = [json.loads(p.read_text()) for p in sorted(args.results.glob("*.json"))]
    if not docs:
        print(f"no records in {args.results}", file=sys.stderr)
        return 2
    text = table(docs)
    print(text, end="")
    if args.readme:
        replace_in(args.readme, text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
