"""`dra-gpu top` (also `kubectl dra-gpu top`): argparse wiring, reading the cluster, printing."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, TextIO

from dra_gpu.common.exit_codes import EXIT_OK, EXIT_USAGE
from dra_gpu.common.output_format import add_output_flag, dump
from dra_gpu.model.inventory import DEFAULT_DRIVER_NAME

CLEAR_SCREEN = "\x1b[H\x1b[2J"


def add_top_command(sub: Any) -> None:
    t = sub.add_parser(
        "top",
        help="the cluster's GPUs at a glance: free, held, shared, tainted, MIG (also `kubectl dra-gpu top`)",
    )
    t.add_argument(
        "--kubeconfig",
        default=os.environ.get("KUBECONFIG"),
        help="kubeconfig file ($KUBECONFIG, else ~/.kube/config, else in-cluster)",
    )
    t.add_argument("--driver-name", default=DEFAULT_DRIVER_NAME, help="DRA driver name")
    t.add_argument("--node", help="this node only")
    t.add_argument(
        "-n",
        "--namespace",
        help="only the GPUs claims of this namespace hold, with this namespace's holders",
    )
    t.add_argument("-w", "--watch", action="store_true", help="redraw on every change (watches, no polling)")
    add_output_flag(t)
    t.add_argument(
        "--timeout", type=float, default=30.0, help="seconds for the first read of the cluster (default: 30)"
    )


def _kubeconfig(value: str | None) -> str | None:
    if value:
        return value
    home = Path.home() / ".kube" / "config"
    return str(home) if home.exists() else None


class Printer:
    """Prints each view: text (coloured on a terminal) or JSON (one document a line under --watch)."""

    def __init__(self, args: argparse.Namespace, out: TextIO) -> None:
        self.args = args
        self.out = out
        self.tty = out.isatty()
        self.colour = self.tty and not os.environ.get("NO_COLOR")
        self.width = shutil.get_terminal_size((80, 24)).columns if self.tty else 80

    async def __call__(self, snapshot: Any) -> None:
        from dra_gpu.fleet.pending import explain_pending
        from dra_gpu.fleet.view import build_view

        pending = await explain_pending(snapshot, self.args.timeout)
        view = build_view(snapshot, node=self.args.node, namespace=self.args.namespace, pending=pending)
        if self.args.output == "json" and self.args.watch:  # one document a line
            from dra_gpu.fleet.as_json import view_to_json

            text = json.dumps(view_to_json(view)) + "\n"
        elif self.args.output in ("json", "yaml"):
            from dra_gpu.fleet.as_json import view_to_json

            text = dump(view_to_json(view), self.args.output)
            if self.args.watch:  # a stream of YAML documents
                text = "---\n" + text
        else:
            from dra_gpu.fleet.text import render_text

            text = render_text(view, self.width, self.colour)
            if self.args.watch:
                text = (CLEAR_SCREEN if self.tty else "\n") + text
        self.out.write(text)
        self.out.flush()


async def _run(args: argparse.Namespace, printer: Printer) -> None:
    from dra_gpu.fleet.read import Scope, read_once, watch
    from dra_gpu.kube.api import Kube

    scope = Scope(args.driver_name, args.node, args.namespace)
    kube = await Kube.connect(_kubeconfig(args.kubeconfig))
    try:
        if args.watch:
            await watch(kube, scope, printer, timeout=args.timeout)
        else:
            await printer(await read_once(kube, scope, args.timeout))
    finally:
        await kube.close()


def cmd_top(args: argparse.Namespace, out: TextIO | None = None) -> int:
    if args.timeout <= 0:
        print("dra-gpu top: --timeout must be positive", file=sys.stderr)
        return EXIT_USAGE
    try:
        asyncio.run(_run(args, Printer(args, out or sys.stdout)))
    except TimeoutError:
        print(f"dra-gpu top: the cluster did not answer within {args.timeout:g}s", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # no kubeconfig, connection refused, RBAC: the reason, not a traceback
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"dra-gpu top: cannot read the cluster: {first}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK
