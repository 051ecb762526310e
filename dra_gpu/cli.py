"""The `dra-gpu` command line (also installed as `kubectl-dra_gpu`: kubectl's plugin convention
makes `kubectl dra-gpu top` run `kubectl-dra_gpu top`).

The node side (discovery, NVML, the plugin, health, doctor) is imported where its commands are
built or run: `dra-gpu validate` and `dra-gpu explain` start without it (~0.15 s of imports).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dra_gpu.common.exit_codes import EXIT_INTERRUPTED, EXIT_INVALID, EXIT_OK, EXIT_STATE, EXIT_USAGE
from dra_gpu.common.log_format import FORMATS as LOG_FORMATS
from dra_gpu.common.log_format import MAX_VERBOSITY, V
from dra_gpu.common.log_format import formatter as log_formatter
from dra_gpu.common.output_format import add_output_flag
from dra_gpu.common.safe_output import safe_streams
from dra_gpu.controller.commands import add_commands
from dra_gpu.model.nvidia_compat import DriverNameError

CONTROLLER_COMMANDS = ("validate", "explain", "controller")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        return super().parse_known_args(bare_verbosity(sys.argv[1:] if args is None else args), namespace)


# Verbosity, as klog's -v: `-v N`, `-v=N`, `--v=N`, `--verbosity N`, N in 0..10 (log_format.V maps
# N to a logging level). A bare -v, the debug switch it was, is -v=4: debug.
BARE_V = 4
_NUMBER = re.compile(r"^[+-]?[0-9]+$")
_LEVEL = re.compile(r"^[0-9]{1,6}$")


def bare_verbosity(argv: Sequence[str]) -> list[str]:
    """`argv` with each bare `-v` (the next word no number, or none) written `-v=4`: argparse would
    take the word after a `-v` that wants a value, such as the subcommand, for its level."""
    out = list(argv)
    for i, word in enumerate(out):
        if word == "--":
            break
        if word == "-v" and (i + 1 == len(out) or not _NUMBER.match(out[i + 1])):
            out[i] = f"-v={BARE_V}"
    return out


def verbosity_level(value: str) -> int:
    """-v's N: a whole number 0..10."""
    text = value.strip()
    if _LEVEL.match(text) and int(text) <= MAX_VERBOSITY:
        return int(text)
    hint = " (-v=N as klog's; -vv is not counted)" if text and set(text) == {"v"} else ""
    raise argparse.ArgumentTypeError(f"{value!r} is not a verbosity level 0..{MAX_VERBOSITY}{hint}")


def _add_verbosity_flags(parser: argparse.ArgumentParser, *, after_command: bool) -> None:
    kw: dict[str, Any] = {"default": argparse.SUPPRESS} if after_command else {"default": None}
    parser.add_argument(
        "-v",
        "--v",
        "--verbosity",
        dest="verbosity",
        type=verbosity_level,
        metavar="N",
        help="as before the command"
        if after_command
        else f"log verbosity 0..{MAX_VERBOSITY}, as klog's -v: 0 info, 2 each kubelet call, 4 debug, 5 each "
        f"request; a bare -v is -v={BARE_V} ($DRA_GPU_VERBOSITY; default: 0)",
        **kw,
    )
    parser.add_argument(
        "--verbose",
        dest="verbosity",
        action="store_const",
        const=BARE_V,
        help=argparse.SUPPRESS if after_command else f"-v={BARE_V} (deprecated)",
        **kw,
    )


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


# A MIG profile as NVML names it: slices, memory, options ("1g.10gb", "1g.18gb+me", "7g.141gb").
_MIG_PROFILE = re.compile(r"^[0-9]{1,2}g\.[0-9]{1,4}gb(\+[a-z]{1,8}){0,4}$")


def mig_profile_list(value: str) -> tuple[str, ...]:
    """`--mig-profiles`: comma-separated MIG profile names; empty: every profile."""
    names = tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    bad = [n for n in names if not _MIG_PROFILE.match(n)]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{', '.join(repr(b[:40]) for b in bad)} is not a MIG profile name (such as 1g.10gb, 3g.40gb, "
            "1g.18gb+me)"
        )
    return names


def _add_mig_profiles(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mig-profiles",
        type=mig_profile_list,
        default=os.environ.get("DRA_GPU_MIG_PROFILES", ""),
        metavar="PROFILE,...",
        help="with --dynamic-mig: offer only these MIG profiles' placements (e.g. 1g.10gb,3g.40gb,7g.80gb); "
        "each profile left out is fewer devices for the scheduler to evaluate per claim "
        "($DRA_GPU_MIG_PROFILES); default: every profile the GPU has",
    )


def _version() -> str:
    import importlib.metadata  # ~40 ms of imports, for --version only

    try:
        return importlib.metadata.version("dra-gpu")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree without installing
        return "unknown"


class _VersionAction(argparse.Action):
    """--version: the installed version, looked up only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(f"{parser.prog} {_version()}")
        parser.exit()


def _parser(controller_only: bool = False) -> argparse.ArgumentParser:
    """The command line; `controller_only`: just the CONTROLLER_COMMANDS, for an argv that names one
    of them (their parsing, help and errors are the same either way)."""
    p = _Parser(prog="dra-gpu", description="Kubernetes DRA driver for NVIDIA GPUs")
    _add_verbosity_flags(p, after_command=False)
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=os.environ.get("DRA_GPU_LOG_FORMAT") or "text",
        help="log lines as logfmt (text) or one JSON object a line; RFC 3339 UTC times "
        "($DRA_GPU_LOG_FORMAT; default: text)",
    )
    p.add_argument("--version", action=_VersionAction, help="show program's version number and exit")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    if not controller_only:
        _add_node_commands(sub)
        from dra_gpu.fleet.command import add_top_command

        add_top_command(sub)
    p.set_defaults(extra_commands=add_commands(sub))
    _global_flags_after_subcommands(p)
    return p


def _global_flags_after_subcommands(parser: argparse.ArgumentParser) -> None:
    """-v (and its other names) and --log-format also after any subcommand (`dra-gpu explain -f x
    -v=2`), as kubectl takes its global flags anywhere; not given there, the value before it stands
    (SUPPRESS)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                if "--verbosity" not in child._option_string_actions:
                    _add_verbosity_flags(child, after_command=True)
                if "--log-format" not in child._option_string_actions:
                    child.add_argument(
                        "--log-format",
                        choices=LOG_FORMATS,
                        default=argparse.SUPPRESS,
                        help="as before the command",
                    )
                _global_flags_after_subcommands(child)


def _add_node_commands(sub: Any) -> None:
    from dra_gpu.doctor.command import add_doctor_command
    from dra_gpu.health.command import add_health_command, add_health_flags
    from dra_gpu.node.flags import add_node_flags

    inv = sub.add_parser("inventory", help="discover this node's GPUs (or a simulated node's)")
    inv.add_argument(
        "--profile",
        metavar="NAME|PATH",
        help="a simulated node: a built-in profile's name or a YAML file (needs the simulator package, "
        "dra-gpu-simnode)",
    )
    inv.add_argument(
        "--node-name", default=None, help="node (and pool) name; default: $NODE_NAME or the host name"
    )
    add_output_flag(inv)
    add_node_flags(inv, "driver-root", "driver-name", "nvidia-compatible")
    inv.add_argument(
        "--slices", action="store_true", help="print the ResourceSlice objects that would be published"
    )
    inv.add_argument(
        "--memory-shares",
        action="store_true",
        help="with --slices: as the plugin's --memory-shares publishes",
    )
    inv.add_argument(
        "--dynamic-mig",
        action="store_true",
        default=_flag(os.environ.get("DRA_GPU_DYNAMIC_MIG")),
        help="publish GPUs in MIG mode as every MIG placement, made at prepare ($DRA_GPU_DYNAMIC_MIG)",
    )
    _add_mig_profiles(inv)
    plug = sub.add_parser("kubelet-plugin", help="run the node plugin (kubelet gRPC, slices, CDI)")
    env = os.environ.get
    add_node_flags(plug)
    plug.add_argument(
        "--kubeconfig", default=env("KUBECONFIG"), help="kubeconfig file; default: in-cluster config"
    )
    plug.add_argument(
        "--host-driver-root",
        default=env("NVIDIA_HOST_DRIVER_ROOT"),
        help="the same directory as the container runtime on the host sees it, when the plugin runs "
        "in a pod with the host's driver root mounted elsewhere ($NVIDIA_HOST_DRIVER_ROOT); "
        "default: --driver-root",
    )
    plug.add_argument(
        "--cdi-hook-path",
        default=env("NVIDIA_CDI_HOOK_PATH"),
        help="host path of NVIDIA's nvidia-cdi-hook (or nvidia-ctk), which the plugin must see at the "
        "same path: adds NVIDIA's hooks for the driver's libraries that the program has, asked at "
        "start (create-symlinks and update-ldcache needed; enable-cuda-compat, toolkit 1.17.5, and "
        "disable-device-node-modification, toolkit 1.18.0, left out when it lacks them), so images "
        "whose loader does not search the driver's library directory find it "
        "($NVIDIA_CDI_HOOK_PATH); default: none",
    )
    plug.add_argument(
        "--dynamic-mig",
        action="store_true",
        default=_flag(env("DRA_GPU_DYNAMIC_MIG")),
        help="dynamic MIG: publish each GPU in MIG mode as every (profile, placement) NVML lists and "
        "create the instance at prepare, destroy it at unprepare ($DRA_GPU_DYNAMIC_MIG=true); "
        "default: off (pre-made MIG instances are published as they are)",
    )
    _add_mig_profiles(plug)
    plug.add_argument(
        "--http-address",
        default=env("DRA_GPU_HTTP_ADDRESS", "127.0.0.1:51516"),
        help="host:port of /healthz and /metrics; empty disables",
    )
    plug.add_argument(
        "--memory-shares",
        action="store_true",
        default=_flag(env("DRA_GPU_MEMORY_SHARES")),
        help="publish whole GPUs as shareable by memory (consumable capacity): several claims per "
        "GPU, each enforced by its own MPS daemon ($DRA_GPU_MEMORY_SHARES)",
    )
    plug.add_argument(
        "--mps-daemons",
        choices=("auto", "pod", "process"),
        default=env("DRA_GPU_MPS_DAEMONS", "auto"),
        help="where each MPS control daemon runs: pod (a pod of its own on this node, made from the "
        "plugin's pod, which it outlives), process (a detached process of the node); auto: pod when "
        "the plugin runs in a pod ($POD_NAME and $POD_NAMESPACE set), process otherwise "
        "($DRA_GPU_MPS_DAEMONS, default auto)",
    )
    plug.add_argument(
        "--mps-shm-size",
        default=env("DRA_GPU_MPS_SHM_SIZE", ""),
        help="size of each MPS daemon's /dev/shm, shared with its claim's containers (a quantity, "
        "e.g. 16Gi; a cap, charged to whoever writes it); default: half the node's memory, as the "
        "kernel sizes a tmpfs ($DRA_GPU_MPS_SHM_SIZE)",
    )
    plug.add_argument(
        "--mps-daemon-resources",
        default=env("DRA_GPU_MPS_DAEMON_RESOURCES", ""),
        help="the resources (JSON: requests, limits) of each MPS daemon's pod "
        "($DRA_GPU_MPS_DAEMON_RESOURCES)",
    )
    plug.add_argument(
        "--driver-memory-limits",
        choices=("auto", "off"),
        default=env("DRA_GPU_DRIVER_MEMORY_LIMITS", "auto"),
        help="with --memory-shares: hold each share's container to its size with the driver's "
        "per-cgroup GPU memory limits (driver 580+, cgroup v2, --cdi-hook-path to nvidia-cdi-hook "
        ">= 1.20.1) where the node has them; otherwise, or with off, only the share's MPS daemon "
        "limits it, cooperatively ($DRA_GPU_DRIVER_MEMORY_LIMITS, default auto)",
    )
    plug.add_argument(
        "--claim-watch",
        action=argparse.BooleanOptionalAction,
        default=_flag(env("DRA_GPU_CLAIM_WATCH", "true")),
        help="read the claims of this node's prepares from one watch of the ResourceClaims instead "
        "of a GET on each prepare ($DRA_GPU_CLAIM_WATCH, default true); every node then receives "
        "every claim change of the cluster (dynamic MIG watches them anyway)",
    )
    plug.add_argument(
        "--device-metadata",
        choices=("auto", "on", "off"),
        default=env("DRA_GPU_DEVICE_METADATA", "auto"),
        help="KEP-5304 device metadata: a file per claim request, mounted into its containers under "
        "/var/run/kubernetes.io/dra-device-attributes, naming its devices and their attributes "
        "(UUIDs, MIG profile and parent, NVLink domain); auto: where the node's kubelet is 1.37 or "
        "newer (beta there) ($DRA_GPU_DEVICE_METADATA, default auto)",
    )
    plug.add_argument(
        "--sweep-interval",
        type=float,
        default=float(env("DRA_GPU_SWEEP_INTERVAL", "600")),
        help="seconds between stale-claim sweeps",
    )
    plug.add_argument(
        "--sweep-grace",
        type=float,
        default=float(env("DRA_GPU_SWEEP_GRACE", "60")),
        help="seconds a claim must be gone before the sweeper unprepares it",
    )
    plug.add_argument(
        "--pod-uid",
        default=env("POD_UID", ""),
        help="the plugin pod's UID ($POD_UID, the chart sets it): rolling updates, a new pod's plugin "
        "registers beside the old one's under socket names of its own and the two take turns on the "
        "node's claims (a lock in the plugin directory); empty: the fixed socket names, one instance",
    )
    plug.add_argument(
        "--successor-wait",
        type=float,
        default=float(env("DRA_GPU_SUCCESSOR_WAIT", "10")),
        help="with --pod-uid, seconds a stopping plugin keeps serving until another instance of the "
        "driver answers on its registration socket ($DRA_GPU_SUCCESSOR_WAIT, default 10; 0: stop at once)",
    )
    plug.add_argument(
        "--enable-failpoints",
        action="store_true",
        help="tests only: obey $DRA_GPU_FAILPOINTS (named points where the plugin kills itself or "
        "fails); without this flag the variable is ignored, with a warning",
    )
    add_health_flags(plug)
    add_health_command(sub)
    add_doctor_command(sub)
    from dra_gpu.node.wait_for_driver import add_wait_for_driver_command

    add_wait_for_driver_command(sub)


def cmd_kubelet_plugin(args: argparse.Namespace) -> int:
    from dra_gpu.common import failpoints
    from dra_gpu.discovery import NvmlUnavailableError
    from dra_gpu.health.command import health_config
    from dra_gpu.node.profiles import NodePreparationError
    from dra_gpu.node.settings import NodeSettings
    from dra_gpu.plugin.checkpoint import CheckpointRebuildError, CheckpointVersionError
    from dra_gpu.plugin.server import MpsSettings, PluginConfig, run

    if not args.node_name:
        print("dra-gpu kubelet-plugin: --node-name (or $NODE_NAME) is required", file=sys.stderr)
        return EXIT_USAGE
    if args.driver_memory_limits not in ("auto", "off"):  # argparse does not check an env default
        print(
            f"dra-gpu kubelet-plugin: --driver-memory-limits (or $DRA_GPU_DRIVER_MEMORY_LIMITS): "
            f"{args.driver_memory_limits!r} is not auto or off",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.device_metadata not in ("auto", "on", "off"):  # argparse does not check an env default
        print(
            f"dra-gpu kubelet-plugin: --device-metadata (or $DRA_GPU_DEVICE_METADATA): "
            f"{args.device_metadata!r} is not auto, on or off",
            file=sys.stderr,
        )
        return EXIT_USAGE
    failpoints.enable(args.enable_failpoints)
    try:
        cfg = PluginConfig(
            node=NodeSettings.from_args(args),
            kubeconfig=args.kubeconfig,
            http_address=args.http_address,
            cdi_hook_path=args.cdi_hook_path,
            driver_memory_limits=args.driver_memory_limits,
            sweep_interval=args.sweep_interval,
            sweep_grace=args.sweep_grace,
            health=health_config(args),
            claim_watch=args.claim_watch,
            device_metadata=args.device_metadata,
            mps=MpsSettings.parse(args.mps_daemons, args.mps_shm_size, args.mps_daemon_resources),
            pod_uid=args.pod_uid,
            successor_wait=args.successor_wait,
        )
        cfg.check()
        return run(cfg)
    except (CheckpointVersionError, CheckpointRebuildError) as exc:
        print(f"dra-gpu kubelet-plugin: {exc}", file=sys.stderr)
        return EXIT_STATE
    except (NvmlUnavailableError, NodePreparationError, ValueError) as exc:
        print(f"dra-gpu kubelet-plugin: {exc}", file=sys.stderr)
        return EXIT_USAGE


def cmd_inventory(args: argparse.Namespace) -> int:
    import tempfile

    import yaml

    from dra_gpu.discovery import NvmlUnavailableError
    from dra_gpu.discovery.driver_install import describe as describe_installation
    from dra_gpu.discovery.driver_install import discover_installation
    from dra_gpu.discovery.driver_versions import DriverVersionMismatchError
    from dra_gpu.node.backend import open_backend
    from dra_gpu.node.inventory_report import render
    from dra_gpu.node.profiles import INSTALL_HINT, NodePreparationError, profile_names
    from dra_gpu.node.settings import NodeSettings
    from dra_gpu.node.slices import SliceLimitError, build_slices

    node = NodeSettings.from_args(args)
    try:
        # A simulated node's device nodes go into a directory of this run only (its boot state).
        with tempfile.TemporaryDirectory(prefix="dra-gpu-inventory-") as scratch:
            dev_root = Path(scratch) if node.simulated else node.dev_root
            backend = open_backend(node.profile, node.driver_root, dev_root, node.cache_dir)
            inventory = backend.discover(node.node_name, dynamic_mig=node.dynamic_mig)
    except NodePreparationError as exc:
        print(f"dra-gpu: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except DriverVersionMismatchError as exc:  # a driver is there, of two versions
        print(f"dra-gpu: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NvmlUnavailableError as exc:
        if args.profile:
            print(f"dra-gpu: simulated node {args.profile}: {exc}", file=sys.stderr)
            return EXIT_USAGE
        names = profile_names()
        print(
            f"dra-gpu: {exc}. No NVIDIA driver on this machine? Use a simulated node: "
            + (f"--profile NAME (one of {', '.join(names)}) or --profile FILE." if names else INSTALL_HINT),
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.slices:
        try:
            slices = build_slices(
                inventory, node.driver, memory_shares=node.memory_shares, mig_profiles=node.mig_profiles
            )
        except SliceLimitError as exc:
            print(f"dra-gpu: cannot build ResourceSlices: {exc}", file=sys.stderr)
            return EXIT_INVALID
        if args.output == "json":
            print(json.dumps({"apiVersion": "v1", "kind": "List", "items": slices}, indent=2))
        elif args.output == "yaml":
            print(yaml.safe_dump_all(slices, sort_keys=False), end="")
        else:
            for s in slices:
                devices = s["spec"].get("devices") or []
                sets = [c["name"] for c in s["spec"].get("sharedCounters") or []]
                what = f"{len(sets)} counter sets: {', '.join(sets)}" if sets else ""
                what = what or f"{len(devices)} devices: {', '.join(d['name'] for d in devices)}"
                print(f"{s['metadata']['name']}: {what}")
        return EXIT_OK
    installation = (
        discover_installation(backend.driver_root, inventory.driver_version)
        if inventory.driver_version
        else None
    )
    if args.output in ("json", "yaml"):
        doc = inventory.to_dict()
        doc["driverInstallation"] = installation.summary() if installation else None
        if args.output == "json":
            print(json.dumps(doc, indent=2))
        else:
            print(yaml.safe_dump(doc, sort_keys=False), end="")
    else:
        print(render(inventory))
        print()
        print("\n".join(describe_installation(installation, str(backend.driver_root))))
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from dra_gpu.doctor.command import cmd_doctor as run_doctor

    return run_doctor(args)


def cmd_health(args: argparse.Namespace) -> int:
    from dra_gpu.health.command import cmd_health as run_health

    return run_health(args)


def cmd_top(args: argparse.Namespace) -> int:
    from dra_gpu.fleet.command import cmd_top as run_top

    return run_top(args)


def cmd_wait_for_driver(args: argparse.Namespace) -> int:
    from dra_gpu.node.wait_for_driver import cmd_wait_for_driver as run_wait

    return run_wait(args)


def _command_word(argv: Sequence[str]) -> str | None:
    """The subcommand argv names (global flags take no values), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Every command prints names it read (files, the API server): escaped once here, for all of
    # them, their errors and the log handler. `top` draws with its own escape sequences and
    # escapes what it shows (dra_gpu.fleet.text).
    with safe_streams(escape_stdout=_command_word(argv) != "top"):
        return _main(argv)


def resolve_verbosity(flag: int | None, environ: Mapping[str, str]) -> int:
    """The flag's level, else $DRA_GPU_VERBOSITY's (ArgumentTypeError when not 0..10), else 0."""
    if flag is not None:
        return flag
    env = environ.get("DRA_GPU_VERBOSITY", "").strip()
    return verbosity_level(env) if env else 0


def library_level(verbosity: int) -> int:
    """The level of the libraries' own loggers (gRPC, asyncio, aiohttp, the Kubernetes client) at
    -v=1 and above: their warnings below -v=4, their info lines up to -v=9, everything at -v=10."""
    if verbosity < BARE_V:
        return logging.WARNING
    return logging.INFO if verbosity < MAX_VERBOSITY else logging.NOTSET


def _main(argv: list[str]) -> int:
    args = _parser(controller_only=_command_word(argv) in CONTROLLER_COMMANDS).parse_args(argv)
    try:
        args.verbosity = resolve_verbosity(args.verbosity, os.environ)
    except argparse.ArgumentTypeError as exc:
        print(f"dra-gpu: error: $DRA_GPU_VERBOSITY: {exc}", file=sys.stderr)
        return EXIT_USAGE
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(log_formatter(args.log_format))
    logging.basicConfig(level=V(args.verbosity) if args.verbosity else logging.WARNING, handlers=[handler])
    if args.verbosity:  # this driver's lines down to V(N), not all of the libraries' internals
        for noisy in ("grpc", "asyncio", "aiohttp", "kubernetes"):
            logging.getLogger(noisy).setLevel(library_level(args.verbosity))
    elif args.command not in ("inventory", "top"):  # their output is the screen: no info lines
        logging.getLogger("dra_gpu").setLevel(logging.INFO)
    handlers: dict[str, Callable[[argparse.Namespace], int]] = args.extra_commands
    commands = {
        "inventory": cmd_inventory,
        "kubelet-plugin": cmd_kubelet_plugin,
        "doctor": cmd_doctor,
        "health": cmd_health,
        "wait-for-driver": cmd_wait_for_driver,
        "top": cmd_top,
        **handlers,
    }
    try:
        return commands[args.command](args)
    except DriverNameError as exc:
        print(f"dra-gpu {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
