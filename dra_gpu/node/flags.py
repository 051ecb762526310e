"""The flags that say which node this is and where its files are, with their environment fallbacks.

`kubelet-plugin`, `doctor` and `health` must agree on them (doctor and health look at what a
running plugin made), so each flag is declared once here and the commands pick the ones they use.
Defaults are read from the environment when the parser is built, as in the plugin's DaemonSet;
what a flag left unset comes to is resolved once, in dra_gpu.node.settings.NodeSettings.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from dra_gpu.model.inventory import DEFAULT_DRIVER_NAME
from dra_gpu.model.nvidia_compat import DRIVER_NAME as NVIDIA_DRIVER_NAME

DEFAULT_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
DEFAULT_CDI_DIR = "/var/run/cdi"


def _specs() -> dict[str, dict[str, Any]]:
    env = os.environ.get
    return {
        "node-name": {
            "default": env("NODE_NAME"),
            "help": "this node's name ($NODE_NAME, from the downward API in a pod); kubelet-plugin "
            "requires it, the other commands default to the host name",
        },
        "driver-name": {
            "default": env("DRIVER_NAME"),
            "help": f"DRA driver name ($DRIVER_NAME; default {DEFAULT_DRIVER_NAME}, with "
            f"--nvidia-compatible {NVIDIA_DRIVER_NAME})",
        },
        "nvidia-compatible": {
            "action": "store_true",
            "default": env("DRA_GPU_NVIDIA_COMPATIBLE", "").lower() in ("1", "true", "yes"),
            "help": "run as NVIDIA's DRA driver does: driver name gpu.nvidia.com, so manifests "
            "written for it run unchanged ($DRA_GPU_NVIDIA_COMPATIBLE)",
        },
        "profile": {
            "default": env("DRA_GPU_PROFILE"),
            "metavar": "NAME|PATH",
            "help": "a simulated node instead of NVML ($DRA_GPU_PROFILE)",
        },
        "plugin-dir": {
            "default": env("DRA_GPU_PLUGIN_DIR"),
            "help": "the plugin's directory ($DRA_GPU_PLUGIN_DIR); "
            "default: /var/lib/kubelet/plugins/<driver>",
        },
        "registry-dir": {"default": env("DRA_GPU_REGISTRY_DIR", DEFAULT_REGISTRY_DIR)},
        "cdi-dir": {"default": env("DRA_GPU_CDI_DIR", DEFAULT_CDI_DIR)},
        "dev-root": {
            "default": env("DRA_GPU_DEV_ROOT"),
            "help": "root of dev/ and proc/ for device nodes ($DRA_GPU_DEV_ROOT); default: / (with "
            "--profile: <plugin-dir>/simulated-root, where the simulated nodes are made)",
        },
        "driver-root": {
            "default": env("NVIDIA_DRIVER_ROOT"),
            "help": "where the NVIDIA driver's files are installed, as this process sees it; NVML is "
            "its libnvidia-ml.so.1 ($NVIDIA_DRIVER_ROOT; GPU operator: /run/nvidia/driver); "
            "default: / (with --profile: the profile's simulated driver, built on first use with "
            "the C compiler and cached)",
        },
    }


def add_node_flags(parser: argparse.ArgumentParser, *names: str) -> None:
    """Add the named flags (e.g. "plugin-dir") in the order given; all of them when none is named."""
    specs = _specs()
    for name in names or tuple(specs):
        parser.add_argument(f"--{name}", **specs[name])
