"""`dra-gpu doctor`: its flags (the kubelet plugin's, with the same environment fallbacks) and the run.

Node checks need a GPU node (or --profile); cluster checks need a kubeconfig. Either part is
skipped with the reason when it cannot run; the exit status is 0 when nothing FAILs, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from dra_gpu.common.output_format import add_output_flag, dump
from dra_gpu.doctor.settings import (
    DEFAULT_CONTAINERD_CONFIG,
    DEFAULT_NODE_SELECTOR,
    ClusterSettings,
    NodeCheckSettings,
)
from dra_gpu.node.flags import add_node_flags


def add_doctor_command(sub: Any) -> None:
    env = os.environ.get
    d = sub.add_parser(
        "doctor",
        help="check a GPU node and the cluster for the usual GPU problems and say how to fix them",
        description="Node checks (driver, device nodes, CDI, containerd, the plugin) and cluster checks "
        "(DRA API, classes, slices, Pending pods, taints, webhook). Exit 0: nothing FAILs; 1: something "
        "does; 2: usage error.",
    )
    d.add_argument("--only", choices=("node", "cluster"), help="run only the node or only the cluster checks")
    add_output_flag(d)
    add_node_flags(d)
    d.add_argument(
        "--containerd-config",
        default=env("DRA_GPU_CONTAINERD_CONFIG", DEFAULT_CONTAINERD_CONFIG),
        help=f"containerd's config.toml (default: {DEFAULT_CONTAINERD_CONFIG})",
    )
    d.add_argument(
        "--cdi-hook-path",
        default=env("NVIDIA_CDI_HOOK_PATH"),
        help="the plugin's --cdi-hook-path ($NVIDIA_CDI_HOOK_PATH): its version and hooks are checked",
    )
    d.add_argument("--kubeconfig", default=env("KUBECONFIG"), help="default: ~/.kube/config, else in-cluster")
    d.add_argument(
        "--node-selector",
        default=DEFAULT_NODE_SELECTOR,
        help=f"the label of the driver's nodes (default: {DEFAULT_NODE_SELECTOR}, the chart's)",
    )
    d.add_argument("-n", "--namespace", help="Pending pods of this namespace only (default: all)")
    d.add_argument(
        "--webhook-url", help="reach the admission webhook here instead of its Service (https://...)"
    )
    d.add_argument("--timeout", type=float, default=10.0, help="seconds for each network call (default: 10)")


def _kubeconfig(args: argparse.Namespace) -> str | None:
    """--kubeconfig, $KUBECONFIG, ~/.kube/config; None: in-cluster, or no cluster at all."""
    if args.kubeconfig:
        return str(args.kubeconfig)
    home = Path.home() / ".kube" / "config"
    return str(home) if home.exists() else None


def cmd_doctor(args: argparse.Namespace) -> int:
    from dra_gpu.doctor.report import Result, exit_code, render_table, report_document, skip

    if args.timeout <= 0:
        print("dra-gpu doctor: --timeout must be positive", file=sys.stderr)
        return 2
    from dra_gpu.node.settings import NodeSettings

    settings = NodeSettings.from_args(args)  # the node's flags, resolved once for both halves
    results: list[Result] = []
    if args.only != "cluster":
        from dra_gpu.doctor.node_checks import run_node_checks

        node = NodeCheckSettings.of(
            settings,
            Path(args.containerd_config),
            timeout=min(args.timeout, 5.0),
            cdi_hook_path=args.cdi_hook_path,
        )
        results += run_node_checks(node)
    if args.only != "node":
        kubeconfig = _kubeconfig(args)
        if kubeconfig is None and not os.environ.get("KUBERNETES_SERVICE_HOST"):
            results.append(
                skip("cluster/api-server", "no kubeconfig (--kubeconfig, $KUBECONFIG, ~/.kube/config)")
            )
        else:
            from dra_gpu.doctor.cluster_checks import run_cluster_checks

            results += run_cluster_checks(
                ClusterSettings(
                    kubeconfig=kubeconfig,
                    driver=settings.driver,
                    node_selector=args.node_selector,
                    namespace=args.namespace,
                    webhook_url=args.webhook_url,
                    timeout=args.timeout,
                )
            )
    if args.output in ("json", "yaml"):
        print(dump(report_document(results), args.output), end="")
    else:
        print(render_table(results))
    return exit_code(results)
