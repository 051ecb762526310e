"""`dra-gpu wait-for-driver`: the kubelet plugin pod's init container. The GPU Operator installs
the driver into /run/nvidia/driver after the plugin's pod may have started; the plugin would fail
its start and the kubelet back off for up to 5 minutes between restarts. This waits until the
driver root holds NVML's library, saying what it waits for, then lets the plugin start at once."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from dra_gpu.common.exit_codes import EXIT_INVALID, EXIT_OK
from dra_gpu.discovery.nvml_discovery import NvmlUnavailableError
from dra_gpu.discovery.nvml_library import find_nvml
from dra_gpu.node.flags import add_node_flags

SAY_EVERY_S = 60.0


def add_wait_for_driver_command(sub: Any) -> None:
    w = sub.add_parser(
        "wait-for-driver",
        help="wait until the driver root holds the NVIDIA driver (the plugin pod's init container)",
    )
    add_node_flags(w, "driver-root")
    w.add_argument("--timeout", type=float, default=0.0, help="give up after this many seconds (0: never)")
    w.add_argument("--interval", type=float, default=2.0, help="seconds between looks (default: 2)")


def cmd_wait_for_driver(args: argparse.Namespace) -> int:
    root = Path(args.driver_root or "/")
    start = time.monotonic()
    said = -SAY_EVERY_S
    while True:
        try:
            library = find_nvml(root)
        except NvmlUnavailableError as exc:
            waited = time.monotonic() - start
            if args.timeout and waited >= args.timeout:
                print(
                    f"dra-gpu wait-for-driver: no NVIDIA driver after {waited:.0f} s: {exc}", file=sys.stderr
                )
                return EXIT_INVALID
            if waited - said >= SAY_EVERY_S:  # once a minute: a log that shows it is waiting, not stuck
                said = waited
                print(
                    f"waiting for the NVIDIA driver under {root} ({waited:.0f} s so far): {exc}; the GPU "
                    "Operator's driver container installs it into /run/nvidia/driver "
                    "(the chart's kubeletPlugin.nvidiaDriverRoot)",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(args.interval)
            continue
        print(f"NVIDIA driver found: {library}", flush=True)
        return EXIT_OK
