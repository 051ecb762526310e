"""`dra-gpu kubelet-plugin`'s health flags and the `dra-gpu health` command (status, operator
taint / clear, simulated events), which talks to a running plugin's control socket."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from dra_gpu.common.exit_codes import EXIT_INVALID, EXIT_OK, EXIT_USAGE
from dra_gpu.common.output_format import add_output_flag, dump
from dra_gpu.health.classification import Classifier, parse_xids
from dra_gpu.health.control import SIMULATED_EVENTS, SOCKET_NAME, request
from dra_gpu.health.node import HealthConfig
from dra_gpu.health.taint_book import HoldDown
from dra_gpu.node.flags import add_node_flags
from dra_gpu.node.settings import NodeSettings


def add_health_flags(plug: argparse.ArgumentParser) -> None:
    env = os.environ.get
    plug.add_argument(
        "--health-monitor",
        choices=("on", "off"),
        default=env("DRA_GPU_HEALTH_MONITOR", "on"),
        help="watch NVML for XIDs, ECC errors and lost GPUs and taint devices ($DRA_GPU_HEALTH_MONITOR)",
    )
    plug.add_argument(
        "--claim-status",
        choices=("on", "off"),
        default=env("DRA_GPU_CLAIM_STATUS", "on"),
        help="write status.devices of prepared claims: device data, Ready and Healthy conditions "
        "($DRA_GPU_CLAIM_STATUS; needs patch on resourceclaims/status)",
    )
    plug.add_argument(
        "--health-check-interval",
        type=float,
        default=float(env("DRA_GPU_HEALTH_CHECK_INTERVAL", "5")),
        help="seconds between a GPU's liveness / recovery-action checks",
    )
    plug.add_argument(
        "--health-hold-down",
        type=float,
        default=float(env("DRA_GPU_HEALTH_HOLD_DOWN", "300")),
        help="seconds a tainted device must pass its checks before the taint goes (doubles when it "
        "flaps, up to --health-max-hold-down)",
    )
    plug.add_argument(
        "--health-max-hold-down", type=float, default=float(env("DRA_GPU_HEALTH_MAX_HOLD_DOWN", "3600"))
    )
    for name, var, what in (
        (
            "ignore",
            "DRA_GPU_HEALTH_IGNORE_XIDS",
            "application XIDs: counted, never tainted (added to 13,31,43,45,68,109)",
        ),
        (
            "no-schedule",
            "DRA_GPU_HEALTH_NO_SCHEDULE_XIDS",
            "XIDs that taint NoSchedule (default: every XID not otherwise classed)",
        ),
        ("no-execute", "DRA_GPU_HEALTH_NO_EXECUTE_XIDS", "XIDs that taint NoExecute (added to 79,95,140)"),
    ):
        plug.add_argument(
            f"--health-{name}-xids", default=env(var, ""), metavar="N,N", help=f"{what} (${var})"
        )


def health_config(args: argparse.Namespace) -> HealthConfig:
    """The flags as a HealthConfig; ValueError names the flag that is wrong."""
    if args.health_hold_down < 0 or args.health_max_hold_down < args.health_hold_down:
        raise ValueError("--health-max-hold-down must be >= --health-hold-down >= 0")
    if args.health_check_interval <= 0:
        raise ValueError("--health-check-interval must be > 0")
    classifier = Classifier.with_overrides(
        ignore_xids=parse_xids(args.health_ignore_xids, "--health-ignore-xids"),
        no_execute_xids=parse_xids(args.health_no_execute_xids, "--health-no-execute-xids"),
        no_schedule_xids=parse_xids(args.health_no_schedule_xids, "--health-no-schedule-xids"),
    )
    return HealthConfig(
        enabled=args.health_monitor == "on",
        check_interval=args.health_check_interval,
        hold_down=HoldDown(
            initial=args.health_hold_down,
            maximum=args.health_max_hold_down,
            flap_window=max(6 * args.health_hold_down, 1.0),
        ),
        classifier=classifier,
        claim_status=args.claim_status == "on",
    )


def add_health_command(sub: Any) -> None:
    h = sub.add_parser(
        "health",
        help="a running kubelet plugin's device health: status, operator taint/clear, simulated events",
    )
    add_node_flags(h, "driver-name", "nvidia-compatible", "plugin-dir")
    add_output_flag(h)
    ops = h.add_subparsers(dest="health_op", required=True)
    ops.add_parser("status", help="each device's health and taint")
    t = ops.add_parser("taint", help="taint a device on purpose; it stays until `clear`")
    t.add_argument("device")
    t.add_argument("--effect", choices=("NoSchedule", "NoExecute"), default="NoSchedule")
    t.add_argument("--cause", default="operator", help="the taint's value (a label value)")
    c = ops.add_parser("clear", help="remove a device's taint now (forced or not)")
    c.add_argument("device")
    s = ops.add_parser("simulate", help="simulated node only: make its simulated kernel report an event")
    s.add_argument("event", choices=SIMULATED_EVENTS)
    s.add_argument(
        "--gpu",
        required=True,
        help="GPU index, UUID or device name; or a MIG device's or a dynamic-MIG placement's",
    )
    s.add_argument("--xid", type=int, help="the XID (event xid)")
    s.add_argument("--action", help="event recovery-action: none, gpu-reset, node-reboot, ...")
    s.add_argument("--gi", type=int, help="GPU-instance ID of the event (MIG)")
    s.add_argument("--ci", type=int, help="compute-instance ID of the event (MIG)")


def cmd_health(args: argparse.Namespace) -> int:
    plugin_dir = NodeSettings.from_args(args).plugin_dir
    body: dict[str, Any] = {"op": args.health_op}
    if args.health_op == "taint":
        body.update(device=args.device, effect=args.effect, cause=args.cause)
    elif args.health_op == "clear":
        body.update(device=args.device)
    elif args.health_op == "simulate":
        if args.event == "xid" and args.xid is None:
            print("dra-gpu health simulate xid: --xid is required", file=sys.stderr)
            return EXIT_USAGE
        body.update(event=args.event, gpu=args.gpu, xid=args.xid, action=args.action, gi=args.gi, ci=args.ci)
    try:
        reply = request(plugin_dir / SOCKET_NAME, body)
    except OSError as exc:
        print(
            f"dra-gpu health: no plugin answers on {plugin_dir / SOCKET_NAME}: {exc} "
            "(is it running, and is --plugin-dir its --plugin-dir?)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if not reply.get("ok"):
        print(f"dra-gpu health {args.health_op}: {reply.get('error')}", file=sys.stderr)
        return EXIT_INVALID
    if args.output in ("json", "yaml") or args.health_op != "status":
        reply.pop("ok", None)
        print(dump(reply, "yaml" if args.output == "yaml" else "json"), end="")
        return EXIT_OK
    rows = [("DEVICE", "HEALTH", "TAINT", "MESSAGE")]
    for d in reply["devices"]:
        taint = (d["taint"] or "-") + (" (forced)" if d.get("forced") else "")
        rows.append((d["device"], "Healthy" if d["healthy"] else "Unhealthy", taint, d["message"] or ""))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3])
    return EXIT_OK
