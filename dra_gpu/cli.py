"""The `dra-gpu` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from collections.abc import Callable, Sequence

import yaml

from dra_gpu.controller.commands import add_commands
from dra_gpu.discovery import NvmlUnavailableError, ProfileError, discover_node
from dra_gpu.discovery.profiles import BUILTIN_PROFILES
from dra_gpu.inventory_report import render
from dra_gpu.model import DEFAULT_DRIVER_NAME
from dra_gpu.slices import SliceLimitError, build_slices

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def default_node_name() -> str:
    return os.environ.get("NODE_NAME") or socket.gethostname().lower()


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dra-gpu", description="Kubernetes DRA driver for NVIDIA GPUs")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug details to stderr")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    inv = sub.add_parser("inventory", help="discover this node's GPUs (or a simulated node's)")
    inv.add_argument(
        "--profile",
        metavar="NAME|PATH",
        help=f"simulated node: one of {', '.join(BUILTIN_PROFILES)} or a YAML file",
    )
    inv.add_argument(
        "--node-name", default=None, help="node (and pool) name; default: $NODE_NAME or the host name"
    )
    inv.add_argument("--driver-name", default=DEFAULT_DRIVER_NAME, help="DRA driver name")
    inv.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    inv.add_argument(
        "--slices", action="store_true", help="print the ResourceSlice objects that would be published"
    )
    p.set_defaults(extra_commands=add_commands(sub))
    return p


def cmd_inventory(args: argparse.Namespace) -> int:
    node = args.node_name or default_node_name()
    try:
        inventory = discover_node(node, args.profile)
    except NvmlUnavailableError as exc:
        print(
            f"dra-gpu: {exc}. No NVIDIA driver on this machine? Use a simulated node: "
            f"--profile NAME (one of {', '.join(BUILTIN_PROFILES)}) or --profile FILE.",
            file=sys.stderr,
        )
        return EXIT_USAGE
    except ProfileError as exc:
        print(f"dra-gpu: invalid profile: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.slices:
        try:
            slices = build_slices(inventory, args.driver_name)
        except SliceLimitError as exc:
            print(f"dra-gpu: cannot build ResourceSlices: {exc}", file=sys.stderr)
            return EXIT_INVALID
        if args.output == "json":
            print(json.dumps({"apiVersion": "v1", "kind": "List", "items": slices}, indent=2))
        elif args.output == "yaml":
            print(yaml.safe_dump_all(slices, sort_keys=False), end="")
        else:
            for s in slices:
                names = ", ".join(d["name"] for d in s["spec"]["devices"])
                print(f"{s['metadata']['name']}: {len(s['spec']['devices'])} devices: {names}")
        return EXIT_OK
    if args.output == "json":
        print(json.dumps(inventory.to_dict(), indent=2))
    elif args.output == "yaml":
        print(yaml.safe_dump(inventory.to_dict(), sort_keys=False), end="")
    else:
        print(render(inventory))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        stream=sys.stderr,
        format="time=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s",
    )
    handlers: dict[str, Callable[[argparse.Namespace], int]] = args.extra_commands
    commands = {"inventory": cmd_inventory, **handlers}
    try:
        return commands[args.command](args)
    except BrokenPipeError:
        return EXIT_OK
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
